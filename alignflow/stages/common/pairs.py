"""Preference pairs (prompt, chosen, rejected) as token samples: shared by the rm and dpo stages.

A pair is two samples with the same prompt tokens. Chosen and rejected go through the model
in one forward: a micro-batch of B pairs is one (2B, T) batch, chosen rows first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from alignflow.config import PreferenceDataConfig
from alignflow.stages.common.data import DataError, Sample, TokenBatch, chat_prompt_text, collate, encode, load_rows, require_str, response_sample


@dataclass
class Pair:
    chosen: Sample
    rejected: Sample
    margin: float = 0.0

    def __len__(self) -> int:
        return max(len(self.chosen), len(self.rejected))


def pair_from_row(row: dict, where: str, tokenizer, cfg: PreferenceDataConfig) -> Pair:
    prompt = require_str(row, cfg.prompt_key, where)
    chosen = require_str(row, cfg.chosen_key, where)
    rejected = require_str(row, cfg.rejected_key, where)
    if chosen == rejected:
        raise DataError(f"{where}: {cfg.chosen_key!r} and {cfg.rejected_key!r} are the same response ({chosen!r}): nothing to prefer")
    prompt_ids = encode(tokenizer, chat_prompt_text(tokenizer, prompt))
    pair = Pair(response_sample(prompt_ids, encode(tokenizer, chosen + tokenizer.eos_token), cfg.max_len, where),
                response_sample(prompt_ids, encode(tokenizer, rejected + tokenizer.eos_token), cfg.max_len, where),
                _margin(row, where, cfg.margin_key) if cfg.margin_key else 0.0)
    if pair.chosen.input_ids == pair.rejected.input_ids:
        raise DataError(f"{where}: chosen and rejected are identical after truncation to data.max_len={cfg.max_len}")
    return pair


def _margin(row: dict, where: str, key: str) -> float:
    if key not in row:
        raise DataError(f"{where}: missing margin column {key!r}")
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(f"{where}: {key!r} must be a finite number, got {type(value).__name__} {value!r}")
    return float(value)


def load_pairs(cfg: PreferenceDataConfig, tokenizer, seed: int) -> tuple[list[Pair], list[Pair], dict]:
    return load_rows(cfg, lambda where, row: pair_from_row(row, where, tokenizer, cfg), seed)


def collate_pairs(pairs: list[Pair], pad_id: int) -> TokenBatch:
    """One (2B, T) batch: rows [0, B) are the chosen responses, rows [B, 2B) the rejected ones."""
    return collate([p.chosen for p in pairs] + [p.rejected for p in pairs], pad_id, packed=False)
