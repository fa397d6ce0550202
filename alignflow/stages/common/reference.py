"""Log-probs of token samples, and the frozen reference's log-probs: computed once per stage, or on the fly (LoRA).

DPO and KTO compare the policy with a frozen reference: the model the stage starts from.
Its log-probs do not change, so they are computed once, before the first step, for every
row the stage will ever score (train, held-out, and KTO's mismatched pairs), and stored
with the stage at `{stage_uri}/reference/logps.pt` under their own manifest. Training then
needs no second model in memory and no reference forward per step, and a resumed run loads
them instead of recomputing (it could not: its weights are no longer the reference's).

With LoRA the reference is the policy with its adapter switched off, so it can also be computed
on the fly, in each step (`reference: on_the_fly`): no up-front pass and no stored file, one
no-gradient forward per step instead. Both modes run the reference with the adapter off.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator

import torch

from alignflow.infra import manifest, storage
from alignflow.stages.common.data import Sample, collate
from alignflow.stages.common.logprobs import forward_logprobs, sequence_logprobs
from alignflow.stages.common.models import is_lora
from alignflow.stages.common.rowwise import Forward, RowBuffer, all_rows
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
    with adapter_off(strategy):
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


@contextmanager
def adapter_off(strategy: Strategy) -> Iterator[None]:
    """The policy as the reference: a LoRA model with its adapter disabled; any other model as it is."""
    model = strategy.unwrap()
    with model.disable_adapter() if is_lora(model) else nullcontext():
        yield


class Reference:
    """The reference's values of each row set (`sets`: name -> (row lengths, forward over row indices)).
    `precomputed`: the stored table (computed on the first attempt, before any step). `on_the_fly`: computed
    when asked, with the adapter off; a whole set (held-out rows) is computed once and kept."""

    def __init__(self, strategy: Strategy, mode: str, sets: dict[str, RowSet], micro: int, stage_uri: str, staging,
                 log: Callable[[str], None] = print):
        self.strategy, self.sets, self.micro = strategy, sets, micro
        self.table = reference_logps(strategy, stage_uri, staging, sets, micro, log) if mode == "precomputed" else {}
        self.on_the_fly = mode == "on_the_fly"

    def rows(self, name: str, rows: list[int], mine: list[list[int]]) -> dict[str, torch.Tensor]:
        """Values at `rows` of set `name`, in that order; `mine`: this rank's micro-batches, as positions into `rows`
        (every rank gets every row's value)."""
        if not self.on_the_fly:
            return {k: v[rows] for k, v in self.table[name].items()}
        _, forward = self.sets[name]
        buffer = RowBuffer(len(rows))
        self.strategy.engine.eval()
        with torch.no_grad(), adapter_off(self.strategy):
            for micro in mine:
                buffer.put(micro, forward([rows[k] for k in micro]))
        self.strategy.engine.train()
        return buffer.gather(self.strategy)

    def all(self, name: str) -> dict[str, torch.Tensor]:
        """Values of every row of set `name`."""
        if name not in self.table:
            lengths, forward = self.sets[name]
            with adapter_off(self.strategy):
                self.table[name] = all_rows(self.strategy, lengths, self.micro, forward)
        return self.table[name]
