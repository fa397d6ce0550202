"""Loading tokenizers, causal LMs and reward models: `builtin:*`, a local HF folder, a hub name,
or a published stage output (downloaded once from remote storage), by one path."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from alignflow.config.base import ConfigError, LoraConfig, ModelConfig
from alignflow.infra import storage
from alignflow.stages.common.builtin_model import cache_root, is_builtin, resolve_builtin


def transformers_without_unused_extras() -> None:
    """Called before anything imports from transformers (not at import: a stage that loads no model, such as
    select, imports no transformers). transformers imports scikit-learn and SciPy when they are installed, as
    MLflow installs them: scikit-learn for the `roc_curve` of assisted decoding, SciPy for the matching of
    object-detection losses. No stage uses either, and they cost up to 2 s of each worker process's start here
    (every role of an RL stage is one). Told they are absent, transformers skips them; the packages themselves
    stay importable (a reward function may use them)."""
    import transformers.utils

    transformers.utils.is_sklearn_available = lambda: False
    transformers.utils.is_scipy_available = lambda: False


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
REWARD_MEAN, REWARD_STD = "alignflow_reward_mean", "alignflow_reward_std"  # keys in a published reward model's config.json
log = logging.getLogger(__name__)
_warned_bf16: set[str] = set()


def cpu_has_fast_bf16() -> bool:
    """Whether oneDNN runs bf16 matmuls natively on this CPU (AVX-512 with BF16 or AMX, or AVX-512 that it
    emulates bf16 with). Without it torch falls back to a slow generic kernel."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def warn_if_bf16_is_slow(setting: str) -> None:
    """Once per setting and process: bf16 asked for on a CPU without fast bf16 matmuls, where it runs slower
    than fp32 instead of faster (an AVX2-only EPYC Zen 3: a bf16 GEMM of builtin:small's shapes at 2 GFLOP/s
    against 114 in fp32). Only a warning: the run is correct, and a user may mean to test a bf16 config here."""
    if torch.cuda.is_available() or setting in _warned_bf16 or cpu_has_fast_bf16():
        return
    _warned_bf16.add(setting)
    log.warning("%s: this CPU has no fast bf16 matmuls (no AVX-512 BF16, AMX or AVX-512 for oneDNN), so bf16 runs "
                "slower than fp32 here; use float32 / fp32 on this machine", setting)


def load_dtype(name: str) -> torch.dtype:
    """The torch dtype a model loads in (`model.dtype`), checked against this CPU's bf16 speed."""
    if name == "bfloat16":
        warn_if_bf16_is_slow("model.dtype: bfloat16")
    return DTYPES[name]


def resolve_model_path(name_or_path: str) -> str:
    if is_builtin(name_or_path):
        return resolve_builtin(name_or_path)
    if not Path(name_or_path).is_dir() and os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(name_or_path, "config.json"), str):
            raise ConfigError(f"model {name_or_path!r} is neither a local folder nor in the Hugging Face cache, and "
                              "HF_HUB_OFFLINE is set: download it first (`huggingface-cli download`) or give its folder")
    return name_or_path


def fetch_published_model(stage_uri: str, digest: str) -> str:
    """Local folder of `{stage_uri}/model`. Remote outputs are downloaded once per manifest digest into
    the cache; ranks racing for it each download to a temp folder and the first rename wins."""
    uri = storage.join(stage_uri, "model")
    if storage.is_local(uri):
        return str(storage.local_path(uri))
    dest = cache_root() / "inputs" / digest[:32]
    if not (dest / "config.json").exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
        try:
            storage.download_dir(uri, tmp)
            os.rename(tmp, dest)
        except OSError:
            if not (dest / "config.json").exists():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(dest)


def load_tokenizer(path: str):
    transformers_without_unused_extras()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_path(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # common for base models; padding is always masked out
    return tok


def load_causal_lm(path: str, cfg: ModelConfig) -> torch.nn.Module:
    transformers_without_unused_extras()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(path), dtype=load_dtype(cfg.dtype), attn_implementation=cfg.attn_implementation)
    return _for_training(model, cfg)


def load_reward_model(path: str, cfg: ModelConfig, pad_token_id: int) -> torch.nn.Module:
    """A causal LM backbone with a scalar head (`AutoModelForSequenceClassification`, one label):
    the plain HF class, so the published folder loads back with transformers alone. The score
    is read at the last non-padding token, which is why the pad id must be in the config."""
    transformers_without_unused_extras()
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(
        resolve_model_path(path), num_labels=1, dtype=load_dtype(cfg.dtype), attn_implementation=cfg.attn_implementation
    )
    model.config.pad_token_id = pad_token_id
    return _for_training(model, cfg)


def _for_training(model: torch.nn.Module, cfg: ModelConfig) -> torch.nn.Module:
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model


def with_lora(model: torch.nn.Module, lora: LoraConfig | None, reward: bool = False) -> torch.nn.Module:
    """The model with PEFT LoRA adapters (unset: unchanged): only the adapters and `modules_to_save` stay trainable.
    A reward model's score head is new, so it is always trained in full (PEFT's SEQ_CLS task saves it)."""
    if lora is None:
        return model
    from peft import LoraConfig as PeftLoraConfig, TaskType, get_peft_model

    tied = {"embed_tokens", "lm_head"} & set(lora.modules_to_save) if getattr(model.config, "tie_word_embeddings", False) else set()
    if tied:  # PEFT would train a copy of one side and leave the other tied to the frozen original
        raise ConfigError(f"lora.modules_to_save: {', '.join(sorted(tied))} is tied to the other of embed_tokens/lm_head "
                          "in this model (tie_word_embeddings); leave it out, or train in full")
    targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    config = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                            modules_to_save=list(lora.modules_to_save) or None,
                            task_type=TaskType.SEQ_CLS if reward else TaskType.CAUSAL_LM)
    try:
        return get_peft_model(model, config)
    except ValueError as exc:  # e.g. a target module name the model does not have
        raise ConfigError(f"lora: {exc}") from None


def is_lora(model: torch.nn.Module) -> bool:
    if "peft" not in sys.modules:  # no PEFT model can exist before PEFT is imported (0.3 s)
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters; under ZeRO-3 a partitioned parameter counts its full size (`ds_numel`)."""
    trainable = total = 0
    for p in model.parameters():
        n = getattr(p, "ds_numel", p.numel())
        total += n
        trainable += n if p.requires_grad else 0
    return trainable, total


PEFT_PREFIX = "base_model.model."  # a PeftModel's parameter names are the base model's under this prefix


def merged_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights of a LoRA `model` with its adapter merged, under the base model's own names (what an engine or
    `from_pretrained` loads), from `state`: the model's full, gathered state (PEFT names). Each adapted linear layer
    becomes W + (alpha / r) * B @ A (Hu et al. 2021, Eq. 3); a module saved in full takes its trained copy's weights."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for key, value in state.items():
        name = key.removeprefix(PEFT_PREFIX)
        if ".lora_" in name or ".original_module." in name:
            continue
        out[name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")] = value
    for path, module in model.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_A:
            a, b = state[f"{path}.lora_A.default.weight"], state[f"{path}.lora_B.default.weight"]
            delta = b.float() @ a.float() * module.scaling["default"]
            if getattr(module, "fan_in_fan_out", False):  # Conv1D layers (GPT-2) store the weight transposed
                delta = delta.T
            name = f"{path}.weight".removeprefix(PEFT_PREFIX)
            out[name] = out[name] + delta.to(out[name].dtype)
    return out
