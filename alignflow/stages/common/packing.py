"""Padding-free rows: variable-length blocks (a prompt with its responses) packed into a few rows, each block
attending only within itself. Shared by the RL micro-batches (`stages/rl/experience.py`) and the preference pairs
(`stages/common/pairs.py`).

A block's tokens carry a segment: 0 for its shared prefix (the prompt), k > 0 for its k-th continuation. A token
sees the earlier tokens of its own block's prefix and of its own continuation, so each continuation is computed as
if it followed the prefix alone."""

from __future__ import annotations

import numpy as np
import torch


def pack_blocks(lengths: list[int]) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Blocks into rows of 1.5x the longest block, first-fit by decreasing length (the padding-free layout: little
    padding, and the quadratic attention stays within short rows). Returns each row's blocks and each block's
    (row, offset). 1.5x: an RL micro-batch's forward + backward took 0.73 s against 0.79 / 0.76 / 0.80 s at 1x /
    2x / 3x on builtin:small, 0.045 s against 0.050 / 0.050 / 0.055 s on builtin:tiny."""
    width = max(lengths) * 3 // 2
    rows: list[list[int]] = []
    used: list[int] = []
    placed = [(0, 0)] * len(lengths)
    for b in sorted(range(len(lengths)), key=lambda b: (-lengths[b], b)):
        r = next((r for r in range(len(rows)) if used[r] + lengths[b] <= width), len(rows))
        if r == len(rows):
            rows.append([]), used.append(0)
        placed[b] = (r, used[r])
        rows[r].append(b)
        used[r] += lengths[b]
    return rows, placed


class Packing:
    """Where each block of the given lengths goes: `lay` turns per-block token lists into (R, T) tensors (built from
    Python lists, one tensor each: per-token tensor writes cost milliseconds a step on the tiny model), `starts` are
    the flat indices (into R x T) of each block's first token, `offsets` where it starts in its row."""

    def __init__(self, lengths: list[int]):
        self.rows, placed = pack_blocks(lengths)
        self.width = max(sum(lengths[b] for b in row) for row in self.rows)
        self.offsets = [at for _, at in placed]
        self.starts = torch.tensor([r * self.width + at for r, at in placed])

    def lay(self, per_block: list[list[int]], fill: int) -> torch.Tensor:
        flat: list[int] = []
        for row in self.rows:
            end = len(flat) + self.width
            for b in row:
                flat += per_block[b]
            flat += [fill] * (end - len(flat))
        # numpy reads a flat list of ints 4x faster than torch.tensor reads nested lists (13 vs 56 us a (16, 22) batch)
        return torch.from_numpy(np.array(flat, dtype=np.int64)).view(len(self.rows), self.width)

    def segments(self, per_block: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(R, T) segment of every token (see the module docstring) and (R, T) its block; -1 on padding."""
        return self.lay(per_block, -1), self.lay([[b] * len(s) for b, s in enumerate(per_block)], -1)

    def attention_mask(self, segment: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        """(R, 1, T, T) bool, True = may attend, from `segments`; padding sees the padding before it (its outputs are
        never read), so no softmax row is empty."""
        visible = (segment.unsqueeze(1) == 0) | (segment.unsqueeze(1) == segment.unsqueeze(2))
        causal = torch.ones(self.width, self.width, dtype=torch.bool).tril()
        return (causal & (block.unsqueeze(1) == block.unsqueeze(2)) & visible).unsqueeze(1)
