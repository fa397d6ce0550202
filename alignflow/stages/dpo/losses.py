"""DPO, cDPO and IPO losses. Pure torch: sequence log-probs in, (loss, metrics) out.

z = (π_c - π_r) - (ref_c - ref_r), each term the summed log-prob of the response.
- DPO (Rafailov et al. 2023, Eq. 7): -log σ(β z).
- cDPO (Mitchell 2023, "A note on DPO with noisy preferences"): labels flipped with
  probability ε: -(1 - ε) log σ(β z) - ε log σ(-β z).
- IPO (Azar et al. 2023, Eq. 17): (z - 1/(2β))²; with summed log-probs as in the
  paper's pseudo-code (some libraries average per token: that changes the scale of β).
- Optional NLL term on the chosen response (RPO, Pang et al. 2024, Eq. 1):
  + α · NLL(chosen), the NLL a token mean per pair.
Implicit rewards β (π - ref) are reported as rewards/chosen and rewards/rejected.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def preference_loss(
    policy_chosen: torch.Tensor,  # (B,) summed log-probs under the policy
    policy_rejected: torch.Tensor,  # (B,)
    ref_chosen: torch.Tensor,  # (B,) summed log-probs under the frozen reference
    ref_rejected: torch.Tensor,  # (B,)
    beta: float,
    kind: str = "dpo",  # "dpo" (cDPO when label_smoothing > 0) or "ipo"
    label_smoothing: float = 0.0,
    chosen_nll: torch.Tensor | None = None,  # (B,) token-mean NLL of each chosen response
    nll_weight: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    z = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    if kind == "dpo":
        per_pair = -(1 - label_smoothing) * F.logsigmoid(beta * z) - label_smoothing * F.logsigmoid(-beta * z)
    elif kind == "ipo":
        per_pair = (z - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown preference loss {kind!r}: choose dpo or ipo")
    if nll_weight:
        per_pair = per_pair + nll_weight * chosen_nll
    reward_chosen = beta * (policy_chosen - ref_chosen).detach()
    reward_rejected = beta * (policy_rejected - ref_rejected).detach()
    extra = {"nll": chosen_nll.detach().mean()} if chosen_nll is not None else {}
    return per_pair.mean(), {**extra,
        "rewards/chosen": reward_chosen.mean(),
        "rewards/rejected": reward_rejected.mean(),
        "rewards/accuracy": (reward_chosen > reward_rejected).float().mean(),
        "rewards/margin": (reward_chosen - reward_rejected).mean(),
    }
