"""One rule for comparing values that arrive rounded, used by the registry gate and by `select`'s margin.

Rates of whole episodes and score differences are float32 or float64 sums: 0.40 + 0.07 > 0.47 in float64, and
0.8 - 0.6 exceeds 0.2 while 0.7 - 0.5 falls short of it. Compared plainly, a value equal to its bar is decided by
rounding alone; within a millionth of the bar's scale it counts as equal.
"""

from __future__ import annotations

RELATIVE_SLACK = 1e-6


def at_most(value: float, bound: float, scale: float) -> bool:
    """`value` <= `bound`, up to rounding: at most RELATIVE_SLACK x `scale` above it counts as equal."""
    return value <= bound + RELATIVE_SLACK * scale
