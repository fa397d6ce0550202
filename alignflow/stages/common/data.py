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
from alignflow.stages.common.formats import (DataError, FilteredRow, Messages, closest, column, conversation, is_messages,
                                             render_template, text_or_messages, whole_conversation)

__all__ = ["DataError", "FilteredRow"]  # re-exported: stages import the data errors from here


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
    """Rows read, used, skipped (bad rows under `on_bad_row: skip`, blank lines) and filtered (left out by
    an option such as `min_score_gap`), by reason; and the columns seen."""

    read: int = 0
    used: int = 0
    skipped: Counter = field(default_factory=Counter)
    filtered: Counter = field(default_factory=Counter)
    columns: set = field(default_factory=set)

    def as_dict(self) -> dict[str, Any]:
        return {"read": self.read, "used": self.used, "skipped": dict(self.skipped), "filtered": dict(self.filtered)}

    def line(self) -> str:
        return describe_rows(self.as_dict())


def describe_rows(stats: dict[str, Any]) -> str:
    """`4000 rows read, 3990 used, 10 skipped (blank line: 2; ...)` of a `RowStats.as_dict()`."""
    parts = [f"{stats['read']} rows read, {stats['used']} used"]
    for what in ("skipped", "filtered"):
        counts = Counter(stats.get(what) or {})
        if counts:
            parts.append(f"{sum(counts.values())} {what} ({'; '.join(f'{reason}: {n}' for reason, n in counts.most_common())})")
    return ", ".join(parts)


def row_metrics(data_stats: dict[str, dict]) -> dict[str, float]:
    """`data/train/read`, `.../used`, `.../skipped`, `.../filtered` of each file that was read."""
    return {f"data/{part}/{what}": float(n if isinstance(n, int) else sum(n.values()))
            for part, stats in data_stats.items() if stats.get("read")
            for what, n in stats.items() if what in ("read", "used", "skipped", "filtered")}


# --------------------------------------------------------------------------- reading rows


def read_rows(source: str, split: str = "train") -> Iterator[tuple[str, Any]]:
    """Yield (where, row) pairs; `where` names file and line (or row) for error messages.

    A JSONL line that is not valid JSON is yielded as an `InvalidRow` so the caller
    decides (error or counted skip) like for any other bad row.
    """
    suffix = Path(source.split("?")[0]).suffix
    if suffix in (".jsonl", ".json"):
        yield from _read_json(source, suffix)
    elif suffix in (".parquet", ".csv"):
        yield from _read_table(source, suffix)
    else:
        yield from _read_hf(source, split)


class InvalidRow(str):
    """The text of a row that could not be parsed."""


class BlankRow(InvalidRow):
    """An empty line: always skipped, and counted."""


BLANK_LINE = "blank line"


def _read_table(source: str, suffix: str) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    fs, path = storage.filesystem(source)
    with fs.open(path, "rb") as f:
        try:
            table = pq.read_table(f) if suffix == ".parquet" else pcsv.read_csv(f)
        except (pa.ArrowInvalid, UnicodeDecodeError) as exc:
            raise DataError(f"{source}: not a readable {suffix[1:]} file ({str(exc).splitlines()[0]})") from None
    if suffix == ".csv":  # CSV has no types: text stays text (a column of digits is not a number), booleans stay labels
        table = table.cast(pa.schema([(f.name, f.type if pa.types.is_boolean(f.type) else pa.string()) for f in table.schema]))
    first = 2 if suffix == ".csv" else 1  # a CSV's first line is its header
    for i, row in enumerate(table.to_pylist()):
        yield (f"{source}:{i + first}" if suffix == ".csv" else f"{source}:row {i + 1}"), row


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
                yield f"{source}:{lineno}", BlankRow(BLANK_LINE)
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
        try:
            ds = datasets.load_dataset(source, split=split)
        except Exception as exc:  # noqa: BLE001 - datasets raises many kinds; each means "cannot be read here"
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            raise DataError(f"{source}: cannot load this `datasets` dataset ({type(exc).__name__}: {first}); without the "
                            "network a hub dataset must be a local file or already in the datasets cache") from None
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


