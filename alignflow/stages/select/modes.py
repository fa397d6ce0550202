"""Selection modes: scored completions, grouped by prompt, to training rows. Pure functions over plain rows.

Each group is one prompt's completions in sample order, as dicts with `prompt`, `completion`, `score` and the prompt
row's other columns. Ties go to the earlier sample, so a selection is a function of the rows alone.
- best_of_n: rejection sampling (Touvron et al. 2023, Llama 2, Sec. 3.2.3): the best completion of each prompt,
  kept when its score reaches `threshold`;
- best_vs_worst: the best and the worst completion as one preference pair (the iterative DPO of Xiong et al. 2024 and
  Dong et al. 2024, "RLHF Workflow"), when their scores differ by more than `min_margin`;
- all_pairs: every two completions of a prompt whose scores differ by more than `min_margin`, higher one chosen;
- kto: unpaired labels (Ethayarajh et al. 2024): desirable when score >= `threshold`; without one, the `top` best
  desirable and the `top` worst undesirable, when every one of the first scores above every one of the second.
"""

from __future__ import annotations

from typing import Any

from alignflow.rounding import at_most
from alignflow.stages.common.datasets import GENERATED_COLUMNS, SCORE_COLUMNS

Row = dict[str, Any]
# Of a labelled row's own columns, training rows keep the prompt's place only (training re-tokenizes the text).
KEPT = ("prompt_index",)


def extra(row: Row) -> Row:
    """The prompt row's other columns (e.g. `answer`), and its index."""
    return {k: v for k, v in row.items() if k in KEPT or (k not in GENERATED_COLUMNS and k not in SCORE_COLUMNS)}


def ranked(group: list[Row]) -> list[Row]:
    """Best first; among equal scores the earlier sample first."""
    return [r for _, r in sorted(enumerate(group), key=lambda item: (-item[1]["score"], item[0]))]


def best_of_n(group: list[Row], threshold: float | None = None) -> list[Row]:
    best = ranked(group)[0]
    if threshold is not None and best["score"] < threshold:
        return []
    return [{"prompt": best["prompt"], "response": best["completion"], "score": best["score"], **extra(best)}]


def pair(chosen: Row, rejected: Row) -> Row:
    return {"prompt": chosen["prompt"], "chosen": chosen["completion"], "rejected": rejected["completion"],
            "margin": chosen["score"] - rejected["score"], "score_chosen": chosen["score"], "score_rejected": rejected["score"],
            **extra(chosen)}


def within_margin(gap: float, min_margin: float) -> bool:
    """The gap does not exceed the margin, up to rounding (`alignflow.rounding`): 0.8 - 0.6 and 0.7 - 0.5 both equal
    0.2. The slack scales with the margin, so the default margin 0 still keeps any difference at all."""
    return at_most(gap, min_margin, min_margin)


def best_vs_worst(group: list[Row], min_margin: float = 0.0, dedupe: bool = True) -> list[Row]:
    best, worst = ranked(group)[0], min(group, key=lambda r: r["score"])  # min: the earliest of equal worst
    if within_margin(best["score"] - worst["score"], min_margin) or (dedupe and best["completion"] == worst["completion"]):
        return []
    return [pair(best, worst)]


def all_pairs(group: list[Row], min_margin: float = 0.0, dedupe: bool = True) -> list[Row]:
    out = []
    for i in range(len(group)):
        for j in range(i + 1, len(group)):
            a, b = group[i], group[j]
            if within_margin(abs(a["score"] - b["score"]), min_margin) or (dedupe and a["completion"] == b["completion"]):
                continue
            out.append(pair(a, b) if a["score"] > b["score"] else pair(b, a))
    return out


def kto(group: list[Row], threshold: float | None = None, top: int = 1) -> list[Row]:
    def row(r: Row, label: bool) -> Row:
        return {"prompt": r["prompt"], "completion": r["completion"], "label": label, "score": r["score"], **extra(r)}

    if threshold is not None:
        return [row(r, r["score"] >= threshold) for r in group]
    order = ranked(group)
    if len(order) < 2 * top or order[top - 1]["score"] <= order[-top]["score"]:
        return []
    good, bad = order[:top], order[-top:]
    return [row(r, True) for r in good] + [row(r, False) for r in bad]


def select(rows: list[Row], mode: str, threshold: float | None = None, min_margin: float = 0.0, top: int = 1,
           dedupe: bool = True) -> tuple[list[Row], int]:
    """Training rows from labelled rows (grouped by `prompt_index`, in order of first appearance), and how many
    prompts gave none. Empty completions (a sample that ended at once) are left out: no training row is empty."""
    groups: dict[Any, list[Row]] = {}
    for r in rows:
        if r["completion"].strip():
            groups.setdefault(r["prompt_index"], []).append(r)
    out, empty = [], 0
    for group in groups.values():
        if mode == "best_of_n":
            chosen = best_of_n(group, threshold)
        elif mode == "best_vs_worst":
            chosen = best_vs_worst(group, min_margin, dedupe)
        elif mode == "all_pairs":
            chosen = all_pairs(group, min_margin, dedupe)
        else:
            chosen = kto(group, threshold, top)
        out += chosen
        empty += not chosen
    return out, empty
