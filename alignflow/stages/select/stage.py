"""Select stage: a label stage's scored completions to training rows (SFT, preference pairs or KTO labels).

Run by hand:  python -m alignflow.stages --config configs/tiny-iterative-dpo.yaml --stage online.1.select

The modes are `select/modes.py`; the output is a dataset that an sft, rm, dpo or kto stage reads as
`data: {stage: <this stage>}` with its default column names (`prompt`/`response`, `prompt`/`chosen`/`rejected`
with `margin`, `prompt`/`completion`/`label`).
"""

from __future__ import annotations

from typing import Any

from alignflow.config import PipelineConfig
from alignflow.stages.common.data import DataError
from alignflow.stages.common.datasets import publish_rows, published_rows
from alignflow.stages.common.run import TrainingRun
from alignflow.stages.common.tracking import StageTracking
from alignflow.stages.select.config import SelectConfig
from alignflow.stages.select.modes import select


def main(cfg: PipelineConfig, stage: str, output_uri: str | None = None, inputs: dict[str, str] | None = None,
         expected_key: str | None = None) -> dict[str, Any]:
    run = TrainingRun(cfg, stage, output_uri, inputs, expected_key)
    if run.done:
        return run.cached_result()
    section: SelectConfig = run.section
    rows = published_rows(run.inputs["data"])
    selected, empty = select(rows, section.mode, section.threshold, section.min_margin, section.top, section.dedupe)
    prompts = len({r["prompt_index"] for r in rows})
    empty += prompts - len({r["prompt_index"] for r in rows if r["completion"].strip()})
    print(f"{stage}: {section.mode}: {len(selected)} rows from {len(rows)} scored completions of {prompts} prompts "
          f"({empty} prompts gave none)", flush=True)
    if not selected:
        raise DataError(f"{stage}: {section.mode} selected nothing from the {len(rows)} rows of {run.inputs['data']} (every "
                        "prompt's completions scored alike, or below the threshold): no training data")
    metrics = {"select/rows": float(len(selected)), "select/prompts": float(prompts), "select/prompts_without_rows": float(empty),
               "select/score_mean": sum(r["score"] for r in rows) / len(rows)}
    if section.mode in ("best_vs_worst", "all_pairs"):
        metrics["select/margin_mean"] = sum(r["margin"] for r in selected) / len(selected)
    return publish_rows(run, StageTracking(True), [selected], metrics)
