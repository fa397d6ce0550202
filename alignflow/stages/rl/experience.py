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
from alignflow.stages.rl.losses import entropy_from_logits


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
        b = len(rollouts)
        width = max(len(r.prompt_ids) + len(r.response_ids) for r in rollouts)
        resp = max(1, max(len(r.response_ids) for r in rollouts))
        ids = torch.full((b, width), pad_id, dtype=torch.long)
        attn = torch.zeros((b, width), dtype=torch.long)
        positions = torch.zeros((b, resp), dtype=torch.long)
        targets = torch.full((b, resp), pad_id, dtype=torch.long)
        mask = torch.zeros((b, resp))
        sampled = torch.zeros((b, resp))
        packed = any(r.position_ids is not None for r in rollouts)
        pos = torch.arange(width).repeat(b, 1) if packed else None
        for i, r in enumerate(rollouts):
            p, n = len(r.prompt_ids), len(r.response_ids)
            ids[i, :p + n] = torch.tensor(r.prompt_ids + r.response_ids)
            attn[i, :p + n] = 1
            positions[i] = (p - 1 + torch.arange(resp)).clamp(max=width - 1)
            targets[i, :n] = torch.tensor(r.response_ids, dtype=torch.long)
            mask[i, :n] = torch.tensor(r.action_mask, dtype=torch.float32) if r.action_mask is not None else 1.0
            sampled[i, :n] = torch.tensor(r.logprobs) * mask[i, :n]
            if r.position_ids is not None:  # padding continues the last call's positions: causal, so never seen
                pos[i, :p + n] = torch.tensor(r.position_ids)
                pos[i, p + n:] = r.position_ids[-1] + 1 + torch.arange(width - p - n)
        return Experience(ids, attn, positions, targets, mask, sampled, pos)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def lengths(self) -> list[int]:
        """Tokens of each row (prompt + response): what a micro-batch pads to."""
        return self.attention_mask.sum(-1).tolist()

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


def response_widths(mask: torch.Tensor) -> torch.Tensor:
    """(B,) 1 + the index of each row's last 1 in `mask` (0 for an empty row): with holes in the mask this is
    more than the number of 1s."""
    return (mask.ne(0) * torch.arange(1, mask.shape[-1] + 1, device=mask.device)).amax(-1)


def response_logprobs(model, exp: Experience, temperature: float, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, R) log-probs of the response tokens under `model` at the sampling temperature, and
    optionally their entropies. Both garbage where mask is 0."""
    logits = model(**exp.model_inputs(), use_cache=False).logits
    picked = logits.gather(1, exp.positions.unsqueeze(-1).expand(-1, -1, logits.size(-1))).float() / temperature
    logp = -torch.nn.functional.cross_entropy(picked.reshape(-1, picked.size(-1)), exp.targets.reshape(-1),
                                              reduction="none").view_as(exp.targets)
    return logp, entropy_from_logits(picked) if with_entropy else None


def response_values(model, head: torch.nn.Module, exp: Experience) -> torch.Tensor:
    """(B, R) critic values at the positions that predict each response token (the state before it)."""
    from alignflow.stages.common.pairs import token_scores

    inputs = exp.model_inputs()
    return token_scores(model, head, inputs["input_ids"], inputs["attention_mask"], inputs.get("position_ids")).gather(1, exp.positions)
