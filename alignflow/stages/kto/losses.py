"""KTO loss (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic
Optimization", Eq. 8). Pure torch: sequence log-probs in, (loss, metrics) out.

r = log π(y|x) - log π_ref(y|x) per row; z0 = max(0, KL estimate), detached, where the
KL estimate is the mean of log π(y'|x) - log π_ref(y'|x) over mismatched pairs (x, y')
made by pairing each prompt with another row's completion, as in §4.3 of the paper;
v = λ_D σ(β (r - z0)) for desirable rows, λ_U σ(β (z0 - r)) for undesirable ones;
loss = mean(λ_y - v). This is the paper's variant with the batch-level KL reference
point (TRL's default); the KL term carries no gradient.
"""

from __future__ import annotations

import torch


def kto_loss(
    policy: torch.Tensor,  # (B,) summed log-probs of each row's completion under the policy
    ref: torch.Tensor,  # (B,) the same under the reference
    desirable: torch.Tensor,  # (B,) bool
    policy_mismatched: torch.Tensor,  # (B,) log-probs of mismatched completions under the policy
    ref_mismatched: torch.Tensor,  # (B,) the same under the reference
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    kl = (policy_mismatched - ref_mismatched).mean().clamp(min=0).detach()
    r = policy - ref
    desirable = desirable.bool()
    weight = torch.where(desirable, torch.full_like(r, desirable_weight), torch.full_like(r, undesirable_weight))
    value = torch.where(desirable, torch.sigmoid(beta * (r - kl)), torch.sigmoid(beta * (kl - r)))
    losses = weight * (1 - value)
    rewards = beta * r.detach()
    zero = torch.zeros((), dtype=r.dtype, device=r.device)
    return losses.mean(), {
        "kl": kl,
        "rewards/desirable": rewards[desirable].mean() if desirable.any() else zero,
        "rewards/undesirable": rewards[~desirable].mean() if (~desirable).any() else zero,
    }
