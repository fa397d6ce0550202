"""The label stage's config (torch-free): scores for every row of a generated dataset."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from alignflow.config.base import NOT_RESULT, Frozen, python_object_spec, result_fields, stable_hash


class LabelConfig(Frozen):
    """Scores each completion of a `generate` stage's dataset with a reward function (the rl stage's `path.py:fn`
    contract: it gets the prompt row's other columns too) and/or a reward-model stage (scored on the exact generated
    token ids). Writes `reward` (the function's), `rm_score` (the model's) and `score`, their weighted sum, which
    `select` reads. A row whose function raises, or whose score is not finite, stops the stage naming the row, or
    with `on_bad_row: skip` is left out and counted (the stage fails past `max_skip_fraction`)."""

    kind: Literal["label"] = "label"
    data: str = Field(..., description="The generate stage whose rows are scored.", json_schema_extra=NOT_RESULT)
    reward: str | None = Field(None, description="`path/to/file.py:name`: a reward function.", json_schema_extra=NOT_RESULT)
    reward_model: str | None = Field(None, description="An rm stage that scores the completions.", json_schema_extra=NOT_RESULT)
    normalize: bool = Field(False, description="Reward-model scores as (s - mean) / std with the rm stage's training statistics.")
    reward_weight: float = Field(1.0, description="Weight of the function's reward in `score`.")
    reward_model_weight: float = Field(1.0, description="Weight of the reward model's score in `score`.")
    on_bad_row: Literal["error", "skip"] = "error"
    max_skip_fraction: float = Field(0.05, ge=0, le=1, json_schema_extra=NOT_RESULT)
    batch_size: int = Field(64, ge=1, description="Rows per reward call and per reward-model forward.", json_schema_extra=NOT_RESULT)

    @field_validator("reward")
    @classmethod
    def _reward_file_exists(cls, v: str | None) -> str | None:
        return v if v is None else python_object_spec(v, "reward", "function_name")

    @model_validator(mode="after")
    def _a_scorer(self) -> "LabelConfig":
        if not (self.reward or self.reward_model):
            raise ValueError("a label stage scores with `reward: file.py:function`, `reward_model: <rm stage>`, or both")
        return self

    def edges(self) -> dict[str, str]:
        return {"data": self.data, **({"reward_model": self.reward_model} if self.reward_model else {})}

    def config_hash(self) -> str:
        return stable_hash(result_fields(self))

    def sources(self) -> dict[str, str]:
        if not self.reward:
            return {}
        path, _, name = self.reward.rpartition(":")
        return {f"reward:{name}": path}
