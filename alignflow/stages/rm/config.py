"""The rm stage's config (torch-free)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from alignflow.config.base import PreferenceDataConfig, TrainingSection


class RMConfig(TrainingSection):
    """Reward model: a causal LM backbone with a scalar head, trained on preference pairs."""

    kind: Literal["rm"] = "rm"
    data: PreferenceDataConfig
    loss: Literal["sigmoid", "logexp"] = Field("sigmoid", description="-log σ(r_c - r_r - margin) or log(1 + exp(r_r - r_c)).")

    @model_validator(mode="after")
    def _margin_needs_sigmoid(self) -> "RMConfig":
        if (self.data.margin_key or self.data.margin_from) and self.loss != "sigmoid":
            raise ValueError(f"a margin (data.margin_key or data.margin_from) needs loss: sigmoid, not {self.loss!r}")
        return self

