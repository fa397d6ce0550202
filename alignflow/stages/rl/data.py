"""Prompt rows for the RL stage: the prompt as token ids (rendered with the chat template)
and the row's other columns, which reach the reward function (e.g. the ground-truth answer)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from alignflow.config.base import PromptDataConfig
from alignflow.stages.common.data import DataError, chat_prompt_text, encode, load_rows, require_str


@dataclass
class PromptRow:
    text: str
    ids: list[int]
    columns: dict[str, Any] = field(default_factory=dict)


def prompt_row(row: dict, where: str, tokenizer, cfg: PromptDataConfig) -> PromptRow:
    text = require_str(row, cfg.prompt_key, where)
    ids = encode(tokenizer, chat_prompt_text(tokenizer, text))
    if len(ids) >= cfg.max_len:
        raise DataError(f"{where}: prompt is {len(ids)} tokens, not shorter than data.max_len={cfg.max_len}")
    return PromptRow(text, ids, {k: v for k, v in row.items() if k != cfg.prompt_key})


def load_prompts(cfg: PromptDataConfig, tokenizer, seed: int) -> tuple[list[PromptRow], list[PromptRow], dict]:
    return load_rows(cfg, lambda where, row: prompt_row(row, where, tokenizer, cfg), seed)


def columns_of(rows: list[PromptRow]) -> dict[str, list[Any]]:
    """The rows' other columns as lists, one value per row (None where a row lacks the column)."""
    names = sorted({k for r in rows for k in r.columns})
    return {k: [r.columns.get(k) for r in rows] for k in names}
