"""Preference pairs (prompt, chosen, rejected) as token samples: shared by the rm and dpo stages.

A pair runs through the model as ONE row with the prompt once: `prompt | chosen | rejected`
(prefix sharing, as in Wang et al. 2024, "Accelerating Direct Preference Optimization with
Prefix Sharing"). The rejected tokens take position ids that continue the prompt and a
4D attention mask that hides the chosen tokens from them, so every token sees exactly what
it would see in its own `prompt | response` row: the outputs are the same as two separate
rows (a test checks), with the prompt computed once instead of twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from alignflow.config.base import PreferenceDataConfig
from alignflow.stages.common.data import (DataError, FilteredRow, Sample, chat_prompt_text, chat_texts, column, encode, load_rows,
                                          prompt_value, response_sample, text_or_messages)
from alignflow.stages.common.formats import conversation, finite_number, shared_prompt
from alignflow.stages.common.last_layer import head_at
from alignflow.stages.common.logprobs import logprobs_at
from alignflow.stages.common.packing import Packing


@dataclass
class Pair:
    chosen: Sample
    rejected: Sample
    margin: float = 0.0

    def __post_init__(self) -> None:
        # Read once: the stages ask for every pair's length each step (5 ms a step over 2,000 pairs when computed).
        self.prompt_len = self.chosen.loss_mask.index(1)
        self.length = len(self.chosen) + len(self.rejected) - self.prompt_len

    def __len__(self) -> int:  # tokens of the shared row
        return self.length


@dataclass
class PairBatch:
    """B pairs as blocks `prompt | chosen | rejected`, packed into R rows of width T (`stages/common/packing.py`).
    Per-pair fields index the flattened R x T positions."""

    input_ids: torch.Tensor  # (R, T)
    position_ids: torch.Tensor  # (R, T)
    attention_mask: torch.Tensor  # (R, 1, T, T) bool, True = may attend
    source: torch.Tensor  # (R, T) position in the row whose output predicts token t (t - 1, or the prompt's end for the first rejected token)
    chosen_mask: torch.Tensor  # (B, R x T) float, 1 on the pair's chosen response tokens
    rejected_mask: torch.Tensor  # (B, R x T) float, 1 on the pair's rejected response tokens
    chosen_end: torch.Tensor  # (B,) flat index of the chosen response's last token (its EOS)
    rejected_end: torch.Tensor  # (B,)

    def to(self, device) -> "PairBatch":
        return PairBatch(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def collate_pairs(pairs: list[Pair], pad_id: int) -> PairBatch:
    packing = Packing([len(p) for p in pairs])
    ids, pos, source, segments = [], [], [], []
    for pair, at in zip(pairs, packing.offsets):
        p, c, n = pair.prompt_len, len(pair.chosen) - pair.prompt_len, len(pair)
        ids.append(pair.chosen.input_ids + pair.rejected.input_ids[p:])
        pos.append([*range(p + c), *range(p, n - c)])
        # the first rejected token follows the prompt, not the chosen response (a position in the row)
        source.append([at + k for k in (0, *range(p + c - 1), p - 1, *range(p + c, n - 1))])
        segments.append([0] * p + [1] * c + [2] * (n - p - c))  # rejected tokens do not see the chosen ones
    seg, owner = packing.segments(segments)
    mine, flat = owner.flatten() == torch.arange(len(pairs)).unsqueeze(-1), seg.flatten()
    chosen_end = packing.starts + torch.tensor([len(p.chosen) for p in pairs]) - 1
    return PairBatch(packing.lay(ids, pad_id), packing.lay(pos, 0), packing.attention_mask(seg, owner), packing.lay(source, 0),
                     (mine & (flat == 1)).float(), (mine & (flat == 2)).float(), chosen_end,
                     packing.starts + torch.tensor([len(p) for p in pairs]) - 1)


def pair_logps(model, pairs: list[Pair], pad_id: int, device) -> dict[str, torch.Tensor]:
    """Summed response log-probs of chosen and rejected (one shared-prompt block per pair), and
    the token-mean NLL of each chosen response (for the optional NLL term)."""
    batch = collate_pairs(pairs, pad_id).to(device)
    inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "position_ids": batch.position_ids}
    rows, width = batch.input_ids.shape
    at = batch.source + torch.arange(rows, device=batch.source.device)[:, None] * width  # flat positions
    needed = (batch.chosen_mask + batch.rejected_mask).sum(0).ne(0).view(rows, width)
    logps = logprobs_at(model, inputs, at, batch.input_ids, keep=needed)[0].reshape(1, -1)
    chosen = (logps * batch.chosen_mask).sum(-1)
    return {"chosen": chosen, "rejected": (logps * batch.rejected_mask).sum(-1),
            "nll": -chosen / batch.chosen_mask.sum(-1).clamp(min=1)}


def pair_rewards(model, head: torch.nn.Module, pairs: list[Pair], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) rewards of B pairs, one shared-prompt block each, read at each response's EOS."""
    batch = collate_pairs(pairs, pad_id).to(device)
    scores = head_at(model, head, batch.input_ids, batch.attention_mask, batch.position_ids,
                     torch.cat([batch.chosen_end, batch.rejected_end]))
    return scores[:len(pairs)], scores[len(pairs):]


