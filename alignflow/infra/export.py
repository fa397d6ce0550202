"""Handing a published model to a serving team: `model/` verified against the manifest, with the
model card, a manifest of what was exported and the base model's licence."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from alignflow.infra import manifest, storage
from alignflow.infra.tracking import STAGE_URI_TAG

LICENCE_FILES = ("LICENSE", "LICENSE.txt", "LICENSE.md", "LICENCE", "COPYING")


class ExportError(RuntimeError):
    pass


def resolve_source(source: str, tracking_uri: str | None = None) -> str:
    """A stage folder URI from a stage URI, a `…/model` URI, or an MLflow registry reference
    (`models:/NAME@ALIAS`, `models:/NAME/VERSION`) in the given tracking store."""
    if source.startswith("models:/"):
        source = _registered_source(source, tracking_uri)
    source = source.rstrip("/")
    return source[: -len("/model")] if source.endswith("/model") else source


def _registered_source(ref: str, tracking_uri: str | None) -> str:
    if not tracking_uri:
        raise ExportError(f"{ref}: no MLflow tracking store to look it up in (give --config, --tracking-uri or MLFLOW_TRACKING_URI)")
    if tracking_uri.startswith("sqlite:///") and not Path(tracking_uri.removeprefix("sqlite:///")).is_file():
        raise ExportError(f"{ref}: there is no MLflow store at {tracking_uri} (no run has registered a model there)")
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    name, sep, alias = ref.removeprefix("models:/").partition("@")
    client = MlflowClient(tracking_uri)
    try:
        version = client.get_model_version_by_alias(name, alias) if sep else client.get_model_version(*name.rsplit("/", 1))
    except (MlflowException, TypeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(f"{ref}: not in the model registry at {tracking_uri} ({first})") from None
    return version.tags.get(STAGE_URI_TAG) or version.source


def export_model(source: str, dest: str, tracking_uri: str | None = None) -> list[str]:
    """Copy the model's files to `dest` (each checked against its sha256 after the copy), with
    MODEL_CARD.md, the base model's licence when there is one, and MANIFEST.json listing them all.
    Returns the exported files, relative to `dest`."""
    stage = resolve_source(source, tracking_uri)
    published = manifest.verify(stage)
    if published is None:
        raise ExportError(f"{stage} has no verified MANIFEST.json: not a complete published stage")
    copies = {rel.removeprefix("model/"): rel for rel in published.files if rel.startswith("model/")}
    if not copies:  # a dataset stage (generate, label, select): its Parquet parts, as `datasets` loads them
        copies = {rel: rel for rel in published.files if rel.startswith("data/")}
    if not copies:
        raise ExportError(f"{stage} publishes no model/ folder and no data/ folder")
    for card in ("MODEL_CARD.md", "DATASET_CARD.md"):
        if card in published.files:
            copies[card] = card
    files = {}
    for target_rel, rel in sorted(copies.items()):
        target = storage.join(dest, target_rel)
        storage.copy_file(storage.join(stage, rel), target)
        if storage.sha256_of(target) != published.files[rel]["sha256"]:
            raise ExportError(f"{target}: sha256 differs from the manifest after copying")
        files[target_rel] = published.files[rel]
    files.update(_copy_licence(stage, dest, set(files)))
    meta = {"source": stage, "registered_as": source if source.startswith("models:/") else None,
            **{k: published.meta.get(k) for k in ("stage", "cache_key", "config_hash", "alignflow_version")}}
    storage.write_text(storage.join(dest, manifest.STAGE_MANIFEST), json.dumps({"files": files, **meta}, indent=2, sort_keys=True))
    return sorted(files)


def base_model(stage_uri: str) -> str | None:
    """The base model a stage's lineage started from (its own `model.name_or_path`, else its `from` stage's)."""
    for _ in range(64):  # a lineage is a chain of published stages
        found = manifest.read_manifest(stage_uri)
        config_uri = storage.join(stage_uri, "config.yaml")
        if found is None or not storage.exists(config_uri):
            return None
        section = (yaml.safe_load(storage.read_text(config_uri)) or {}).get(found.meta.get("stage"), {})
        name = (section.get("model") or {}).get("name_or_path")
        upstream = (found.meta.get("inputs") or {}).get("upstream:from") or {}
        if name or not upstream.get("uri"):
            return name
        stage_uri = upstream["uri"]
    return None


def _copy_licence(stage: str, dest: str, taken: set[str]) -> dict[str, dict]:
    """The base model's licence file(s): from a local model folder or the Hugging Face cache."""
    name = base_model(stage)
    if not name or name.startswith("builtin:"):
        return {}
    out = {}
    for file in LICENCE_FILES:
        path = Path(name) / file if Path(name).is_dir() else _hub_cached(name, file)
        if path is None or not path.is_file() or file in taken:
            continue
        target = storage.join(dest, file)
        storage.copy_file(str(path), target)
        out[file] = {"size": path.stat().st_size, "sha256": storage.sha256_of(str(path))}
    return out


def _hub_cached(repo: str, file: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo, file)
    except Exception:  # noqa: BLE001 - not a repo name, or no cache: no licence to copy
        return None
    return Path(found) if isinstance(found, str) else None
