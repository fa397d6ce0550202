"""Publishing a stage result: HF model, config, metrics, model card, then the manifest last.

Layout under `{storage_root}/{pipeline}/{stage}/{cache_key}/`:
`model/` (safetensors, config.json, tokenizer, generation_config.json),
`config.yaml`, `metrics.json`, `MODEL_CARD.md`, `checkpoints/`, `MANIFEST.json`.
The manifest covers everything but `checkpoints/`, which has manifests of its own.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from alignflow.infra import manifest, storage
from alignflow.stages.common.models import is_lora, merged_state_dict
from alignflow.stages.common.strategy import Strategy


def save_hf_model(strategy: Strategy, tokenizer, folder: Path) -> None:
    """Gather full weights (ZeRO-3 included) and write an HF folder on rank 0. A LoRA model is written twice: merged
    into `folder` (a plain HF model, what downstream stages and serving load) and as its PEFT adapter beside it."""
    state = strategy.full_state_dict()
    if not strategy.is_main:
        return
    model = strategy.unwrap()
    for path in (folder, *([folder.parent / ADAPTER_DIR] if is_lora(model) else [])):
        if path.exists():
            shutil.rmtree(path)
    if is_lora(model):  # PEFT keeps the adapter's part of the gathered state; the merged model is the base's names
        model.save_pretrained(folder.parent / ADAPTER_DIR, state_dict=state, safe_serialization=True)
        model, state = model.get_base_model(), merged_state_dict(model, state)
    model.config.use_cache = True  # the published model is for inference
    model.save_pretrained(folder, state_dict=state, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    portable_tokenizer_config(folder)


ADAPTER_DIR = "adapter"
# A stage's files beside its model, by name; a Future is one still being made in a thread (the curves).
Files = dict[str, "str | bytes | Future[bytes]"]


# Keys transformers 5 writes that only it reads; the rest of a serving stack may run older versions.
LOADER_ONLY_KEYS = ("backend", "is_local", "local_files_only")


def portable_tokenizer_config(folder: Path) -> None:
    """Make the saved tokenizer load with the transformers (and vLLM) versions a serving team is likely to
    run: transformers 5 names a fast tokenizer's class `TokenizersBackend`, which 4.x does not know, and
    writes its extra special tokens under a new key. The tokens, template and ids stay the same."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = config.pop("extra_special_tokens", None)
    if isinstance(extra, list):
        config["additional_special_tokens"] = extra
    elif extra:
        config["extra_special_tokens"] = extra
    for key in LOADER_ONLY_KEYS:
        config.pop(key, None)
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def publish(
    strategy: Strategy,
    tokenizer,
    stage_uri: str,
    staging: Path,
    files: Files,
    meta: dict[str, Any],
) -> tuple[manifest.Manifest | None, Path]:
    """Write model/ plus the given files, upload when remote, and write MANIFEST.json last.

    Returns (the manifest on rank 0, None elsewhere) and the local folder holding a copy
    of every published file, the manifest included.
    """
    local = publish_dir(stage_uri, staging)
    if strategy.is_main:
        # A stale MANIFEST.json left here by an earlier publish must not be uploaded with the files.
        (local / manifest.STAGE_MANIFEST).unlink(missing_ok=True)
    local.mkdir(parents=True, exist_ok=True)
    save_hf_model(strategy, tokenizer, local / "model")
    result = finish_publish(stage_uri, local, files, meta) if strategy.is_main else None
    strategy.barrier()
    return result, local


def publish_dir(stage_uri: str, staging: Path) -> Path:
    """The local folder a stage's published files are written in: the stage folder itself when
    storage is local, else a staging copy that is uploaded."""
    return storage.local_path(stage_uri) if storage.is_local(stage_uri) else staging / "publish"


def finish_publish(stage_uri: str, local: Path, files: Files, meta: dict[str, Any]) -> manifest.Manifest:
    """Write `files` next to the model, upload the local folder when storage is remote, manifest last."""
    for name, content in files.items():
        content = content.result() if isinstance(content, Future) else content  # made in a thread (the curves)
        (local / name).write_bytes(content.encode() if isinstance(content, str) else content)
    if not storage.is_local(stage_uri):
        storage.upload_dir(local, stage_uri)
    result = manifest.write_manifest(stage_uri, exclude=(*manifest.NOT_PUBLISHED,), **meta)
    if not storage.is_local(stage_uri):
        (local / manifest.STAGE_MANIFEST).write_text(storage.read_text(storage.join(stage_uri, manifest.STAGE_MANIFEST)))
    return result


def training_line(lora, params: dict[str, int]) -> str | None:
    """The model card's line on what was trained: LoRA (rank, alpha, targets) or every weight, and how many."""
    if not params:
        return None
    trained, total = params["params/trainable"], params["params/total"]
    share = f"{trained:,} of {total:,} parameters trained ({100 * trained / max(total, 1):.2f}%)"
    if lora is None:
        return f"- training: full fine-tuning, {share}"
    targets = lora.target_modules if isinstance(lora.target_modules, str) else ", ".join(lora.target_modules)
    saved = f", modules saved in full: {', '.join(lora.modules_to_save)}" if lora.modules_to_save else ""
    return (f"- training: LoRA, rank {lora.rank}, alpha {lora.alpha:g}, dropout {lora.dropout:g}, targets {targets}{saved}; "
            f"{share}; `model/` has the adapter merged in, `{ADAPTER_DIR}/` is the PEFT adapter")


def model_card(stage: str, base_model: str, data: dict[str, str], config_hash: str, cache_key: str, metrics: dict[str, float],
               rows: dict[str, str] | None = None, training: str | None = None) -> str:
    """`rows`: what each data file gave (`train: 4000 rows read, 3990 used, 10 skipped (...)`); `training`: what was
    trained (`training_line`)."""
    lines = [
        f"# alignflow {stage} model",
        "",
        f"- base model: `{base_model}`",
        *([training] if training else []),
        f"- stage config hash: `{config_hash}`",
        f"- cache key: `{cache_key}`",
        "- data:",
        *[f"  - `{src}` (sha256 `{fp[:16]}…`)" for src, fp in data.items()],
        *[f"  - {part} rows: {line}" for part, line in (rows or {}).items()],
        "",
        "## Metrics",
        "",
        "| metric | value |",
        "|---|---|",
        *[f"| {k} | {v:.6g} |" for k, v in sorted(metrics.items())],
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        'model = AutoModelForCausalLM.from_pretrained("<this folder>/model")',
        'tokenizer = AutoTokenizer.from_pretrained("<this folder>/model")',
        "```",
    ]
    return "\n".join(lines) + "\n"


def metrics_json(history: list[dict[str, float]], summary: dict[str, float], extra: dict[str, Any]) -> str:
    return json.dumps({"summary": summary, "history": history, **extra}, indent=2)
