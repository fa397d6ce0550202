"""Policy, value and entropy losses of the RL stage. Pure torch: tensors in, (loss, metrics) out.

Vocabulary as in `advantages.py`: (B, R) tensors over response tokens, `mask` 1 on them.
Aggregation: `token` divides the summed token losses by `num_tokens`, the response tokens
of the whole optimizer step (all micro-batches, all workers), so the step's gradient does
not depend on how it is split (DAPO's token-level loss, Yu et al. 2025 Eq. 12);
`sequence` averages each response's token mean and divides the sum by `num_sequences` of
the step (GRPO's original sample-level mean, Shao et al. 2024 Eq. 3).
"""

from __future__ import annotations

import torch

LOG_RATIO_CLAMP = 20.0  # |log π/π_old| bound before exp (verl's and OpenRLHF's value)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, agg: str, num_tokens: float, num_sequences: float) -> torch.Tensor:
    if agg == "token":
        return (per_token * mask).sum() / num_tokens
    if agg == "sequence":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / num_sequences
    raise ValueError(f"unknown aggregation {agg!r}: choose token or sequence")


def policy_loss(
    logp: torch.Tensor,  # (B, R) log-probs of the sampled tokens under the policy being trained
    old_logp: torch.Tensor,  # (B, R) the same under the policy that sampled them
    adv: torch.Tensor,  # (B, R) advantages
    mask: torch.Tensor,  # (B, R) 1 on response tokens
    clip_low: float = 0.2,
    clip_high: float = 0.2,  # > clip_low: DAPO's clip-higher (Yu et al. 2025 Eq. 10)
    dual_clip: float | None = None,  # c > 1: bound the loss of negative advantages (Ye et al. 2020 Eq. 5)
    agg: str = "token",
    num_tokens: float = 1.0,
    num_sequences: float = 1.0,
    is_weight: torch.Tensor | None = None,  # (B, R) truncated importance weights, see `truncated_is_weight`
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    mask = mask.to(logp.dtype)
    # Clamped as verl and OpenRLHF do: padding (mask 0) may hold any log-probs, and exp of a large log-ratio
    # is inf there, inf x 0 = NaN in the masked sum.
    log_ratio = torch.where(mask > 0, logp - old_logp, torch.zeros_like(logp)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    surrogate = ratio * adv
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    per_token = -torch.min(surrogate, clipped)  # PPO's clipped objective (Schulman et al. 2017 Eq. 7)
    if dual_clip is not None:
        per_token = torch.where(adv < 0, torch.min(per_token, -dual_clip * adv), per_token)
    if is_weight is not None:
        per_token = per_token * is_weight
    loss = aggregate(per_token, mask, agg, num_tokens, num_sequences)
    was_clipped = (clipped < surrogate).to(logp.dtype)  # the clipped term was the smaller one
    with torch.no_grad():
        # k3 of KL(π_old || π) from samples of π_old: (r - 1) - log r with r = π / π_old (Schulman 2020).
        return loss, {
            "clip_frac": (was_clipped * mask).sum() / mask.sum().clamp(min=1),
            "approx_kl": ((torch.expm1(log_ratio) - log_ratio) * mask).sum() / mask.sum().clamp(min=1),
            "ratio": (ratio * mask).sum() / mask.sum().clamp(min=1),
        }


def truncated_is_weight(old_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor, cap: float,
                        floor: float | None = None) -> torch.Tensor:
    """(B, R) clamp(π_old(a|s) / π_engine(a|s), floor, cap), no gradient: the tokens were sampled by the rollout
    engine, whose kernels give slightly different probabilities than the trainer's π_old; truncated
    importance sampling reweights each token's loss by the ratio (Yao et al. 2025, "Your efficient RL
    framework secretly brings you off-policy RL training", Eq. 3: TIS with cap C). `floor` also bounds it
    from below, so a token the engine over-sampled keeps some weight. 1 where mask is 0."""
    log_ratio = (old_logp.detach() - engine_logp.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    weight = torch.exp(log_ratio).clamp(min=floor, max=cap)
    return torch.where(mask > 0, weight, torch.ones_like(weight))


def value_loss(
    values: torch.Tensor,  # (B, R) critic values now
    old_values: torch.Tensor,  # (B, R) critic values when the rollout was scored
    returns: torch.Tensor,  # (B, R) targets
    mask: torch.Tensor,
    clip: float | None = 0.2,
    num_tokens: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """½ max((V - R)², (V_clip - R)²) with V_clip = V_old + clip(V - V_old, ±clip) (PPO's value
    clipping, as in OpenAI baselines), summed over tokens / num_tokens."""
    mask = mask.to(values.dtype)
    err = (values - returns) ** 2
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        err = torch.max(err, (clipped - returns) ** 2)
    loss = 0.5 * (err * mask).sum() / num_tokens
    with torch.no_grad():
        frac = ((values - old_values).abs() > clip).to(values.dtype) if clip is not None else torch.zeros_like(values)
        return loss, {"value_clip_frac": (frac * mask).sum() / mask.sum().clamp(min=1)}


