"""Handing a published model to a serving team: copy `model/`, verified against the manifest."""

from __future__ import annotations

import os

from alignflow.infra import manifest, storage
from alignflow.infra.tracking import STAGE_URI_TAG


class ExportError(RuntimeError):
    pass


def resolve_source(source: str) -> str:
    """A stage folder URI from a stage URI, a `…/model` URI, or an MLflow registry reference."""
    if source.startswith("models:/"):
        from mlflow import MlflowClient

        ref = source.removeprefix("models:/")
        client = MlflowClient(os.environ.get("MLFLOW_TRACKING_URI"))
        if "@" in ref:
            name, alias = ref.split("@", 1)
            version = client.get_model_version_by_alias(name, alias)
        else:
            name, number = ref.rsplit("/", 1)
            version = client.get_model_version(name, number)
        source = version.tags.get(STAGE_URI_TAG) or version.source
    source = source.rstrip("/")
    return source[: -len("/model")] if source.endswith("/model") else source


def export_model(source: str, dest: str) -> list[str]:
    stage = resolve_source(source)
    published = manifest.verify(stage)
    if published is None:
        raise ExportError(f"{stage} has no verified MANIFEST.json: not a complete published stage")
    files = sorted(f for f in published.files if f.startswith("model/"))
    if not files:
        raise ExportError(f"{stage} publishes no model/ folder")
    for rel in files:
        target = storage.join(dest, rel.removeprefix("model/"))
        storage.copy_file(storage.join(stage, rel), target)
        if storage.sha256_of(target) != published.files[rel]["sha256"]:
            raise ExportError(f"{target}: sha256 differs from the manifest after copying")
    return files
