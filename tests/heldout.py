"""Held-out gains counted in whole episodes, for the tests of every tier that ask a stage to have learned."""

from __future__ import annotations

HELD_OUT_EPISODES = 200  # data/rl/eval.jsonl's prompts: the RL and eval stages' greedy held-out episodes, each right or not


def episodes_gained(after: float, before: float, episodes: int = HELD_OUT_EPISODES) -> int:
    """after - before in whole held-out episodes. The rates arrive rounded (float32, float64 sums: 0.40 + 0.07 > 0.47),
    so comparing them plainly with a rate bar decides a gain of exactly the bar by rounding."""
    for rate in (after, before):
        assert abs(rate * episodes - round(rate * episodes)) < 1e-3, f"{rate} is not a share of {episodes} episodes"
    return round((after - before) * episodes)