def token_scores(model, head: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) output of the scalar head at every position. transformers' classifier returns only
    the score it pools at the last non-padding token, so the head's output is taken with a hook."""
    captured = []
    handle = head.register_forward_hook(lambda module, args, output: captured.append(output))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    finally:
        handle.remove()
    return captured[0][..., 0].float()


def pair_from_row(row: dict, where: str, tokenizer, cfg: PreferenceDataConfig, section: str = "data") -> Pair:
    """A pair from text columns (prompt, chosen, rejected) or from conversations: two whole ones with no
    prompt column (UltraFeedback-binarized, HH-RLHF with `format: hh`), or a prompt and two answers."""
    keys = (cfg.prompt_key, cfg.chosen_key, cfg.rejected_key)
    chosen, rejected = (text_or_messages(column(row, k, where, f"{section}.{f}"), cfg.format, where, k, "assistant")
                        for k, f in ((cfg.chosen_key, "chosen_key"), (cfg.rejected_key, "rejected_key")))
    texts = isinstance(chosen, str) and isinstance(rejected, str)
    if texts and not cfg.input_template and isinstance(row, dict) and cfg.prompt_key not in row:
        column(row, cfg.prompt_key, where, f"{section}.prompt_key", f"; pairs of whole conversations need no prompt column, "
               f"and {section}.format: hh reads Human:/Assistant: transcripts")
    prompt = prompt_value(row, where, cfg, cfg.prompt_key, f"{section}.prompt_key", required=texts)
    if chosen == rejected:
        raise DataError(f"{where}: {cfg.chosen_key!r} and {cfg.rejected_key!r} are the same response ({str(chosen)[:60]!r}): nothing to prefer")
    if texts and isinstance(prompt, str):
        prompt_ids = encode(tokenizer, chat_prompt_text(tokenizer, prompt))
        responses = [encode(tokenizer, r + tokenizer.eos_token) for r in (chosen, rejected)]
    else:
        prompt_ids, responses = _conversation_pair(prompt, chosen, rejected, where, tokenizer, cfg.format, keys)
    pair = Pair(*(response_sample(prompt_ids, r, cfg.max_len, where, section) for r in responses), _margin(row, where, cfg, section))
    if pair.chosen.input_ids == pair.rejected.input_ids:
        raise DataError(f"{where}: chosen and rejected are identical after truncation to {section}.max_len (max_len={cfg.max_len})")
    return pair


def _conversation_pair(prompt, chosen, rejected, where: str, tokenizer, fmt: str, keys: tuple[str, str, str]):
    """Prompt ids and the two response ids of a conversational pair: the shared prompt is rendered once
    and must be, token for token, the start of each whole conversation's tokens."""
    sides = [conversation(prompt, answer, fmt, where, (keys[0], key)) for answer, key in ((chosen, keys[1]), (rejected, keys[2]))]
    asked = shared_prompt(*sides, where, keys[1:])
    prompt_ids, responses = None, []
    for (_, reply), key in zip(sides, keys[1:]):
        before, response = chat_texts(tokenizer, asked, reply, where)
        prompt_ids = encode(tokenizer, before)
        if encode(tokenizer, before + response)[:len(prompt_ids)] != prompt_ids:
            raise DataError(f"{where}: the prompt's tokens are not the first tokens of the {key!r} conversation "
                            "(the tokenizer merges across the turn boundary)")
        responses.append(encode(tokenizer, response))
    return prompt_ids, responses


def _margin(row: dict, where: str, cfg: PreferenceDataConfig, section: str) -> float:
    """The pair's margin: a margin column, or the difference of two score columns (then pairs whose
    gap is under `min_score_gap` are filtered out); 0 without either."""
    if cfg.margin_key:
        return _number(row, where, cfg.margin_key, f"{section}.margin_key")
    if not cfg.margin_from:
        return 0.0
    gap = _number(row, where, cfg.margin_from[0], f"{section}.margin_from") - _number(row, where, cfg.margin_from[1], f"{section}.margin_from")
    if cfg.min_score_gap is not None and gap < cfg.min_score_gap:
        raise FilteredRow(f"{where}: score gap under min_score_gap={cfg.min_score_gap}")
    return gap


def _number(row: dict, where: str, key: str, option: str) -> float:
    value = column(row, key, where, option)
    if isinstance(value, str):  # a CSV's columns are text
        try:
            value = float(value)
        except ValueError:
            pass
    if not finite_number(value):
        raise DataError(f"{where}: {key!r} must be a finite number (got {type(value).__name__} {value!r})")
    return float(value)


def load_pairs(cfg: PreferenceDataConfig, tokenizer, seed: int, section: str = "data") -> tuple[list[Pair], list[Pair], dict]:
    return load_rows(cfg, lambda where, row: pair_from_row(row, where, tokenizer, cfg, section), seed, section)
