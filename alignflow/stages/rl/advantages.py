"""Advantage estimators for the RL stage. Pure torch: scores, masks and values in, advantages out.

Vocabulary: B sampled responses, the n samples of one prompt in consecutive rows (group
estimators need it); R response tokens; `mask` (B, R) is 1 on response tokens (the EOS
included) and 0 on the padding after it; `scores` (B,) is one reward per response (reward
model, reward function, or the summed rewards of an environment's episode); `kl` (B, R) is
the per-token KL penalty already scaled by its coefficient when the KL goes into the reward
(zeros otherwise).

One recipe for every estimator (the dispatch is `Estimator`'s properties, in one place):
1. a baseline is subtracted from the sequence scores (none, group mean, leave-one-out mean,
   or group mean and std);
2. per-token rewards r_t = -kl_t, plus the baselined score on the last response token;
3. `gae` runs GAE over r_t with the critic's values; every other estimator takes the
   discounted return of r_t from each token (with γ = 1 and no KL this is the baselined
   score on every token, which is GRPO/RLOO's broadcast);
4. REINFORCE++ and REINFORCE++-baseline then normalise the advantages over the batch.

Multi-turn episodes (`executors.MultiTurn`) are one token sequence in which the environment's
tokens sit between the policy's answers with mask 0, so a row's mask can have holes. The
steps of the MDP are the policy's tokens only; an environment reply is part of the transition
from the last token of one answer to the first of the next (the loss masking of tool/retrieved
tokens, as in Search-R1, Jin et al. 2025). `advantages` therefore moves each row's action
tokens to the front (`action_order`), runs the recipe on that contiguous mask — one γ step and
one value bootstrap across an environment reply, the episode's score on the last action token —
and puts the results back; environment tokens get 0.
"""

from __future__ import annotations

import torch

from alignflow.stages.rl.config import Estimator  # noqa: F401 (the choice lives with the config; dispatched here)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked entries of the whole batch; 0 where mask is 0."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def baselined_scores(estimator: Estimator, scores: torch.Tensor, n: int, eps: float = 1e-6,
                     present: torch.Tensor | None = None) -> torch.Tensor:
    """Step 1: scores minus the estimator's baseline. `n` consecutive rows share a prompt. `present` (bool) leaves
    dropped samples out: a group's baseline is over its present members (n = their count), and a group with fewer
    than two gets 0."""
    keep = torch.ones_like(scores) if present is None else present.to(scores.dtype)
    if not estimator.is_group:
        return scores * keep
    groups, keep = scores.view(-1, n), keep.view(-1, n)
    count = keep.sum(-1, keepdim=True)
    total = (groups * keep).sum(-1, keepdim=True)
    mean = total / count.clamp(min=1)
    if estimator == Estimator.GROUP_NORM:  # GRPO, Shao et al. 2024 §4.1.2: (r - mean(r)) / std(r), std unbiased
        std = (((groups - mean) ** 2 * keep).sum(-1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
        out = (groups - mean) / (std + eps)
    elif estimator == Estimator.RLOO:  # Ahmadian et al. 2024 Eq. 5: r_i - 1/(n-1) Σ_{j≠i} r_j
        out = groups - (total - groups) / (count - 1).clamp(min=1)
    else:  # Dr. GRPO (Liu et al. 2025 Eq. 3) and REINFORCE++-baseline: r - mean(r)
        out = groups - mean
    return (out * keep * (count >= 2)).view(-1)


def token_rewards(scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                  clip: tuple[float, float] | None = None) -> torch.Tensor:
    """Step 2: r_t = -kl_t, plus the score on the last response token (Ziegler et al. 2019 §2.2); `clip`
    bounds each shaped r_t to [low, high] (a KL spike or an outlier score cannot dominate the returns)."""
    rewards = -kl * mask if kl is not None else torch.zeros_like(mask, dtype=scores.dtype)
    last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & (mask > 0)  # the last masked position of each row
    rewards = rewards + last.to(scores.dtype) * scores.unsqueeze(-1)
    return rewards.clamp(*clip) * mask if clip is not None else rewards


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + γ G_{t+1} over response tokens; 0 on padding."""
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = (rewards[:, t] + gamma * running) * mask[:, t]
        out[:, t] = running
    return out


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, Eq. 16):
    δ_t = r_t + γ V_{t+1} - V_t,  A_t = δ_t + γλ A_{t+1}; the value after the last token is 0.
    Returns (advantages, returns = advantages + values), both 0 on padding."""
    values = values * mask
    adv = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * mask[:, t]
        adv[:, t] = running
    return adv, (adv + values) * mask


def action_order(mask: torch.Tensor) -> torch.Tensor:
    """(B, R) index that gathers each row's masked (action) tokens to the front, in order, then
    the rest: `x.gather(-1, index)` compacts, `scatter(-1, index, y)` puts back (a permutation)."""
    return torch.sort((mask == 0).to(torch.uint8), dim=-1, stable=True).indices


def advantages(estimator: Estimator, scores: torch.Tensor, mask: torch.Tensor, *, n: int = 1, gamma: float = 1.0,
               lam: float = 1.0, kl: torch.Tensor | None = None, values: torch.Tensor | None = None,
               reward_clip: tuple[float, float] | None = None, present: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both (B, R) and 0 on padding and environment tokens. `values` only for gae;
    `n` for group estimators; `reward_clip` bounds the shaped per-token rewards. A mask with holes is
    compacted first (module docstring)."""
    mask = mask.to(scores.dtype)
    if estimator.is_group and (n < 2 or scores.numel() % n):
        raise ValueError(f"{estimator.value} needs groups of n >= 2 samples per prompt; got n={n} for {scores.numel()} scores")
    index = action_order(mask)
    compact = lambda x: x.gather(-1, index) if x is not None else None  # noqa: E731
    adv, returns = _contiguous(estimator, scores, compact(mask), n, gamma, lam, compact(kl), compact(values), reward_clip, present)
    return torch.zeros_like(adv).scatter(-1, index, adv), torch.zeros_like(returns).scatter(-1, index, returns)


def _contiguous(estimator: Estimator, scores: torch.Tensor, mask: torch.Tensor, n: int, gamma: float, lam: float,
                kl: torch.Tensor | None, values: torch.Tensor | None, reward_clip: tuple[float, float] | None,
                present: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-4 on a mask whose 1s are a prefix of each row."""
    rewards = token_rewards(baselined_scores(estimator, scores, n, present=present), mask, kl, reward_clip)
    if estimator.needs_critic:
        if values is None:
            raise ValueError("gae needs the critic's values")
        return gae(rewards, values, mask, gamma, lam)
    returns = discounted_returns(rewards, mask, gamma)
    return (whiten(returns, mask) if estimator.whitens else returns), returns
