"""The select stage's config (torch-free): training rows picked from a labelled dataset by score."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from alignflow.config.base import NOT_RESULT, Frozen, result_fields, stable_hash


class SelectConfig(Frozen):
    """Turns a `label` stage's scored completions (grouped by prompt) into rows a training stage reads as `data`:
    - `best_of_n`: each prompt's best completion as an SFT row (`prompt`, `response`), if its score >= `threshold`
      when set (rejection sampling);
    - `best_vs_worst`: each prompt's best and worst completions as a preference pair (`prompt`, `chosen`, `rejected`,
      `margin`), when the scores differ by more than `min_margin`;
    - `all_pairs`: every two completions of a prompt whose scores differ by more than `min_margin`;
    - `kto`: `prompt`, `completion`, `label`: desirable when score >= `threshold`, else undesirable; without a
      threshold, the `top` best of each prompt desirable and the `top` worst undesirable (when they score differently).
    Ties go to the earlier sample. Prompts with nothing selected are counted, not errors."""

    kind: Literal["select"] = "select"
    data: str = Field(..., description="The label stage whose rows are selected.", json_schema_extra=NOT_RESULT)
    mode: Literal["best_of_n", "best_vs_worst", "all_pairs", "kto"]
    threshold: float | None = Field(None, description="best_of_n: the least score kept; kto: the score from which a completion is desirable.")
    min_margin: float = Field(0.0, ge=0, description="Pairs: the score gap a pair must exceed.")
    top: int = Field(1, ge=1, description="kto without a threshold: completions per prompt labelled desirable (and undesirable).")
    dedupe: bool = Field(True, description="Pairs: leave out a pair whose two completions are the same text.")

    @model_validator(mode="after")
    def _options_fit(self) -> "SelectConfig":
        if self.threshold is not None and self.mode in ("best_vs_worst", "all_pairs"):
            raise ValueError(f"threshold is a best_of_n / kto option; {self.mode} keeps pairs by min_margin")
        if self.min_margin and self.mode not in ("best_vs_worst", "all_pairs"):
            raise ValueError(f"min_margin is a pair option; mode {self.mode} does not make pairs")
        return self

    def edges(self) -> dict[str, str]:
        return {"data": self.data}

    def config_hash(self) -> str:
        return stable_hash(result_fields(self))

    def sources(self) -> dict[str, str]:
        return {}
