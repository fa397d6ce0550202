"""Rows in, token samples and batches out: shared by every training stage.

Vocabulary used everywhere:
- a `Sample` is one training row as token ids plus `loss_mask` (1 where the
  token is a response token the loss should predict) and `position_ids`;
- a `TokenBatch` is a padded (B, T) stack of samples;
- packing puts several samples in one row; their position ids restart at 0,
  which makes transformers build a block-diagonal causal mask (no attention
  across samples) when the forward gets no attention mask and use_cache=False,
  so a packed row computes exactly what the separate rows do.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from alignflow.infra import storage


class DataError(ValueError):
    """A data problem, naming the source and the row."""


@dataclass
class Sample:
    input_ids: list[int]
    loss_mask: list[int]  # 1 = response token to predict
    position_ids: list[int] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def positions(self) -> list[int]:
        return self.position_ids if self.position_ids is not None else list(range(len(self.input_ids)))


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # (B, T)
    position_ids: torch.Tensor  # (B, T)
    loss_mask: torch.Tensor  # (B, T) float, 1 = response token
    attention_mask: torch.Tensor | None  # (B, T); None for packed rows (mask comes from position ids)
    num_tokens: int  # real (non-pad) tokens

    def to(self, device: torch.device | str) -> "TokenBatch":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return TokenBatch(move(self.input_ids), move(self.position_ids), move(self.loss_mask), move(self.attention_mask), self.num_tokens)


@dataclass
class RowStats:
    read: int = 0
    used: int = 0
    skipped: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {"read": self.read, "used": self.used, "skipped": dict(self.skipped)}


# --------------------------------------------------------------------------- reading rows


def read_rows(source: str, split: str = "train") -> Iterator[tuple[str, Any]]:
    """Yield (where, row) pairs; `where` names file and line (or row) for error messages.

    A JSONL line that is not valid JSON is yielded as an `InvalidRow` so the caller
    decides (error or counted skip) like for any other bad row.
    """
    suffix = Path(source.split("?")[0]).suffix
    if suffix in (".jsonl", ".json"):
        yield from _read_json(source, suffix)
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        fs, path = storage.filesystem(source)
        with fs.open(path, "rb") as f:
            for i, row in enumerate(pq.read_table(f).to_pylist()):
                yield f"{source}:row {i + 1}", row
    else:
        yield from _read_hf(source, split)


class InvalidRow(str):
    """The text of a row that could not be parsed."""


def _read_json(source: str, suffix: str) -> Iterator[tuple[str, Any]]:
    fs, path = storage.filesystem(source)
    with fs.open(path, "rb") as f:
        if suffix == ".json":
            try:
                rows = json.loads(f.read().decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise DataError(f"{source}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start})") from None
            except json.JSONDecodeError as exc:
                raise DataError(f"{source}:{exc.lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(rows, list):
                raise DataError(f"{source}: a .json dataset must be a list of rows")
            for i, row in enumerate(rows):
                yield f"{source}:row {i + 1}", row
            return
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield f"{source}:{lineno}", InvalidRow(f"not UTF-8 text (byte {raw[exc.start]:#04x} at column {exc.start + 1})")
                continue
            if not line.strip():
                continue
            try:
                yield f"{source}:{lineno}", json.loads(line)
            except json.JSONDecodeError as exc:
                yield f"{source}:{lineno}", InvalidRow(f"not valid JSON ({exc.msg})")


def _read_hf(source: str, split: str) -> Iterator[tuple[str, Any]]:
    import datasets

    if Path(source).is_dir() and (Path(source) / "dataset_dict.json").exists():
        ds = datasets.load_from_disk(source)[split]
    elif Path(source).is_dir() and (Path(source) / "dataset_info.json").exists():
        ds = datasets.load_from_disk(source)
    else:
        ds = datasets.load_dataset(source, split=split)
    for i, row in enumerate(ds):
        yield f"{source}[{split}] row {i}", row


# --------------------------------------------------------------------------- text -> tokens


def chat_prompt_text(tokenizer, prompt: str) -> str:
    """The prompt as the model sees it: a user turn plus the assistant header, or raw text."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    return (tokenizer.bos_token or "") + prompt


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def require_str(row: dict, key: str, where: str, allow_empty: bool = False) -> str:
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    if key not in row:
        raise DataError(f"{where}: missing key {key!r} (row has: {', '.join(sorted(row)) or 'no keys'})")
    value = row[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: {key!r} must be a string, got {type(value).__name__} {value!r}")
    if not allow_empty and not value.strip():
        raise DataError(f"{where}: {key!r} is empty")
    return value


def response_sample(prompt_ids: list[int], response_ids: list[int], max_len: int, where: str) -> Sample:
    """Prompt (loss_mask 0) then response (loss_mask 1), cut at max_len: truncation cuts the
    response, never the prompt, and a prompt with no room left for a response is an error."""
    if len(prompt_ids) >= max_len:
        raise DataError(f"{where}: prompt is {len(prompt_ids)} tokens, not shorter than data.max_len={max_len}")
    ids = prompt_ids + response_ids
    return Sample(ids[:max_len], ([0] * len(prompt_ids) + [1] * len(response_ids))[:max_len])


def collect(rows: Iterator[tuple[str, Any]], build, on_bad_row: str, stats: RowStats, limit: int | None = None) -> list:
    """Apply `build(where, row)` to each row; a DataError stops the run or is counted as a skip."""
    out = []
    for where, row in rows:
        stats.read += 1
        try:
            if isinstance(row, InvalidRow):
                raise DataError(f"{where}: {row}")
            out.append(build(where, row))
        except DataError as exc:
            if on_bad_row == "error":
                raise
            stats.skipped[str(exc).split(": ", 1)[-1].split(" (")[0]] += 1
        if limit is not None and len(out) >= limit:
            break
    stats.used = len(out)
    return out


def load_rows(cfg, build, seed: int) -> tuple[list, list, dict]:
    """Train and held-out items of a `DataSource` config, built by `build(where, row)`, with row
    statistics. Held out: the rows of `eval_path`, else `eval_fraction` of the training rows."""
    stats = RowStats()
    items = collect(read_rows(cfg.path, cfg.split), build, cfg.on_bad_row, stats, cfg.max_samples)
    if not items:
        raise DataError(f"{cfg.path}: no usable rows ({stats.read} read, skipped: {dict(stats.skipped) or 'none'})")
    eval_stats = RowStats()
    if cfg.eval_path:
        train, held = items, collect(read_rows(cfg.eval_path, cfg.split), build, cfg.on_bad_row, eval_stats)
    else:
        train, held = split_holdout(items, cfg.eval_fraction, seed)
    if not train:
        raise DataError(f"{cfg.path}: no training rows left after holding out eval_fraction={cfg.eval_fraction}")
    return train, held, {"train": stats.as_dict(), "eval": eval_stats.as_dict()}


def split_holdout(items: list, fraction: float, seed: int) -> tuple[list, list]:
    """Deterministic (train, held-out) split of a list."""
    if fraction <= 0:
        return items, []
    order = np.random.default_rng(seed).permutation(len(items))
    n_eval = max(1, int(round(len(items) * fraction)))
    held = set(order[:n_eval].tolist())
    return [x for i, x in enumerate(items) if i not in held], [x for i, x in enumerate(items) if i in held]


# --------------------------------------------------------------------------- packing and batches


def pack(samples: list[Sample], max_len: int) -> list[Sample]:
    """Best-fit-decreasing packing into rows of at most max_len tokens; position ids restart per sample."""
    order = sorted(range(len(samples)), key=lambda i: (-len(samples[i]), i))
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = len(samples[i])
        best = min((j for j in range(len(rows)) if free[j] >= n), key=lambda j: (free[j], j), default=None)
        if best is None:
            rows.append([i])
            free.append(max_len - n)
        else:
            rows[best].append(i)
            free[best] -= n
    packed = []
    for members in rows:
        ids, mask, pos = [], [], []
        for i in sorted(members):
            ids += samples[i].input_ids
            mask += samples[i].loss_mask
            pos += list(range(len(samples[i])))
        packed.append(Sample(ids, mask, pos))
    return packed


def collate(samples: list[Sample], pad_id: int, packed: bool) -> TokenBatch:
    """Right-pad to the longest sample. Packed rows get no attention mask; their pad tail gets
    its own position run (0, 1, ...) so it forms a separate block that no real token attends to."""
    width = max(len(s) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    pos = torch.zeros((len(samples), width), dtype=torch.long)
    loss = torch.zeros((len(samples), width), dtype=torch.float32)
    attn = torch.zeros((len(samples), width), dtype=torch.long)
    for b, s in enumerate(samples):
        n = len(s)
        ids[b, :n] = torch.tensor(s.input_ids)
        pos[b, :n] = torch.tensor(s.positions)
        pos[b, n:] = torch.arange(width - n)
        loss[b, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        attn[b, :n] = 1
    real = sum(len(s) for s in samples)
    return TokenBatch(ids, pos, loss, None if packed else attn, real)


def steps_per_epoch(num_items: int, global_batch_size: int) -> int:
    return num_items // global_batch_size


def global_batch(num_items: int, global_batch_size: int, step: int, seed: int) -> list[int]:
    """Indices of the items in optimizer step `step`: a function of (seed, step) only, so a
    resumed run sees exactly the batches an uninterrupted one would (the incomplete tail of
    each epoch's shuffled order is dropped)."""
    per_epoch = steps_per_epoch(num_items, global_batch_size)
    epoch, index = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(num_items)
    return order[index * global_batch_size:(index + 1) * global_batch_size].tolist()


def rank_micro_batches(indices: list[int], lengths: list[int], micro: int, world: int, rank: int) -> list[list[int]]:
    """Split one global batch into this rank's micro-batches.

    Items are sorted by length first so that each micro-batch pads little; with the loss
    normalised by the tokens of the whole step this changes no gradient, only the padding.
    Micro-batch j goes to rank j % world.
    """
    ordered = sorted(indices, key=lambda i: (-lengths[i], i))
    chunks = [ordered[k:k + micro] for k in range(0, len(ordered), micro)]
    return [c for j, c in enumerate(chunks) if j % world == rank]
