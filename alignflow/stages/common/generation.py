"""Generators: token ids in; token ids, their log-probs and finish reasons out.

The RL stage talks to a generator only through this interface, so the backend (Hugging Face
`generate` here; vLLM rollout engines in `vllm_engine.py`) can change without touching the
loop. Everything is token ids: the trainer scores exactly the tokens that were sampled,
with no decode/re-encode round trip.

Log-probs are of the sampled token under the model's distribution at the sampling
temperature (logits / T, before top-p/top-k truncation): the same quantity the trainer
computes for the importance ratio, so old and new log-probs are comparable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Rollout:
    prompt_ids: list[int]
    response_ids: list[int]  # ends with EOS when finish_reason == "stop"
    logprobs: list[float]  # one per response token
    finish_reason: str  # "stop" (EOS) or "length" (max_new_tokens reached)
    # Multi-turn trajectories only: 1 = sampled by the policy, 0 = environment token (log-prob 0,
    # no loss). None = every response token was sampled.
    action_mask: list[int] | None = None
    # Agent episodes whose calls do not extend one another (`rl/agents.py`): the calls sit in one row, each
    # restarting its position ids at 0 (prompt + response), and transformers keeps attention within each
    # call (a block-diagonal mask from the position ids). None = 0, 1, 2, ... over the whole row.
    position_ids: list[int] | None = None


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0 = greedy (log-probs then at temperature 1)
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    n: int = 1  # samples per prompt, returned consecutively
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()  # end a response like EOS does (and stay in it)


class Generator(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        """len(prompts) * params.n rollouts, the n samples of each prompt consecutive."""

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Replace the generator's weights with the trainer's (full, unsharded names)."""


class HFGenerator:
    """Batched `model.generate` with a KV cache on a local copy of the policy."""

    def __init__(self, model: torch.nn.Module, eos_token_id: int, pad_token_id: int, batch_size: int = 64):
        self.model = model.eval()
        self.model.config.use_cache = True
        self.eos, self.pad, self.batch_size = eos_token_id, pad_token_id, batch_size

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        # Every distinct tensor must come: named_parameters() lists a tied weight (lm_head = embeddings) once.
        required = {name for name, _ in self.model.named_parameters()}
        missing = sorted(required - set(state))
        unexpected = self.model.load_state_dict(state, strict=False).unexpected_keys
        if missing or unexpected:
            raise RuntimeError(f"weights do not fit the generator: missing {missing[:5]}, unexpected {unexpected[:5]}")

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        """n samples of each prompt, in order (a prompt's samples together). Each prompt is prefilled once and its
        KV cache copied to its n samples (a GRPO group of 8 prefills 1 prompt, not 8)."""
        generator = torch.Generator().manual_seed(params.seed)
        per_call = max(1, self.batch_size // params.n)  # prompts per batch: batch_size counts sequences
        out: list[Rollout] = []
        for k in range(0, len(prompts), per_call):
            out += self._batch(prompts[k:k + per_call], params, generator)
        return out

    def _batch(self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator) -> list[Rollout]:
        width, n = max(len(p) for p in prompts), params.n
        device = next(self.model.parameters()).device
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for b, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[b, width - len(p):], attn[b, width - len(p):] = torch.tensor(p), 1
        ids, attn = ids.to(device), attn.to(device)
        position = (attn.cumsum(-1) - 1).clamp(min=0)
        # the prompts once (only the last position's logits), then every sample continues from its prompt's cache
        result = self.model(input_ids=ids, attention_mask=attn, position_ids=position, use_cache=True, logits_to_keep=1)
        cache, logits = result.past_key_values, result.logits[:, -1].repeat_interleave(n, dim=0)
        if n > 1:
            cache.batch_repeat_interleave(n)
            attn, position = attn.repeat_interleave(n, dim=0), position.repeat_interleave(n, dim=0)
        rows = len(prompts) * n
        done = torch.zeros(rows, dtype=torch.bool, device=device)
        stop_ids = torch.tensor([self.eos, *params.stop_token_ids], device=device)
        tokens, logps = [], []
        step_pos, token = position[:, -1:], None
        for step in range(params.max_new_tokens):
            if step:
                result = self.model(input_ids=token.unsqueeze(-1), attention_mask=attn, position_ids=step_pos,
                                    past_key_values=cache, use_cache=True)
                cache, logits = result.past_key_values, result.logits[:, -1]
            logits = logits.float() / (params.temperature or 1.0)
            logp = torch.log_softmax(logits, -1)
            token = logits.argmax(-1) if params.temperature == 0 else sample(logits, params, generator).to(device)
            token = torch.where(done, torch.full_like(token, self.pad), token)
            tokens.append(token)
            logps.append(logp.gather(-1, token.unsqueeze(-1)).squeeze(-1))
            done |= torch.isin(token, stop_ids)
            if bool(done.all()):
                break
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=-1)  # finished rows' outputs are discarded
            step_pos = step_pos + 1
        stops = {self.eos, *params.stop_token_ids}
        tokens_of, logps_of = torch.stack(tokens, -1).tolist(), torch.stack(logps, -1).tolist()
        return [self._rollout(prompts[b // n], tokens_of[b], logps_of[b], stops) for b in range(rows)]

    def _rollout(self, prompt: list[int], tokens: list[int], logps: list[float], stops: set[int]) -> Rollout:
        end = next((j + 1 for j, t in enumerate(tokens) if t in stops), None)
        if end is not None:
            return Rollout(prompt, tokens[:end], logps[:end], "stop")
        return Rollout(prompt, tokens, logps, "length")


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """One token per row from temperature-scaled `logits` (B, V), with top-k and top-p (nucleus) truncation."""
    logits = logits.detach().cpu()
    if params.top_k:
        kth = logits.topk(min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        outside = probs.cumsum(-1) - probs > params.top_p  # keep the smallest prefix with mass >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(outside, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)