def require_str(row: dict, key: str, where: str, option: str, allow_empty: bool = False) -> str:
    value = column(row, key, where, option)
    if not isinstance(value, str):
        raise DataError(f"{where}: {key!r} must be a string, got {type(value).__name__} {value!r}")
    if not allow_empty and not value.strip():
        raise DataError(f"{where}: {key!r} is empty")
    return value


def prompt_value(row: dict, where: str, cfg, key: str, option: str, required: bool = True) -> str | Messages | None:
    """A row's prompt: `input_template` filled from its columns, else the `key` column as text or
    messages (None when `required` is false and the row has no such column)."""
    if cfg.input_template:
        option = f"{option.rsplit('.', 1)[0]}.input_template"
        text = render_template(cfg.input_template, row, where, option)
        if not text:
            raise DataError(f"{where}: empty prompt (every column of {option} is empty)")
        return text
    if not required and isinstance(row, dict) and key not in row:
        return None
    return text_or_messages(column(row, key, where, option), cfg.format, where, key)


def prompt_text(tokenizer, prompt: str | Messages, where: str) -> str:
    """The prompt as the model sees it, ending where the response starts: a string as one user turn
    (raw text with a template-less tokenizer), messages through the chat template."""
    if isinstance(prompt, str):
        return chat_prompt_text(tokenizer, prompt)
    _need_chat_template(tokenizer, where)
    return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)


def prompt_and_response(tokenizer, prompt: str | Messages, response: str | Messages, where: str, fmt: str,
                        fields: tuple[str, str]) -> tuple[str, str]:
    """(prompt text, response text) of a prompt and its response. Two strings: the prompt as a user turn
    and the response plus EOS. Otherwise both as messages through the chat template, the response
    being the final assistant turn(s) as the template renders them."""
    if isinstance(prompt, str) and isinstance(response, str) and fmt in ("auto", "text"):
        return chat_prompt_text(tokenizer, prompt), response + tokenizer.eos_token
    asked, reply = conversation(prompt, response, fmt, where, fields)
    return chat_texts(tokenizer, asked, reply, where)


def chat_texts(tokenizer, prompt: Messages, response: Messages, where: str) -> tuple[str, str]:
    """The rendered prompt (with the generation header) and what the template adds for the response."""
    before = prompt_text(tokenizer, prompt, where)
    after = tokenizer.apply_chat_template(prompt + response, tokenize=False)
    if not after.startswith(before):
        raise DataError(f"{where}: the chat template does not render the prompt as a prefix of the whole conversation")
    return before, after[len(before):]


def prompt_too_long(where: str, tokens: int, max_len: int, section: str) -> DataError:
    return DataError(f"{where}: prompt not shorter than {section}.max_len ({tokens} tokens, max_len={max_len})")


def _need_chat_template(tokenizer, where: str) -> None:
    if not tokenizer.chat_template:
        raise DataError(f"{where}: conversational rows need a tokenizer with a chat template (this one has none); "
                        "give text columns and no `format: chat`")


def response_sample(prompt_ids: list[int], response_ids: list[int], max_len: int, where: str, section: str = "data") -> Sample:
    """Prompt (loss_mask 0) then response (loss_mask 1), cut at max_len: truncation cuts the
    response, never the prompt, and a prompt with no room left for a response is an error."""
    if len(prompt_ids) >= max_len:
        raise prompt_too_long(where, len(prompt_ids), max_len, section)
    ids = prompt_ids + response_ids
    return Sample(ids[:max_len], ([0] * len(prompt_ids) + [1] * len(response_ids))[:max_len])


