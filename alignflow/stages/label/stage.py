"""Label stage: scores for every row of a generate stage's dataset, published as a dataset with score columns.

Run by hand:  python -m alignflow.stages --config configs/tiny-rejection-sampling.yaml --stage label

Adds `reward` (the reward function's, the rl contract: `fn(prompts, completions, prompt_ids, completion_ids, **columns)`
with the prompt row's other columns), `rm_score` (the reward model's, on the exact generated token ids) and `score`,
their weighted sum. A row whose function raises or whose score is not finite stops the stage with an error naming the
row (its position in the dataset, its prompt and completion), or with `on_bad_row: skip` is left out and counted.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

from alignflow.config import PipelineConfig
from alignflow.stages.common.data import DataError
from alignflow.stages.common.datasets import GENERATED_COLUMNS, SCORE_COLUMNS, publish_rows, published_rows
from alignflow.stages.common.models import fetch_published_model
from alignflow.stages.common.run import TrainingRun
from alignflow.stages.common.tracking import StageTracking
from alignflow.stages.label.config import LabelConfig
from alignflow.stages.rl.data import reward_prompt
from alignflow.stages.rl.rewards import FunctionReward, RewardError



def main(cfg: PipelineConfig, stage: str, output_uri: str | None = None, inputs: dict[str, str] | None = None,
         expected_key: str | None = None) -> dict[str, Any]:
    # ------------------------------------------------------------------ setup
    run = TrainingRun(cfg, stage, output_uri, inputs, expected_key)
    if run.done:
        return run.cached_result()
    section: LabelConfig = run.section
    source = run.inputs["data"]
    rows = published_rows(source)
    function = FunctionReward(section.reward) if section.reward else None
    judge = None
    if section.reward_model:
        from alignflow.stages.rm.scoring import RewardScorer

        judge = RewardScorer(fetch_published_model(run.inputs["reward_model"], run.input_digests["reward_model"]),
                             normalize=section.normalize, batch_size=section.batch_size)

    # ------------------------------------------------------------------ label
    where = lambda i: f"{source}/data row {i + 1} (prompt {rows[i]['prompt']!r}, completion {rows[i]['completion']!r})"  # noqa: E731
    scores = {}
    if function is not None:
        scores["reward"] = checked(lambda idx: function_scores(function, [rows[i] for i in idx]), len(rows), section.batch_size, where, "reward function")
    if judge is not None:
        scores["rm_score"] = checked(lambda idx: judge.score_ids([rows[i]["prompt_ids"] + rows[i]["completion_ids"] for i in idx]).tolist(),
                                     len(rows), section.batch_size, where, "reward model")
    labelled, bad = combine(section, rows, scores)
    limit_skips(section, stage, source, len(rows), bad, where)

    # ------------------------------------------------------------------ publish
    tracking = StageTracking(True)
    values = [r["score"] for r in labelled]
    metrics = {"label/rows": float(len(labelled)), "label/skipped": float(len(bad)),
               "label/score_mean": sum(values) / max(1, len(values))}
    if function is not None:
        metrics["label/reward_mean"] = sum(r["reward"] for r in labelled) / max(1, len(labelled))
    return publish_rows(run, tracking, [labelled], metrics)


def function_scores(function: FunctionReward, rows: list[dict[str, Any]]) -> list[float]:
    """The reward function over rows of a generated dataset (its prompt text: a conversation's last user turn)."""
    columns = sorted({k for r in rows for k in r if k not in GENERATED_COLUMNS and k not in SCORE_COLUMNS})
    return function([reward_prompt(r["prompt"]) for r in rows], [r["completion"] for r in rows], [r["prompt_ids"] for r in rows], [r["completion_ids"] for r in rows],
                    {k: [r.get(k) for r in rows] for k in columns}).tolist()


def checked(score: Callable[[list[int]], list[float]], n: int, batch: int, where: Callable[[int], str], what: str) -> list[float | str]:
    """Scores of rows 0..n-1 by batch; a batch that fails is scored row by row, and a failing row's entry is the reason."""
    out: list[float | str] = []
    for start in range(0, n, batch):
        idx = list(range(start, min(n, start + batch)))
        try:
            values = score(idx)
            out += [v if math.isfinite(v) else f"{what} gave {v!r}" for v in values]
        except RewardError:
            for i in idx:
                try:
                    v = score([i])[0]
                    out.append(v if math.isfinite(v) else f"{what} gave {v!r}")
                except RewardError as exc:  # its message names sample 0 of a one-row call: the caller names the row
                    out.append(re.sub(r" (on|for) sample 0 \(prompt .*?, completion .*?\)", "", str(exc), count=1, flags=re.S))
    return out


def combine(section: LabelConfig, rows: list[dict[str, Any]], scores: dict[str, list]) -> tuple[list[dict], list[tuple[int, str]]]:
    """Rows with their score columns, and the (row, reason) of each bad one (an error unless `on_bad_row: skip`)."""
    labelled, bad = [], []
    weights = {"reward": section.reward_weight, "rm_score": section.reward_model_weight}
    for i, row in enumerate(rows):
        reasons = [v for v in (s[i] for s in scores.values()) if isinstance(v, str)]
        if reasons:
            bad.append((i, reasons[0]))
            continue
        own = {name: float(s[i]) for name, s in scores.items()}
        labelled.append({**row, "reward": own.get("reward"), "rm_score": own.get("rm_score"),
                         "score": sum(weights[name] * v for name, v in own.items())})
    return labelled, bad


def limit_skips(section: LabelConfig, stage: str, source: str, total: int, bad: list[tuple[int, str]],
                where: Callable[[int], str]) -> None:
    if not bad:
        return
    first, reason = bad[0]
    if section.on_bad_row == "error":
        raise DataError(f"{where(first)}: {reason} ({len(bad)} bad row(s) of {total}; set {stage}.on_bad_row: skip to leave "
                        "them out)")
    print(f"{stage}: skipped {len(bad)} of {total} rows (first: {where(first)}: {reason})", flush=True)
    if len(bad) / total > section.max_skip_fraction:
        raise DataError(f"{source}: {len(bad)} of {total} rows could not be scored ({len(bad) / total:.1%}), more than "
                        f"{stage}.max_skip_fraction={section.max_skip_fraction}; first: {where(first)}: {reason}")
