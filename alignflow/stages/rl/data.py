"""Prompt rows for the RL stage: the prompt as token ids (rendered with the chat template)
and the row's other columns, which reach the reward function (e.g. the ground-truth answer)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from alignflow.config.base import PromptDataConfig
from alignflow.stages.common.data import DataError, encode, load_rows, prompt_text, prompt_too_long, prompt_value


@dataclass
class PromptRow:
    text: str
    ids: list[int]
    columns: dict[str, Any] = field(default_factory=dict)


def prompt_row(row: dict, where: str, tokenizer, cfg: PromptDataConfig, section: str = "data") -> PromptRow:
    """A prompt row; a conversational prompt reaches the reward function as its last user message."""
    prompt = prompt_value(row, where, cfg, cfg.prompt_key, f"{section}.prompt_key")
    if not isinstance(prompt, str) and prompt[-1]["role"] == "assistant":
        raise DataError(f"{where}: {cfg.prompt_key!r} ends with an assistant turn: a prompt ends with the turn to answer")
    ids = encode(tokenizer, prompt_text(tokenizer, prompt, where))
    if len(ids) >= cfg.max_len:
        raise prompt_too_long(where, len(ids), cfg.max_len, section)
    return PromptRow(reward_prompt(prompt), ids, {k: v for k, v in row.items() if k != cfg.prompt_key})


def reward_prompt(prompt: str | list[dict]) -> str:
    """The prompt as a reward function gets it: the text, or a conversation's last user message."""
    if isinstance(prompt, str):
        return prompt
    return next((m["content"] for m in reversed(prompt) if m["role"] == "user"), prompt[-1]["content"])


def load_prompts(cfg: PromptDataConfig, tokenizer, seed: int, section: str = "data") -> tuple[list[PromptRow], list[PromptRow], dict]:
    return load_rows(cfg, lambda where, row: prompt_row(row, where, tokenizer, cfg, section), seed, section)


def columns_of(rows: list[PromptRow]) -> dict[str, list[Any]]:
    """The rows' other columns as lists, one value per row (None where a row lacks the column)."""
    names = sorted({k for r in rows for k in r.columns})
    return {k: [r.columns.get(k) for r in rows] for k in names}
