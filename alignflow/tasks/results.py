"""What a stage task returns and the pieces of it that need no Prefect (the fully cached run uses them too)."""

from __future__ import annotations

import time

from pydantic import BaseModel

from alignflow.config import PipelineConfig
from alignflow.infra import manifest
from alignflow.infra.tracking import Tracker, TrackingSettings
from alignflow.lineage import stage_cache_key


class StageResult(BaseModel):
    stage: str
    kind: str
    uri: str
    cache_key: str
    digest: str
    cached: bool
    seconds: float
    inputs: dict[str, str] = {}  # input role -> upstream stage name
    job_seconds: float | None = None
    job_started_at: float | None = None
    job_ended_at: float | None = None
    metrics: dict[str, float] = {}
    mlflow_run_id: str | None = None
    source_run_id: str | None = None
    ray_job_id: str | None = None


class RunContext(BaseModel):
    ray_address: str
    parent_run_id: str
    flow_run_id: str | None = None
    threads: int | None = None  # torch threads of a job that trains in its own process (shared-out local CPUs)


def tracking_settings(config: PipelineConfig) -> TrackingSettings:
    return TrackingSettings(uri=config.tracking.uri, experiment=config.tracking.experiment, storage_root=config.storage.root,
                            artifact_location=config.tracking.artifact_location)


def stage_key(config: PipelineConfig, stage: str, upstream: dict[str, StageResult]) -> str:
    return stage_cache_key(config, stage, {role: r.digest for role, r in upstream.items()})


def child_tags(config: PipelineConfig, stage: str) -> dict[str, str]:
    inputs = config.inputs_of(stage)
    return {"alignflow.kind": config.kind(stage).value, "alignflow.inputs": ", ".join(f"{r}={s}" for r, s in inputs.items())}


def stage_params(config: PipelineConfig, stage: str) -> dict:
    return {stage: config.section(stage).model_dump(mode="json", by_alias=True)}


def result_from_manifest(config: PipelineConfig, stage: str, uri: str, key: str, published: manifest.Manifest,
                         seconds: float, cached: bool, run_id: str | None) -> StageResult:
    metrics = {k: float(v) for k, v in (published.meta.get("metrics") or {}).items()}
    return StageResult(stage=stage, kind=config.kind(stage).value, uri=uri, cache_key=key, digest=published.digest,
                       cached=cached, seconds=seconds, inputs=config.inputs_of(stage), metrics=metrics,
                       mlflow_run_id=run_id, source_run_id=published.meta.get("mlflow_run_id"))


def cache_hit(config: PipelineConfig, stage: str, key: str, uri: str, done: manifest.Manifest, tracker: Tracker,
              parent_run_id: str, flow_run_id: str | None, start: float) -> StageResult:
    """The stage's published result, recorded as an MLflow child run that names the run which made it."""
    run_id = tracker.record_cache_hit(parent_run_id, stage, key, flow_run_id, {**done.meta, "uri": uri},
                                      stage_params(config, stage), child_tags(config, stage))
    return result_from_manifest(config, stage, uri, key, done, time.time() - start, cached=True, run_id=run_id)
