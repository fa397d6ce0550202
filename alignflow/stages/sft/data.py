"""SFT rows -> samples: input/output columns (text or messages, or a prompt from `input_template`),
or a chat `messages` list.

Prompt tokens get loss_mask 0; response tokens (and the EOS that ends each response) get 1. In
the input/output form the response is the output column (its final assistant turn(s) when it is a
conversation). With a `messages` column (`messages_key`, or a `messages` column found in a row that
has no input column, as TRL detects it), every assistant turn is a response and every other turn
is prompt. Segments are tokenized separately and concatenated, so a token boundary never straddles
prompt and response.
"""

from __future__ import annotations

from alignflow.stages.sft.config import DataConfig
from alignflow.stages.common.data import (DataError, Sample, column, encode, is_messages, load_rows, prompt_and_response,
                                          prompt_too_long, prompt_value, text_or_messages, whole_conversation)

AUTO_MESSAGES_KEY = "messages"


def input_output_sample(row: dict, where: str, tokenizer, cfg: DataConfig, section: str = "data") -> Sample:
    if (cfg.format != "text" and not cfg.input_template and isinstance(row, dict) and cfg.input_key not in row
            and is_messages(row.get(AUTO_MESSAGES_KEY))):
        return messages_sample(row, where, tokenizer, cfg, section, AUTO_MESSAGES_KEY)
    own_prompt = isinstance(row, dict) and whole_conversation(row.get(cfg.output_key))  # a response with its prompt turns
    prompt = prompt_value(row, where, cfg, cfg.input_key, f"{section}.input_key", required=not own_prompt)
    response = text_or_messages(column(row, cfg.output_key, where, f"{section}.output_key"), cfg.format, where, cfg.output_key, "assistant")
    segments = zip(prompt_and_response(tokenizer, prompt, response, where, cfg.format, (cfg.input_key, cfg.output_key)), (0, 1))
    return _sample(list(segments), where, tokenizer, cfg.max_len, section)


def messages_sample(row: dict, where: str, tokenizer, cfg: DataConfig, section: str = "data", key: str | None = None) -> Sample:
    key = key or cfg.messages_key
    messages = column(row, key, where, f"{section}.messages_key")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                 and isinstance(m.get("role"), str) for m in messages):
        raise DataError(f"{where}: {key!r} must be a list of {{role, content}} objects")
    if not tokenizer.chat_template:
        raise DataError(f"{where}: `messages` rows need a tokenizer with a chat template")
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns or any(not messages[i]["content"].strip() for i in turns):
        raise DataError(f"{where}: empty response (no non-empty assistant message)")
    segments, done = [], ""
    for i in turns:
        before = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=False)
        after = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (before.startswith(done) and after.startswith(before)):
            raise DataError(f"{where}: the chat template does not render turns as prefixes of each other")
        segments += [(before[len(done):], 0), (after[len(before):], 1)]
        done = after
    return _sample(segments, where, tokenizer, cfg.max_len, section)


def _sample(segments: list[tuple[str, int]], where: str, tokenizer, max_len: int, section: str) -> Sample:
    ids: list[int] = []
    mask: list[int] = []
    for text, trainable in segments:
        piece = encode(tokenizer, text)
        ids += piece
        mask += [trainable] * len(piece)
    first_response = mask.index(1)
    if first_response >= max_len:
        raise prompt_too_long(where, first_response, max_len, section)
    return Sample(ids[:max_len], mask[:max_len])  # truncation cuts the response, never the prompt


def load_sft_samples(cfg: DataConfig, tokenizer, seed: int, section: str = "data") -> tuple[list[Sample], list[Sample], dict]:
    """Train and held-out samples, with row statistics. An empty train set is an error."""
    build = messages_sample if cfg.messages_key else input_output_sample
    return load_rows(cfg, lambda where, row: build(row, where, tokenizer, cfg, section), seed, section)
