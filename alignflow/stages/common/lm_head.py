"""Chunked LM-head log-probs: next-token log-probs (and entropies) without materialising the (tokens x vocab) logits.

This is the fused-linear-cross-entropy idea of the Liger kernel (LinkedIn, "Liger Kernel: Efficient Triton Kernels for LLM
Training", 2024) and of Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models" (arXiv:2411.09009, 2024),
written here in plain torch: the forward pass walks over chunks of rows, and the backward pass recomputes each chunk's logits
instead of saving them, so the autograd graph holds only O(N) extra numbers (the per-row logsumexp, and the entropy).

For a row with hidden state h, tempered logits y = (h W^T + b) / T, lse = logsumexp(y), p = softmax(y) = exp(y - lse):

    logp   = y[target] - lse                      d logp / dy = onehot(target) - p
    H      = -sum_v p_v log p_v = lse - sum_v p_v y_v     d H / dy = -p * (log p + H)

With incoming grads g_logp, g_H the grad wrt z = h W^T + b is  dz = (g_logp * (onehot - p) - g_H * p * (log p + H)) / T,
and then  d hidden = dz @ W,  d W = dz^T @ hidden,  d b = sum_rows dz.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

__all__ = ["head_logprobs", "gather_rows"]


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """The dtype of the softmax math: fp32 for half/bf16/fp32 inputs; fp64 only when an input is already fp64 (keeps
    gradcheck exact)."""
    dtype = torch.float32
    for t in tensors:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """Tempered logits of one row chunk in the compute dtype. The matmul runs in the weight's dtype, as the model's own
    head does (a bf16 model's logits stay the generator's), and no fp32 copy of the weight is made; then / T."""
    y = F.linear(h.to(w.dtype), w, b).to(dtype)
    if temperature != 1.0:
        y.div_(temperature)
    return y


class _ChunkedHeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_rows, with_entropy):
        ctx.set_materialize_grads(False)  # unused outputs give None grads, so we can skip their terms
        dtype = _compute_dtype(hidden, weight, bias)
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=dtype)
        lse = hidden.new_empty(n, dtype=dtype)
        ent = hidden.new_empty(n, dtype=dtype) if with_entropy else None
        for start in range(0, n, chunk_rows):
            rows = slice(start, start + chunk_rows)
            y = _chunk_logits(hidden[rows], weight, bias, temperature, dtype)
            lse_c = torch.logsumexp(y, dim=-1)
            lse[rows] = lse_c
            logp[rows] = y.gather(1, targets[rows, None]).squeeze(1) - lse_c
            if with_entropy:
                # H = lse - sum p*y; avoids forming log p separately.
                p = torch.exp(y - lse_c[:, None])
                ent[rows] = lse_c - (p * y).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
        ctx.temperature = temperature
        ctx.chunk_rows = chunk_rows
        ctx.dtype = dtype
        if with_entropy:
            return logp, ent
        return logp

    @staticmethod
    @once_differentiable  # the hand-written backward is not itself differentiable; fail loudly on double backward
    def backward(ctx, g_logp, g_ent=None):
        with torch.autocast(ctx.saved_tensors[0].device.type, enabled=False):  # recompute as the forward computed
            return _ChunkedHeadLogprobs._backward(ctx, g_logp, g_ent)

    @staticmethod
    def _backward(ctx, g_logp, g_ent):
        hidden, w, b, targets, lse, ent = ctx.saved_tensors  # the head's weight and bias
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        none = (None,) * 4
        if not (need_h or need_w or need_b) or (g_logp is None and g_ent is None):
            return (None, None, None) + none
        dtype, temperature = ctx.dtype, ctx.temperature
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(w.shape, dtype=dtype, device=w.device) if need_w else None  # fp32 (or fp64) across chunks
        grad_b = torch.zeros(w.shape[0], dtype=dtype, device=w.device) if need_b else None
        for start in range(0, hidden.shape[0], ctx.chunk_rows):
            rows = slice(start, start + ctx.chunk_rows)
            h = hidden[rows].to(w.dtype)
            dz = _chunk_grad_z(h, w, b, temperature, targets[rows], lse[rows],
                               None if g_logp is None else g_logp[rows],
                               None if g_ent is None else g_ent[rows],
                               None if ent is None else ent[rows])
            dz_w = dz.to(w.dtype)  # the two matmuls in the weight's dtype, as the forward's
            if need_h:
                grad_h[rows] = (dz_w @ w).to(hidden.dtype)
            if need_w:
                if dz_w.dtype == grad_w.dtype:
                    grad_w.addmm_(dz_w.t(), h)
                else:
                    grad_w += (dz_w.t() @ h).to(grad_w.dtype)
            if need_b:
                grad_b += dz.sum(0)
        if need_w:
            grad_w = grad_w.to(w.dtype)
        if need_b:
            grad_b = grad_b.to(b.dtype)
        return (grad_h, grad_w, grad_b) + none


def _chunk_grad_z(h, w, b, temperature, targets, lse, g_logp, g_ent, ent):
    """Grad wrt the untempered logits z of one chunk: (g_logp (onehot - p) - g_H p (log p + H)) / T."""
    log_p = _chunk_logits(h, w, b, temperature, lse.dtype).sub_(lse[:, None])  # reuse the logits' storage for log p
    p = torch.exp(log_p)
    if g_logp is not None:
        g = g_logp.to(p.dtype)[:, None]
        dy = p * -g
        dy.scatter_add_(1, targets[:, None], g)  # + g onehot(target)
    else:
        dy = torch.zeros_like(p)
    if g_ent is not None:
        # -g_H p (log p + H); log_p is dead after this, so add H in place.
        dy.addcmul_(p, log_p.add_(ent[:, None]).mul_(g_ent.to(p.dtype)[:, None]), value=-1.0)
    return dy.div_(temperature) if temperature != 1.0 else dy


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                  temperature: float = 1.0, chunk_rows: int = 1024, with_entropy: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden (N, H) (any float dtype), weight (V, H), bias (V,) or None, targets (N,) int64 ids.
    Returns logp (N,) fp32 = log softmax((hidden @ weight.T + bias) / temperature)[targets], and if with_entropy the
    (N,) fp32 entropy of that same tempered distribution, else None.

    Logits are computed chunk_rows rows at a time (the matmul in the weight's dtype, the softmax in fp32; fp64 if an input
    is fp64, then the outputs are fp64 too) and are never kept: backward recomputes them per chunk. Gradients come back in the input dtypes. Callers select the rows they
    need (e.g. drop ignore-index positions) before calling; N == 0 is fine.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"expected hidden (N, H) and weight (V, H), got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"expected bias ({weight.shape[0]},), got {tuple(bias.shape)}")
    if targets.shape != (hidden.shape[0],):
        raise ValueError(f"expected targets ({hidden.shape[0]},), got {tuple(targets.shape)}")
    if chunk_rows < 1 or temperature <= 0:
        raise ValueError(f"chunk_rows must be >= 1 and temperature > 0, got {chunk_rows} and {temperature}")
    # Under autocast the forward's matmuls would run in another dtype than the backward's recomputation.
    with torch.autocast(hidden.device.type, enabled=False):
        out = _ChunkedHeadLogprobs.apply(hidden, weight, bias, targets.long(), float(temperature), int(chunk_rows), bool(with_entropy))
    return out if with_entropy else (out, None)


def gather_rows(hidden: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """(B, T, H) hidden states and a flat index into the B*T positions -> (len(source), H)."""
    return hidden.flatten(0, 1)[source]