def collect(rows: Iterator[tuple[str, Any]], build, on_bad_row: str, stats: RowStats, limit: int | None = None) -> list:
    """Apply `build(where, row)` to each row. A DataError stops the run or is counted as a skip; blank
    lines are always counted as skipped and rows an option leaves out (FilteredRow) as filtered."""
    out = []
    for where, row in rows:
        stats.read += 1
        if isinstance(row, dict) and len(stats.columns) < 1000:
            stats.columns.update(row)
        try:
            if isinstance(row, BlankRow):
                stats.skipped[str(row)] += 1
                continue
            if isinstance(row, InvalidRow):
                raise DataError(f"{where}: {row}")
            out.append(build(where, row))
        except FilteredRow as exc:
            stats.filtered[_reason(exc)] += 1
        except DataError as exc:
            if on_bad_row == "error":
                raise
            stats.skipped[_reason(exc)] += 1
        if limit is not None and len(out) >= limit:
            break
    stats.used = len(out)
    return out


def _reason(exc: DataError) -> str:
    """An error's reason without its place or row values, so that counts add up by kind."""
    return str(exc).split(": ", 1)[-1].split(" (")[0]


def load_rows(cfg, build, seed: int, section: str = "data") -> tuple[list, list, dict]:
    """Train and held-out items of a `DataSource` config, built by `build(where, row)`, with row
    statistics, reported on the console. Held out: the rows of `eval_path`, else `eval_fraction`
    of the training rows that were not skipped."""
    stats = RowStats()
    items = collect(read_rows(cfg.path, cfg.split), build, cfg.on_bad_row, stats, cfg.max_samples)
    report(cfg.path, stats, cfg, section)
    if not items:
        raise DataError(f"{cfg.path}: no usable rows ({stats.line()})")
    check_skips(cfg.path, stats, cfg, section)
    eval_stats = RowStats()
    if cfg.eval_path:
        train, held = items, collect(read_rows(cfg.eval_path, cfg.split), build, cfg.on_bad_row, eval_stats)
        report(cfg.eval_path, eval_stats, cfg, section)
        check_skips(cfg.eval_path, eval_stats, cfg, section)
    else:
        train, held = split_holdout(items, cfg.eval_fraction, seed)
    if not train:
        raise DataError(f"{cfg.path}: no training rows left after holding out eval_fraction={cfg.eval_fraction} "
                        f"of the {len(items)} usable rows ({stats.line()})")
    return train, held, {"train": stats.as_dict(), "eval": eval_stats.as_dict()}


def every_row(data):
    """The section as a loader reads it with every row of `path` held out (capped by `max_samples`): the
    loaders' train part, with nothing split off. A local copy: the config itself stays as parsed."""
    return data.model_copy(update={"eval_fraction": 0.0, "eval_path": None})


def report(source: str, stats: RowStats, cfg, section: str) -> None:
    """The rows of one file on the console, and a warning for columns nothing reads."""
    print(f"data {source}: {stats.line()}", flush=True)
    used = cfg.used_columns()
    unused = sorted(stats.columns - used) if used is not None else []
    if unused:
        print(f"warning: data {source}: column(s) {', '.join(map(repr, unused))} are not used by {section} (set "
              f"{section}.input_template to use them in the prompt, or {section}.ignore_columns to silence this)", flush=True)


def check_skips(source: str, stats: RowStats, cfg, section: str) -> None:
    """Fail when more than `max_skip_fraction` of the rows were skipped. Blank lines are counted but not held
    against the limit (a stray empty line would otherwise fail a small file)."""
    blank = stats.skipped.get(BLANK_LINE, 0)
    skipped, rows = sum(stats.skipped.values()) - blank, stats.read - blank
    if rows and skipped / rows > cfg.max_skip_fraction:
        raise DataError(f"{source}: {skipped} of {rows} rows skipped ({skipped / rows:.1%}), more than "
                        f"{section}.max_skip_fraction={cfg.max_skip_fraction} ({stats.line()}); fix the data or raise the limit")


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
