"""Log-probs of token samples, and the frozen reference's log-probs computed once per stage.

DPO and KTO compare the policy with a frozen reference: the model the stage starts from.
Its log-probs do not change, so they are computed once, before the first step, for every
row the stage will ever score (train, held-out, and KTO's mismatched pairs), and stored
with the stage at `{stage_uri}/reference/logps.pt` under their own manifest. Training then
needs no second model in memory and no reference forward per step, and a resumed run loads
them instead of recomputing (it could not: its weights are no longer the reference's).
"""

from __future__ import annotations

from typing import Callable

import torch

from alignflow.infra import manifest, storage
from alignflow.stages.common.data import Sample, collate
from alignflow.stages.common.logprobs import forward_logprobs, sequence_logprobs
from alignflow.stages.common.rowwise import Forward, all_rows
from alignflow.stages.common.strategy import Strategy

REFERENCE_MANIFEST = "REFERENCE_MANIFEST.json"
FILE = "logps.pt"


def sequence_logps(model: torch.nn.Module, samples: list[Sample], pad_id: int, device) -> torch.Tensor:
    """(B,) summed response-token log-probs of `samples` under `model`."""
    batch = collate(samples, pad_id, packed=False).to(device)
    return sequence_logprobs(forward_logprobs(model, batch), batch.loss_mask)


RowSet = tuple[list[int], Forward]  # (lengths of the rows, forward over row indices)


def reference_logps(strategy: Strategy, stage_uri: str, staging, sets: dict[str, RowSet], micro: int,
                    log: Callable[[str], None] = print) -> dict[str, dict[str, torch.Tensor]]:
    """{set name: {value name: (n,) tensor}}: loaded from the stage folder when a verified copy is
    there, else computed with the model as it is now (call this before loading a checkpoint)."""
    uri = storage.join(stage_uri, "reference")
    expected = {name: len(lengths) for name, (lengths, _) in sets.items()}
    cached = _load(strategy, uri, staging, expected)
    if cached is not None:
        log(f"reference log-probs: loaded from {uri}")
        return cached
    values = {name: all_rows(strategy, lengths, micro, forward) for name, (lengths, forward) in sets.items()}
    if strategy.is_main:
        local = staging / "reference"
        local.mkdir(parents=True, exist_ok=True)
        torch.save(values, local / FILE)
        storage.remove(storage.join(uri, REFERENCE_MANIFEST))
        storage.copy_file(str(local / FILE), storage.join(uri, FILE))
        manifest.write_manifest(uri, name=REFERENCE_MANIFEST, rows=expected)
        log(f"reference log-probs: computed for {sum(expected.values())} rows, stored at {uri}")
    strategy.barrier()
    return values


def _load(strategy: Strategy, uri: str, staging, expected: dict[str, int]) -> dict[str, dict[str, torch.Tensor]] | None:
    ok = None
    if strategy.is_main:
        found = manifest.verify(uri, REFERENCE_MANIFEST)
        ok = found is not None and found.meta.get("rows") == expected
        if ok:
            storage.copy_file(storage.join(uri, FILE), str(staging / "reference" / FILE))
    if not strategy.broadcast_object(ok):
        return None
    return torch.load(staging / "reference" / FILE, weights_only=True)
