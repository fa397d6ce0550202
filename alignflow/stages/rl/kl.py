"""KL to the reference policy: per-token estimators and the adaptive coefficient. Pure torch.

Estimators of KL(π || π_ref) from samples of π, per token, with log r = log π_ref - log π
(Schulman 2020, "Approximating KL Divergence"):
- k1 = -log r            unbiased, high variance, can be negative;
- k2 = (log r)^2 / 2     biased, low variance, always >= 0;
- k3 = (r - 1) - log r   unbiased, low variance, always >= 0 (GRPO's choice, Shao et al. 2024 Eq. 4).
"""

from __future__ import annotations

import torch

from alignflow.stages.rl.config import KLEstimator


def kl_per_token(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator, clamp: float = 20.0) -> torch.Tensor:
    """(B, R) KL estimate per token. log r is clamped so that k3's exp cannot overflow."""
    log_ratio = (ref_logp - logp).clamp(-clamp, clamp)
    if estimator == KLEstimator.K1:
        return -log_ratio
    if estimator == KLEstimator.K2:
        return 0.5 * log_ratio**2
    return torch.expm1(log_ratio) - log_ratio


def adaptive_kl_coef(coef: float, observed_kl: float, target: float, horizon: int, batch_size: int) -> float:
    """Ziegler et al. 2019, Eq. 2: e = clip(KL / KL_target - 1, ±0.2), β <- β (1 + e · batch / horizon)."""
    error = min(max(observed_kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * batch_size / horizon)
