"""MLflow run tree and Model Registry, from the orchestration side (no torch).

One parent run per pipeline run; one child run per stage, created here and
continued inside the Ray job (its id travels in ALIGNFLOW_MLFLOW_RUN_ID). A cache
hit gets a child run too, tagged with the run that produced the artifact.
Only config values are logged as params: credentials live in the environment
and never pass through here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from alignflow.config import PipelineConfig, Stage
from alignflow.infra import storage

RUN_ID_ENV = "ALIGNFLOW_MLFLOW_RUN_ID"
PARAM_LIMIT = 6000


def tracking_uri(cfg: PipelineConfig) -> str:
    """Config, then MLFLOW_TRACKING_URI, then a sqlite store beside local storage (or in ~/.alignflow)."""
    if cfg.tracking.uri:
        return cfg.tracking.uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    folder = storage.local_path(cfg.storage.root) if storage.is_local(cfg.storage.root) else Path.home() / ".alignflow"
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder.resolve()}/mlflow.db"


def flatten(data: Any, prefix: str = "") -> dict[str, str]:
    if isinstance(data, dict):
        out: dict[str, str] = {}
        for k, v in data.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): str(data)[:PARAM_LIMIT]}


class Tracker:
    def __init__(self, cfg: PipelineConfig):
        from mlflow import MlflowClient

        self.cfg = cfg
        self.uri = tracking_uri(cfg)
        self.client = MlflowClient(self.uri)
        self.experiment_id = self._experiment(cfg.tracking.experiment)

    def _experiment(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        artifacts = None
        if self.uri.startswith("sqlite:") and storage.is_local(self.cfg.storage.root):
            artifacts = (storage.local_path(self.cfg.storage.root) / "mlflow-artifacts").resolve().as_uri()
        return self.client.create_experiment(name, artifact_location=artifacts)

    def run_url(self, run_id: str) -> str:
        if self.uri.startswith("http"):
            return f"{self.uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{run_id}"
        return f"{self.uri} (experiment {self.experiment_id}, run {run_id}); view with `mlflow ui --backend-store-uri {self.uri}`"

    def start_parent(self, flow_run_id: str | None) -> str:
        tags = {"alignflow.pipeline": self.cfg.pipeline.value, "alignflow.name": self.cfg.name,
                "alignflow.config_hash": self.cfg.config_hash(), "prefect.flow_run_id": str(flow_run_id)}
        run = self.client.create_run(self.experiment_id, run_name=f"{self.cfg.name}-{self.cfg.pipeline.value}", tags=tags)
        self.log_params(run.info.run_id, self.cfg.model_dump(mode="json"))
        return run.info.run_id

    def start_child(self, parent_id: str, stage: str, cache_key: str, flow_run_id: str | None, extra: dict[str, str] | None = None) -> str:
        tags = {"mlflow.parentRunId": parent_id, "alignflow.stage": stage, "alignflow.cache_key": cache_key,
                "prefect.flow_run_id": str(flow_run_id), **(extra or {})}
        run = self.client.create_run(self.experiment_id, run_name=stage, tags=tags)
        self.log_params(run.info.run_id, {stage: self.cfg.stage(Stage(stage)).model_dump(mode="json")})
        return run.info.run_id

    def log_params(self, run_id: str, data: dict) -> None:
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in sorted(flatten(data).items())]
        for i in range(0, len(params), 100):
            self.client.log_batch(run_id, params=params[i:i + 100])

    def record_cache_hit(self, parent_id: str, stage: str, cache_key: str, flow_run_id: str | None, meta: dict) -> str:
        """A child run that says where the artifact came from, instead of an empty run."""
        from mlflow.entities import Metric
        import time

        source = meta.get("mlflow_run_id") or ""
        run_id = self.start_child(parent_id, stage, cache_key, flow_run_id,
                                  {"alignflow.cache_hit": "true", "alignflow.source_run_id": source,
                                   "alignflow.artifact_uri": meta.get("uri", "")})
        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, 0) for k, v in (meta.get("metrics") or {}).items()]
        if metrics:
            self.client.log_batch(run_id, metrics=metrics)
        self.client.set_terminated(run_id, "FINISHED")
        return run_id

    def set_tag(self, run_id: str, key: str, value: str) -> None:
        self.client.set_tag(run_id, key, value)

    def finish(self, run_id: str, ok: bool) -> None:
        self.client.set_terminated(run_id, "FINISHED" if ok else "FAILED")

    def register(self, source: str, run_id: str, tags: dict[str, str], description: str) -> str:
        """A new version of the pipeline's registered model, aliased `candidate`."""
        from mlflow.exceptions import MlflowException

        name = self.cfg.name
        try:
            self.client.create_registered_model(name, description=f"alignflow pipeline {name!r}")
        except MlflowException as exc:
            if "RESOURCE_ALREADY_EXISTS" not in str(exc.error_code):
                raise
        version = self.client.create_model_version(name, source=source, run_id=run_id, tags=tags, description=description)
        self.client.set_registered_model_alias(name, "candidate", version.version)
        return version.version
