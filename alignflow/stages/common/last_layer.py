"""A scalar head read at a few positions, with the model's last layer computed only there.

A reward model's score is read at one position per response (its EOS), but a plain forward runs the last decoder
layer's attention output, MLP and final norm at every position. Their outputs anywhere else are thrown away: the
last layer's keys and values are all that the read positions need from the others. So the body runs up to the last
layer, whose keys and values are computed at every position and everything else only at the read positions. On
`builtin:tiny` (4 layers) that is a quarter of the body's work per pair, in forward and backward. The result is the
same function; only float rounding differs (a test compares scores and gradients with the full forward).

The shortcut knows the Llama-style decoder layer (Llama, Qwen2 and Mistral without a sliding window: pre-norm,
rotary, grouped-query attention, gated MLP). Any other model, or one whose attention it cannot reproduce, takes the
full forward.

Log-probs (`logprobs.logprobs_at`) are read at many positions (every response token), so there the last layer's
attention runs as the model's own, at every position, and only its MLP and the final norm are deferred to the read
positions (`deferred_last_mlp`, `finish_last_layer`): on SFT's data, where 71% of the tokens are prompt, that is
most of the last layer's MLP.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from alignflow.stages.common.lm_head import gather_rows

LLAMA_STYLE_LAYERS = {"LlamaDecoderLayer", "Qwen2DecoderLayer", "MistralDecoderLayer"}


def unwrapped(model) -> torch.nn.Module:
    """The transformers model under a DeepSpeed engine and PEFT (whose adapters live inside its layers)."""
    module = getattr(model, "module", model)
    return module.get_base_model() if hasattr(module, "get_base_model") else module


def decoder_body(model) -> torch.nn.Module | None:
    """The decoder stack (`layers`, `norm`) under a DeepSpeed engine, PEFT and the task head; None if not found."""
    module = unwrapped(model)
    body = getattr(module, getattr(module, "base_model_prefix", "model"), None)
    return body if hasattr(body, "layers") and hasattr(body, "norm") else None


def llama_style(body: torch.nn.Module | None) -> bool:
    """A pre-norm decoder whose last layer is attention + residual, then MLP + residual, with its weights here whole:
    ZeRO-3 gathers a shard only around its module's own call in the order it traced, so it keeps the full forward."""
    return (body is not None and len(body.layers) > 0 and type(body.layers[-1]).__name__ in LLAMA_STYLE_LAYERS
            and all(hasattr(body.layers[-1], name) for name in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"))
            and not any(hasattr(p, "ds_id") for p in body.layers[-1].parameters()))


def shortcut_applies(body: torch.nn.Module | None) -> bool:
    """`llama_style`, with an attention `last_layer_at` reproduces (its own projections, rotary, no dropout or window)."""
    if not llama_style(body):
        return False
    layer, config = body.layers[-1], body.config
    attention = layer.self_attn
    return (all(hasattr(attention, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling"))
            and getattr(config, "_attn_implementation", None) in ("sdpa", "eager")
            and not (attention.training and getattr(config, "attention_dropout", 0.0))
            and not getattr(config, "use_sliding_window", False)
            and (type(layer).__name__ != "MistralDecoderLayer" or getattr(config, "sliding_window", None) is None))


def head_at(model, head: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
            at: torch.Tensor) -> torch.Tensor:
    """(N,) output of the scalar `head` at the flat positions `at` of the (R, T) rows. `attention_mask` is the
    (R, 1, T, T) boolean mask (True: may attend) the rows are run with."""
    body = decoder_body(model)
    if not shortcut_applies(body):
        from alignflow.stages.common.pairs import token_scores

        return token_scores(model, head, input_ids, attention_mask, position_ids).flatten()[at]
    hidden, rotary = hidden_before_last_layer(model, body, head, input_ids, attention_mask, position_ids)
    out = last_layer_at(body.layers[-1], hidden, rotary, attention_mask, at)
    return head(body.norm(out))[..., 0].float()


def hidden_before_last_layer(model, body, head, input_ids, attention_mask, position_ids) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The last layer's input (R, T, C) and the rotary (cos, sin) the body gives it. The model's own forward runs (what
    a DeepSpeed engine hangs on it still happens) with its last layer, final norm and head passed through."""
    captured = {}

    def skip_layer(hidden_states, *args, **kwargs):
        captured.update(hidden=hidden_states, rotary=kwargs["position_embeddings"])
        return hidden_states

    with replaced(body.layers[-1], skip_layer), replaced(body.norm, identity), replaced(head, identity):
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return captured["hidden"], captured["rotary"]


def last_layer_at(layer, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor,
                  at: torch.Tensor) -> torch.Tensor:
    """(N, C) output of a Llama-style decoder `layer` at the flat positions `at` of `hidden` (R, T, C)."""
    attention, (cos, sin) = layer.self_attn, rotary
    rotate_half = sys.modules[type(layer).__module__].rotate_half
    rope = lambda x, c, s: x * c + rotate_half(x) * s  # noqa: E731  (Su et al. 2021, as the layer's own apply_rotary_pos_emb)
    R, T, _ = hidden.shape
    x = layer.input_layernorm(hidden)
    keys = rope(attention.k_proj(x).view(R, T, -1, attention.head_dim).transpose(1, 2), cos[:, None], sin[:, None])
    values = attention.v_proj(x).view(R, T, -1, attention.head_dim).transpose(1, 2)  # (R, Hkv, T, D)
    # The queries as (R, H, Q, D): each row's read positions in its own Q slots, so attention takes each row's keys
    # and values as they are (a copy of them per read position, with its backward, cost 5% of an RM step on
    # builtin:tiny).
    slot, source = read_slots(at, R, T)
    Q = source.numel() // R
    pick = lambda t: gather_rows(t, source)  # noqa: E731  (R x Q, ...) at the slots' positions
    queries = attention.q_proj(pick(x)).view(R, Q, -1, attention.head_dim).transpose(1, 2)
    queries = rope(queries, pick(cos).view(R, 1, Q, -1), pick(sin).view(R, 1, Q, -1))
    attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=pick(mask[:, 0]).view(R, 1, Q, T),
                                              scale=attention.scaling, enable_gqa=True)
    attended = gather_rows(attended.transpose(1, 2), slot).flatten(1)  # (N, H x D)
    out = gather_rows(hidden, at) + attention.o_proj(attended)
    return out + layer.mlp(layer.post_attention_layernorm(out))


def read_slots(at: torch.Tensor, R: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q slots per row for the flat positions `at` (into R x T), Q the most reads any row has: (N,) the slot (into
    R x Q) of each read, and (R x Q,) the flat position each slot reads; a spare slot reads its row's first position,
    and nothing reads its output."""
    rows = at // T
    order = torch.argsort(rows, stable=True)
    counts = torch.bincount(rows, minlength=R)
    first = torch.cumsum(counts, 0) - counts  # where each row's reads start in `order`
    Q = int(counts.max())
    slot = torch.empty_like(rows)
    slot[order] = rows[order] * Q + torch.arange(rows.numel(), device=rows.device) - first[rows[order]]
    source = torch.arange(R, device=rows.device).repeat_interleave(Q) * T
    source[slot] = at
    return slot, source


@contextmanager
def deferred_last_mlp(body: torch.nn.Module | None):
    """Inside, the model's forward ends after its last layer's attention (and residual): the last layer's MLP and the
    final norm are left to `finish_last_layer`, on the rows that are read. A no-op where `body` is None."""
    if body is None:
        yield
        return
    last = body.layers[-1]

    def attention_only(hidden_states, **kwargs):
        attended, _ = last.self_attn(hidden_states=last.input_layernorm(hidden_states), **kwargs)
        return hidden_states + attended

    with replaced(last, attention_only), replaced(body.norm, identity):
        yield


def finish_last_layer(body: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """(N, C) rows after the last layer's attention -> the model's final hidden states at those rows."""
    last = body.layers[-1]
    return body.norm(hidden + last.mlp(last.post_attention_layernorm(hidden)))


@contextmanager
def replaced(module: torch.nn.Module, forward):
    """`module` runs `forward` instead of its class's method; its own call (and every hook on it) stays."""
    module.forward = forward  # an instance attribute: found before the class's method
    try:
        yield
    finally:
        del module.forward


def identity(x: torch.Tensor) -> torch.Tensor:
    return x
