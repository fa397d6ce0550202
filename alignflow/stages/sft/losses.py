"""SFT loss: next-token negative log-likelihood on response tokens only. Pure torch."""

from __future__ import annotations

import torch


def sft_loss(
    token_logps: torch.Tensor,  # (B, T-1) log p of each next token
    loss_mask: torch.Tensor,  # (B, T) 1 where input token t is a response token
    num_tokens: float | torch.Tensor,  # response tokens in the whole optimizer step (all micro-batches, all ranks)
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sum of response-token NLL divided by the step's response-token count.

    Dividing by the count of the whole step (not of this micro-batch) makes the step's
    gradient the token-mean over the global batch however it is split into micro-batches
    and workers: the invariance the tests check.
    """
    mask = loss_mask[:, 1:].to(token_logps.dtype)  # token t+1 is predicted at position t
    nll_sum = -(token_logps * mask).sum()
    loss = nll_sum / num_tokens
    return loss, {"nll_sum": nll_sum.detach(), "tokens": mask.sum().detach()}
