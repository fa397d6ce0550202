"""KTO rows (prompt, completion, boolean label) as token ids.

A row keeps its prompt and completion tokens apart, because the KL reference point needs
mismatched samples: a row's prompt followed by another row's completion.
"""

from __future__ import annotations

from dataclasses import dataclass

from alignflow.stages.kto.config import KTODataConfig
from alignflow.stages.common.data import DataError, Sample, chat_prompt_text, encode, load_rows, require_str, response_sample


@dataclass
class KTORow:
    prompt_ids: list[int]
    completion_ids: list[int]
    desirable: bool
    max_len: int

    def sample(self) -> Sample:
        return response_sample(self.prompt_ids, self.completion_ids, self.max_len, "row")

    def mismatched(self, other: "KTORow") -> Sample:
        """This row's prompt with `other`'s completion."""
        return response_sample(self.prompt_ids, other.completion_ids, self.max_len, "mismatched pair")

    def __len__(self) -> int:
        return min(len(self.prompt_ids) + len(self.completion_ids), self.max_len)


def kto_row(row: dict, where: str, tokenizer, cfg: KTODataConfig) -> KTORow:
    prompt = require_str(row, cfg.prompt_key, where)
    completion = require_str(row, cfg.completion_key, where)
    if cfg.label_key not in row:
        raise DataError(f"{where}: missing key {cfg.label_key!r} (row has: {', '.join(sorted(row))})")
    label = row[cfg.label_key]
    if not isinstance(label, bool):
        raise DataError(f"{where}: {cfg.label_key!r} must be a boolean (true = desirable), got {type(label).__name__} {label!r}")
    prompt_ids = encode(tokenizer, chat_prompt_text(tokenizer, prompt))
    response_sample(prompt_ids, [], cfg.max_len, where)  # the prompt must leave room for a completion
    return KTORow(prompt_ids, encode(tokenizer, completion + tokenizer.eos_token), label, cfg.max_len)


def load_kto_rows(cfg: KTODataConfig, tokenizer, seed: int) -> tuple[list[KTORow], list[KTORow], dict]:
    return load_rows(cfg, lambda where, row: kto_row(row, where, tokenizer, cfg), seed)
