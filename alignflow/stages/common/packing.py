"""Padding-free rows: variable-length blocks (a prompt with its responses) packed into a few rows, each block
attending only within itself (the 4D masks of `stages/rl/experience.py` and `stages/common/pairs.py`)."""

from __future__ import annotations


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
