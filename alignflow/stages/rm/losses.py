"""Pairwise reward-model losses. Pure torch: rewards in, (loss, metrics) out.

Ouyang et al. 2022 (InstructGPT), Eq. 1: loss = -log σ(r_c - r_r); Llama 2 (Touvron et
al. 2023, Eq. 2) adds a per-pair margin m: -log σ(r_c - r_r - m). `logexp` is the same
objective written log(1 + exp(r_r - r_c)) (OpenRLHF's LogExpLoss), computed as softplus.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pairwise_loss(
    chosen: torch.Tensor,  # (B,) reward of the chosen response
    rejected: torch.Tensor,  # (B,) reward of the rejected response
    kind: str = "sigmoid",  # "sigmoid" (with optional margin) or "logexp"
    margin: torch.Tensor | None = None,  # (B,) per-pair margin, sigmoid only
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    diff = chosen - rejected
    if kind == "sigmoid":
        shifted = diff - margin if margin is not None else diff
        per_pair = -F.logsigmoid(shifted)  # stable for large |diff|
    elif kind == "logexp":
        if margin is not None:
            raise ValueError("a margin goes with the sigmoid loss, not logexp")
        per_pair = F.softplus(-diff)  # log(1 + exp(r_r - r_c))
    else:
        raise ValueError(f"unknown pairwise loss {kind!r}: choose sigmoid or logexp")
    loss = per_pair.mean()
    return loss, {
        "accuracy": (diff > 0).float().mean().detach(),
        "reward_chosen": chosen.mean().detach(),
        "reward_rejected": rejected.mean().detach(),
        "margin": diff.mean().detach(),
    }
