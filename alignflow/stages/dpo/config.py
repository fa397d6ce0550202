"""The dpo stage's config (torch-free)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from alignflow.config.base import PreferenceDataConfig, ReferenceTraining


class DPOConfig(ReferenceTraining):
    """DPO / cDPO / IPO against a frozen reference (the starting model)."""

    kind: Literal["dpo"] = "dpo"
    data: PreferenceDataConfig
    loss: Literal["dpo", "ipo"] = "dpo"
    beta: float = Field(0.1, gt=0, description="Strength of the implicit KL constraint.")
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description="cDPO: assumed probability that a label is flipped (dpo only).")
    nll_weight: float = Field(0.0, ge=0.0, description="Weight of a token-mean NLL term on the chosen response (0 = off).")

    @model_validator(mode="after")
    def _smoothing_needs_dpo(self) -> "DPOConfig":
        if self.label_smoothing and self.loss != "dpo":
            raise ValueError(f"label_smoothing={self.label_smoothing} is cDPO: it needs loss: dpo, not {self.loss!r}")
        return self

