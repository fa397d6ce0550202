"""KTO loss (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic
Optimization", Eq. 8). Pure torch: sequence log-probs in, (loss, metrics) out.

Variant: the paper's, with the batch-level KL reference point (as TRL's default).
r = log π(y|x) - log π_ref(y|x) per row. z0 = max(0, KL estimate), detached, where the
estimate is the mean of log π(y'|x) - log π_ref(y'|x) over mismatched pairs (x, y') built by
pairing each prompt of the batch with another row's completion (§4.3 of the paper).
v = λ_D σ(β (r - z0)) for desirable rows, λ_U σ(β (z0 - r)) for undesirable ones;
loss = mean(λ_y - v). The reference point carries no gradient (the paper's Eq. 8 note).
"""

from __future__ import annotations

import torch


def kto_reference_point(policy_mismatched: torch.Tensor, ref_mismatched: torch.Tensor) -> torch.Tensor:
    """z0 = max(0, mean(log π(y'|x) - log π_ref(y'|x))) over the batch's mismatched pairs, detached."""
    return (policy_mismatched - ref_mismatched).mean().clamp(min=0).detach()


def kto_loss(
    policy: torch.Tensor,  # (B,) summed log-probs of each row's completion under the policy
    ref: torch.Tensor,  # (B,) the same under the reference
    desirable: torch.Tensor,  # (B,) bool
    kl: torch.Tensor,  # () the reference point z0 from `kto_reference_point`
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    kl = kl.detach()
    r = policy - ref
    desirable = desirable.bool()
    weight = torch.where(desirable, torch.full_like(r, desirable_weight), torch.full_like(r, undesirable_weight))
    value = torch.where(desirable, torch.sigmoid(beta * (r - kl)), torch.sigmoid(beta * (kl - r)))  # Eq. 8
    losses = weight * (1 - value)
    rewards = beta * r.detach()
    zero = torch.zeros((), dtype=r.dtype, device=r.device)
    reward_d = rewards[desirable].mean() if desirable.any() else zero
    reward_u = rewards[~desirable].mean() if (~desirable).any() else zero
    return losses.mean(), {"kl": kl, "rewards/desirable": reward_d, "rewards/undesirable": reward_u,
                           "rewards/margin": reward_d - reward_u}
