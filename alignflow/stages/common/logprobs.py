"""Token log-probabilities: the one quantity every loss in alignflow starts from. Pure torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """log p(input_ids[:, t+1] | input_ids[:, :t+1]) for t in [0, T-1).

    logits: (B, T, V) from a causal LM over input_ids (B, T). Returns (B, T-1), in fp32.
    Uses cross_entropy, which never materialises a full (B, T, V) log-softmax copy in fp32
    beyond what it needs for the gather.
    """
    logits = logits[:, :-1].float()
    targets = input_ids[:, 1:]
    nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none")
    return -nll.view_as(targets)


def sequence_logprobs(token_logps: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Sum of response-token log-probs per row: (B, T-1) log-probs, (B, T) response mask -> (B,).

    The mask is over input positions (1 = response token); token t+1 is predicted at t.
    A row whose mask selects nothing sums to 0.
    """
    return (token_logps * loss_mask[:, 1:].to(token_logps.dtype)).sum(-1)


def forward_logprobs(model: torch.nn.Module, batch) -> torch.Tensor:
    """(B, T-1) token log-probs of a `TokenBatch` under a causal LM (or a DeepSpeed engine around one)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                   use_cache=False).logits
    return token_logprobs(logits, batch.input_ids)


def sourced_logprobs(logits: torch.Tensor, source: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) log p(input_ids[:, t]) read from the output at position source[:, t]: the usual
    next-token shift generalised to rows where a token's predecessor is not the token before
    it (shared-prompt pair rows). Entries whose token is not a target are garbage; mask them."""
    picked = logits.gather(1, source.unsqueeze(-1).expand(-1, -1, logits.size(-1))).float()
    nll = F.cross_entropy(picked.reshape(-1, picked.size(-1)), input_ids.reshape(-1), reduction="none")
    return -nll.view_as(input_ids)
