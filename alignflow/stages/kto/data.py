"""KTO rows (prompt, completion, boolean label) as token ids.

A row keeps its prompt and completion tokens apart, because the KL reference point needs
mismatched samples: a row's prompt followed by another row's completion.
"""

from __future__ import annotations

from dataclasses import dataclass

from alignflow.stages.kto.config import KTODataConfig
from alignflow.stages.common.data import (DataError, Sample, column, encode, load_rows, prompt_and_response, prompt_value,
                                          response_sample, text_or_messages, whole_conversation)


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


def kto_row(row: dict, where: str, tokenizer, cfg: KTODataConfig, section: str = "data") -> KTORow:
    own_prompt = isinstance(row, dict) and whole_conversation(row.get(cfg.completion_key))  # a completion with its prompt turns
    prompt = prompt_value(row, where, cfg, cfg.prompt_key, f"{section}.prompt_key", required=not own_prompt)
    completion = text_or_messages(column(row, cfg.completion_key, where, f"{section}.completion_key"), cfg.format, where, cfg.completion_key, "assistant")
    label = column(row, cfg.label_key, where, f"{section}.label_key")
    if not isinstance(label, bool):
        raise DataError(f"{where}: {cfg.label_key!r} must be a boolean (true = desirable), got {type(label).__name__} {label!r}")
    prompt_text, completion_text = prompt_and_response(tokenizer, prompt, completion, where, cfg.format, (cfg.prompt_key, cfg.completion_key))
    prompt_ids = encode(tokenizer, prompt_text)
    response_sample(prompt_ids, [], cfg.max_len, where, section)  # the prompt must leave room for a completion
    return KTORow(prompt_ids, encode(tokenizer, completion_text), label, cfg.max_len)


def load_kto_rows(cfg: KTODataConfig, tokenizer, seed: int, section: str = "data") -> tuple[list[KTORow], list[KTORow], dict]:
    return load_rows(cfg, lambda where, row: kto_row(row, where, tokenizer, cfg, section), seed, section)
