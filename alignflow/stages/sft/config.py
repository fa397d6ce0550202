"""The sft stage's config (torch-free)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from alignflow.config.base import DataSource, TrainingSection


class DataConfig(DataSource):
    """SFT rows: prompt/response columns, or a chat `messages` column."""

    input_key: str = Field("prompt", description="Prompt column (input/output format).")
    output_key: str = Field("response", description="Response column (input/output format).")
    messages_key: str | None = Field(None, description="Column with a chat `messages` list; overrides input/output keys. "
                                                       "Unset, a `messages` column is used in rows that lack the input column.")
    packing: bool = Field(False, description="Pack samples into rows of max_len; attention is block-diagonal per sample.")

    def used_columns(self) -> set[str] | None:
        return super().used_columns() | {"messages"}  # a `messages` column is read when a row has no input column



class SFTConfig(TrainingSection):
    kind: Literal["sft"] = "sft"
    data: DataConfig
