"""A step's rollouts as tensors, and the per-token quantities the RL roles compute from them.

Vocabulary: B responses; each row is its prompt followed by its response, right-padded to
T tokens. Response token j of a row sits at index prompt_len + j and is predicted by the
output at `positions[:, j]` = prompt_len - 1 + j. Every per-token tensor of the RL stage
(log-probs, values, KL, advantages) is (B, R) over response tokens, with `mask` 1 on real
response tokens: the one response-mask name used everywhere in `stages/rl/`.

In a multi-turn episode the response is the whole trajectory after the first prompt: the
policy's answers and, between them, the environment's replies. Those are context, not
actions: `mask` is 0 on them (the rollout's `action_mask`), so the mask has holes and a
row's response width is the position of its last 1, not the number of 1s.

An agent episode whose calls do not extend one another (a chat template that re-renders an earlier turn)
is one row of several calls, each with its own prompt: `position_ids` restart at 0 for each call and the
model gets no attention mask, so transformers attends within each call only (the packing of SFT). Each
call's tokens are then scored in exactly the context the engine sampled them in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from alignflow.stages.common.generation import Rollout
from alignflow.stages.common.packing import Packing
from alignflow.stages.common.logprobs import logprobs_at


@dataclass
class Experience:
    input_ids: torch.Tensor  # (B, T) prompt + response, right-padded
    attention_mask: torch.Tensor  # (B, T)
    positions: torch.Tensor  # (B, R) index whose output predicts response token j
    targets: torch.Tensor  # (B, R) response token ids (pad id after the response)
    mask: torch.Tensor  # (B, R) float, 1 on response tokens the policy sampled (0 on padding and environment tokens)
    sampled_logp: torch.Tensor  # (B, R) log-probs the generator reported for the tokens it sampled (0 where mask is 0)
    position_ids: torch.Tensor | None = None  # (B, T) when a row holds several calls (then no attention mask to the model)

    @staticmethod
    def from_rollouts(rollouts: list[Rollout], pad_id: int) -> "Experience":
        width = max(len(r.prompt_ids) + len(r.response_ids) for r in rollouts)
        resp = max(1, max(len(r.response_ids) for r in rollouts))
        ids, targets, mask, sampled, prompt_lens, lens = [], [], [], [], [], []
        for r in rollouts:  # lists first, one tensor each: per-row tensor writes cost ~10 ms a step
            p, n = len(r.prompt_ids), len(r.response_ids)
            lens.append(p + n)
            ids.append(r.prompt_ids + r.response_ids + [pad_id] * (width - p - n))
            targets.append(r.response_ids + [pad_id] * (resp - n))
            m = [float(a) for a in r.action_mask] if r.action_mask is not None else [1.0] * n
            mask.append(m + [0.0] * (resp - n))
            sampled.append([lp * a for lp, a in zip(r.logprobs, m)] + [0.0] * (resp - n))
            prompt_lens.append(p)
        attn = (torch.arange(width) < torch.tensor(lens).unsqueeze(-1)).long()
        positions = (torch.tensor(prompt_lens).unsqueeze(-1) - 1 + torch.arange(resp)).clamp(max=width - 1)
        pos = None
        if any(r.position_ids is not None for r in rollouts):
            pos = torch.arange(width).repeat(len(rollouts), 1)
            for i, r in enumerate(rollouts):
                if r.position_ids is not None:  # padding continues the last call's positions: causal, so never seen
                    k = len(r.position_ids)
                    pos[i, :k] = torch.tensor(r.position_ids)
                    pos[i, k:] = r.position_ids[-1] + 1 + torch.arange(width - k)
        return Experience(torch.tensor(ids), attn, positions, torch.tensor(targets), torch.tensor(mask), torch.tensor(sampled), pos)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def lengths(self) -> list[int]:
        """Tokens of each row (prompt + response): what a micro-batch pads to."""
        return self.attention_mask.sum(-1).tolist()

    def micro_batch(self, index: list[int]) -> "Experience | SharedRows":
        """The given rows as the model runs them: rows that share a prompt as `SharedRows` (the prompt computed
        once) when any do, else padded rows (`rows`). Agent rows of several calls always go as padded rows."""
        if self.position_ids is None:
            groups = prompt_groups(self, index)
            if len(groups) < len(index):
                return SharedRows.build(self, index, groups)
        return self.rows(index)

    def rows(self, index: list[int]) -> "Experience":
        """The given rows, cut to their own widths (a micro-batch)."""
        idx = torch.tensor(index)
        width = int(self.attention_mask[idx].sum(-1).max())
        resp = max(1, int(response_widths(self.mask[idx]).max()))
        return Experience(self.input_ids[idx, :width], self.attention_mask[idx, :width],
                          self.positions[idx, :resp].clamp(max=width - 1), self.targets[idx, :resp], self.mask[idx, :resp],
                          self.sampled_logp[idx, :resp], None if self.position_ids is None else self.position_ids[idx, :width])

    def to(self, device) -> "Experience":
        return Experience(*(None if getattr(self, f) is None else getattr(self, f).to(device) for f in self.__dataclass_fields__))

    def model_inputs(self) -> dict[str, torch.Tensor | None]:
        """What the model is called with: packed rows go by their position ids, with no attention mask."""
        if self.position_ids is None:
            return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}
        return {"input_ids": self.input_ids, "attention_mask": None, "position_ids": self.position_ids}

    @property
    def source(self) -> torch.Tensor:
        """(B, R) flat index (into the model's B x T outputs) of the output that predicts response token j."""
        return self.positions + torch.arange(len(self), device=self.positions.device).unsqueeze(-1) * self.input_ids.shape[1]


def prompt_groups(exp: Experience, index: list[int]) -> list[list[int]]:
    """`index` grouped by prompt (equal prompt token ids), in first-seen order."""
    groups: dict[tuple[int, ...], list[int]] = {}
    starts = exp.positions[:, 0] + 1  # a row's response starts where its prompt ends
    for i in index:
        groups.setdefault(tuple(exp.input_ids[i, :int(starts[i])].tolist()), []).append(i)
    return list(groups.values())


@dataclass
class SharedRows:
    """A micro-batch whose rows sharing a prompt run as ONE row: the prompt once, then each response (prefix
    sharing, as the preference stages run chosen and rejected: `stages/common/pairs.py`). Each response's
    position ids continue the prompt's, and a 4D mask hides the other responses from it, so every token sees
    exactly what it sees in its own row and the outputs equal the padded rows' (a test checks). A GRPO group
    of n samples then computes its prompt once instead of n times.

    Per-token tensors stay (B, R) in the order of the rows asked for; `source` indexes the G x T outputs."""

    input_ids: torch.Tensor  # (G, T) one row per prompt group, right-padded
    attention_mask: torch.Tensor  # (G, 1, T, T) bool, True = may attend
    position_ids: torch.Tensor  # (G, T)
    source: torch.Tensor  # (B, R) flat index into G x T of the output that predicts response token j
    targets: torch.Tensor  # (B, R)
    mask: torch.Tensor  # (B, R)
    sampled_logp: torch.Tensor  # (B, R)

    @staticmethod
    def build(exp: Experience, index: list[int], groups: list[list[int]]) -> "SharedRows":
        sub = exp.rows(index)  # the (B, R) tensors, cut to this micro-batch's response width
        starts, lengths = (exp.positions[:, 0] + 1).tolist(), exp.attention_mask.sum(-1).tolist()
        ids_of = exp.input_ids.tolist()
        ids, seg, pos, where = [], [], [], {}  # one block per group: its prompt, then each response
        for g, members in enumerate(groups):
            p = starts[members[0]]
            ids.append(ids_of[members[0]][:p])
            seg.append([0] * p)
            pos.append(list(range(p)))
            for k, i in enumerate(members, start=1):
                n = lengths[i] - p
                where[i] = (g, len(ids[g]), n, p)
                ids[g] += ids_of[i][p:p + n]
                seg[g] += [k] * n
                pos[g] += range(p, p + n)
        packing = Packing([len(x) for x in ids])
        # response token j is predicted by the output before it: the prompt's last, then the response's own (past
        # the response, where the mask is 0, the response's last output stands in)
        g, at, n, p = torch.tensor([where[i] for i in index]).unsqueeze(-1).unbind(1)
        block_start = packing.starts[g]  # in the flattened rows x T outputs
        start = block_start + at
        j = torch.arange(sub.mask.shape[1])
        source = torch.where(j == 0, block_start + p - 1, torch.minimum(start + j - 1, start + n.clamp(min=1) - 1))
        return SharedRows(packing.lay(ids, 0), packing.attention_mask(*packing.segments(seg)), packing.lay(pos, 0), source,
                          sub.targets, sub.mask, sub.sampled_logp)

    def to(self, device) -> "SharedRows":
        return SharedRows(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))

    def model_inputs(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "position_ids": self.position_ids}


def response_widths(mask: torch.Tensor) -> torch.Tensor:
    """(B,) 1 + the index of each row's last 1 in `mask` (0 for an empty row): with holes in the mask this is
    more than the number of 1s."""
    return (mask.ne(0) * torch.arange(1, mask.shape[-1] + 1, device=mask.device)).amax(-1)


def response_logprobs(model, exp: "Experience | SharedRows", temperature: float, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, R) log-probs of the response tokens under `model` at the sampling temperature, and
    optionally their entropies. Both 0 where mask is 0."""
    return logprobs_at(model, exp.model_inputs(), exp.source, exp.targets, keep=exp.mask.ne(0), temperature=temperature,
                       with_entropy=with_entropy)


def response_values(model, head: torch.nn.Module, exp: "Experience | SharedRows") -> torch.Tensor:
    """(B, R) critic values at the positions that predict each response token (the state before it)."""
    from alignflow.stages.common.pairs import token_scores

    inputs = exp.model_inputs()
    return token_scores(model, head, inputs["input_ids"], inputs["attention_mask"], inputs.get("position_ids")).flatten()[exp.source]
