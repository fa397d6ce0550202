"""Loading tokenizers and causal LMs: `builtin:*`, a local HF folder, or a hub name, by one path."""

from __future__ import annotations

import torch

from alignflow.config import ModelConfig
from alignflow.stages.common.builtin_model import is_builtin, resolve_builtin

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_model_path(name_or_path: str) -> str:
    return resolve_builtin(name_or_path) if is_builtin(name_or_path) else name_or_path


def load_tokenizer(cfg: ModelConfig):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_path(cfg.name_or_path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # common for base models; padding is always masked out
    return tok


def load_causal_lm(cfg: ModelConfig) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_path(cfg.name_or_path), dtype=DTYPES[cfg.dtype], attn_implementation=cfg.attn_implementation
    )
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model
