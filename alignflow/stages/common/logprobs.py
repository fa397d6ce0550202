"""Token log-probabilities: the one quantity every loss in alignflow starts from. Pure torch.

Every stage reads log p(token) from a causal LM at chosen positions (`logprobs_at`). Where the model's logits are
its LM head applied to its last hidden state, and nothing else (`plain_head`), the model's own forward runs with the
head letting the hidden state through, and the head then runs on those positions alone, a chunk of rows at a time
(`lm_head.head_logprobs`), so the (tokens x vocabulary) logits are never materialised; elsewhere the model's
logits are used as they come.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from alignflow.stages.common.last_layer import (decoder_body, deferred_last_mlp, finish_last_layer, identity, llama_style,
                                                replaced, unwrapped)
from alignflow.stages.common.lm_head import gather_rows, head_logprobs

# Model types whose `...ForCausalLM` computes logits = lm_head(last hidden state): no soft-capping, scaling or bias tricks.
PLAIN_HEAD_MODELS = ("llama", "mistral", "qwen2", "qwen3")
LOGITS_PER_CHUNK = 1 << 25  # fp32 elements of one chunk's (rows x vocabulary) logits: 128 MiB


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


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) logits -> (...) entropy of each token's distribution."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def plain_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The LM head of a causal LM, a DeepSpeed engine around one, or a PEFT model; None where the logits are more
    than a plain linear head of the last hidden state, or where the head's weight is not here whole (a LoRA-wrapped
    head, a ZeRO-3 shard)."""
    hf = unwrapped(model)
    if getattr(getattr(hf, "config", None), "model_type", None) not in PLAIN_HEAD_MODELS:
        return None
    head = hf.get_output_embeddings()
    if type(head) is not torch.nn.Linear or hasattr(head.weight, "ds_id"):
        return None
    return head


def passing_through(head: torch.nn.Module):
    """The head returns its input: the model's forward then gives the last hidden state as its `logits`. The forward
    itself still runs, so what a DeepSpeed engine hangs on it (the backward prologue its ZeRO optimizers need)
    still happens."""
    return replaced(head, identity)


def logprobs_at(model: torch.nn.Module, inputs: dict[str, torch.Tensor | None], source: torch.Tensor, targets: torch.Tensor,
                keep: torch.Tensor | None = None, temperature: float = 1.0,
                with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) under `model` at the sampling temperature, each read from the output at the flat position
    `source` of the B*T outputs over `inputs`, and optionally the entropy of that distribution: fp32, shaped like
    `source`. Only entries where `keep` is set are computed; the rest are 0."""
    src, tgt = source.flatten(), targets.flatten()
    kept = None if keep is None else keep.flatten().nonzero().squeeze(-1)
    if kept is not None:
        src, tgt = src[kept], tgt[kept]
    head = plain_head(model)
    if head is not None:
        body = decoder_body(model)
        body = body if llama_style(body) else None  # the last layer's MLP only at the positions read
        with passing_through(head), deferred_last_mlp(body):
            hidden = gather_rows(model(**inputs, use_cache=False).logits, src)
        if body is not None:
            hidden = finish_last_layer(body, hidden)
        rows = max(1, LOGITS_PER_CHUNK // head.weight.shape[0])
        logp, entropy = head_logprobs(hidden, head.weight, head.bias, tgt, temperature, rows, with_entropy)
    else:
        picked = model(**inputs, use_cache=False).logits.flatten(0, 1)[src].float() / temperature
        logp = -F.cross_entropy(picked, tgt, reduction="none")
        entropy = entropy_from_logits(picked) if with_entropy else None
    return _spread(logp.float(), kept, source), None if entropy is None else _spread(entropy.float(), kept, source)


def _spread(values: torch.Tensor, kept: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if kept is None:
        return values.view(like.shape)
    return values.new_zeros(like.numel()).index_put((kept,), values).view(like.shape)


def forward_logprobs(model: torch.nn.Module, batch) -> torch.Tensor:
    """(B, T-1) log-probs of a `TokenBatch`'s next tokens under a causal LM (or a DeepSpeed engine around one), at
    its loss-mask positions (token t+1 is predicted at t); 0 elsewhere."""
    rows, width = batch.input_ids.shape
    at = torch.arange(rows, device=batch.input_ids.device)[:, None] * width + torch.arange(width - 1, device=batch.input_ids.device)
    inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "position_ids": batch.position_ids}
    return logprobs_at(model, inputs, at, batch.input_ids[:, 1:], keep=batch.loss_mask[:, 1:].ne(0))[0]
