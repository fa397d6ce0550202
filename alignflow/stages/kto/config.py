"""The kto stage's config (torch-free)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from alignflow.config.base import DataSource, ReferenceTraining


class KTODataConfig(DataSource):
    """Unpaired rows for kto: a prompt, a completion and a boolean label (true = desirable)."""

    prompt_key: str = "prompt"
    completion_key: str = "completion"
    label_key: str = "label"



class KTOConfig(ReferenceTraining):
    """KTO on unpaired desirable / undesirable completions."""

    kind: Literal["kto"] = "kto"
    data: KTODataConfig
    beta: float = Field(0.1, gt=0)
    desirable_weight: float = Field(1.0, gt=0, description="λ_D; the paper advises λ_D·n_D / (λ_U·n_U) in [1, 4/3].")
    undesirable_weight: float = Field(1.0, gt=0, description="λ_U")

    @model_validator(mode="after")
    def _batch_has_a_mismatch(self) -> "KTOConfig":
        if self.batch.global_batch_size < 2:
            raise ValueError("batch.global_batch_size must be >= 2: the KL reference point pairs each prompt with another row's completion")
        return self

