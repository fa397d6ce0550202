"""Per-row values over a dataset or an optimizer step, split across ranks and summed back.

Losses in alignflow are means over the rows of a whole optimizer step. A step's rows are
split into micro-batches (and ranks); each micro-batch contributes its rows' share of the
step loss, and the per-row values it computed are written into a step-sized buffer. After
the step the buffers are summed over ranks, so every rank holds the step's full per-row
values and can compute the step's metrics with the same pure loss function the gradient
came from: one formula, no re-weighting of micro-batch means.
"""

from __future__ import annotations

from typing import Callable, Sequence, Sized

import torch

from alignflow.config.base import BatchConfig
from alignflow.stages.common.data import global_batch, rank_micro_batches
from alignflow.stages.common.strategy import Strategy

Forward = Callable[[list[int]], dict[str, torch.Tensor]]  # row indices -> {name: (len,) tensor}


class RowBuffer:
    """(n,) buffers (or (n, width) for per-token values), one per name, filled at given rows on
    each rank, then summed over ranks. Narrower per-token values are zero-padded to `width`."""

    def __init__(self, n: int, width: int | None = None):
        self.n, self.width = n, width
        self.values: dict[str, torch.Tensor] = {}

    def put(self, rows: list[int], values: dict[str, torch.Tensor]) -> None:
        """No rows: only make the buffers, so this rank still joins the sum of every name."""
        for name, v in values.items():
            shape = (self.n,) if self.width is None else (self.n, self.width)
            buf = self.values.setdefault(name, torch.zeros(shape, dtype=torch.float32))
            if not rows:
                continue
            v = v.detach().float().cpu()
            if self.width is None:
                buf[torch.tensor(rows)] = v
            else:
                buf[torch.tensor(rows), : v.shape[1]] = v

    def gather(self, strategy: Strategy) -> dict[str, torch.Tensor]:
        return {name: strategy.all_reduce_tensor(buf.to(strategy.device)).cpu() for name, buf in sorted(self.values.items())}


@torch.no_grad()
def all_rows(strategy: Strategy, lengths: list[int], micro: int, forward: Forward, width: int | None = None) -> dict[str, torch.Tensor]:
    """`forward` over every row (no gradient, eval mode), split across ranks; every rank gets the
    full (n,) results. Rows are length-sorted so micro-batches pad little. Every rank runs the
    same number of forwards (ZeRO-3 gathers parameters collectively): a rank out of rows repeats
    its first chunk and drops the result (a rank with fewer chunks than ranks still gets every name)."""
    if not lengths:
        return {}
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    chunks = [order[k:k + micro] for k in range(0, len(order), micro)]
    rounds = -(-len(chunks) // strategy.world_size)
    buffer = RowBuffer(len(lengths), width)
    strategy.engine.eval()
    for r in range(rounds):
        j = r * strategy.world_size + strategy.rank
        values = forward(chunks[j] if j < len(chunks) else chunks[0])
        buffer.put(chunks[j] if j < len(chunks) else [], values)
    strategy.engine.train()
    return buffer.gather(strategy)


def step_rows(strategy: Strategy, items: Sequence[Sized], batch: BatchConfig, step: int) -> tuple[list[int], list[list[int]]]:
    """(dataset indices of step `step` into `items`, this rank's micro-batches as positions into that list).
    Only the step's items are measured: every step measured all 2,000 pairs before (0.1 ms of a 36 ms RM step)."""
    indices = global_batch(len(items), batch.global_batch_size, step, batch.seed)
    positions = rank_micro_batches(list(range(len(indices))), [len(items[i]) for i in indices],
                                   batch.micro_batch_size, strategy.world_size, strategy.rank)
    return indices, positions
