"""One Prefect task that runs any stage as a Ray job (no torch here).

Order of checks: the manifest store first (so a lost Prefect database loses no
work), Prefect's cache second (its key function is over the stage's cache key,
which hashes the config's JSON, the data content and the upstream digests, and
it only answers while the manifest it points at still exists). A failed job is
retried by Prefect unless it failed on bad input.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

from prefect import get_run_logger, task
from pydantic import BaseModel

from alignflow.config import PipelineConfig, Stage, dump_config
from alignflow.infra import manifest, ray_jobs, storage
from alignflow.infra.tracking import RUN_ID_ENV, Tracker
from alignflow.lineage import stage_cache_key, stage_output_uri

# Environment a stage job needs from the caller: credentials, endpoints, caches, test hooks.
PASSTHROUGH_PREFIXES = ("AWS_", "ALIGNFLOW_", "MLFLOW_S3_", "HF_")


class StageResult(BaseModel):
    stage: str
    uri: str
    cache_key: str
    digest: str
    cached: bool
    seconds: float
    job_seconds: float | None = None
    metrics: dict[str, float] = {}
    mlflow_run_id: str | None = None
    source_run_id: str | None = None
    ray_job_id: str | None = None


class RunContext(BaseModel):
    ray_address: str
    parent_run_id: str
    flow_run_id: str | None = None


def stage_key(config: PipelineConfig, stage: Stage, upstream: dict[str, StageResult]) -> str:
    return stage_cache_key(config, stage, {name: r.digest for name, r in upstream.items()})


def prefect_cache_key(context: Any, params: dict[str, Any]) -> str | None:
    """Prefect's cache answers only for a stage whose manifest is in storage now, and only with
    a result recorded for that very manifest: the key covers the stage URI (storage root included),
    the manifest's content digest and the MLflow run that produced it. Prefect keeps cached
    results on local disk across servers; without this, a result from another storage or
    another tracking server could answer."""
    config, stage = params["config"], Stage(params["stage"])
    uri = stage_output_uri(config, stage, stage_key(config, stage, params.get("upstream") or {}))
    published = manifest.verify(uri, check_hashes=False)  # sizes only: cheap, and catches a damaged folder
    if published is None:
        return None
    identity = f"{uri}|{published.digest}|{published.meta.get('mlflow_run_id')}"
    return f"alignflow-{stage.value}-{hashlib.sha256(identity.encode()).hexdigest()[:32]}"


def retry_unless_bad_input(task, task_run, state) -> bool:
    try:
        state.result()
    except ray_jobs.StageJobError as exc:
        return exc.retryable
    except Exception:
        return True
    return False


def _task_run_name() -> str:
    from prefect.runtime import task_run

    return Stage(task_run.parameters["stage"]).value


@task(name="stage", task_run_name=_task_run_name, cache_key_fn=prefect_cache_key, persist_result=True,
      retry_condition_fn=retry_unless_bad_input)
def run_stage(config: PipelineConfig, stage: Stage, upstream: dict[str, StageResult], ctx: RunContext) -> StageResult:
    log = get_run_logger()
    start = time.time()
    key = stage_key(config, stage, upstream)
    uri = stage_output_uri(config, stage, key)
    tracker = Tracker(config)
    done = manifest.verify(uri)
    if done is not None:
        log.info("%s: cache hit at %s (no Ray job)", stage.value, uri)
        run_id = tracker.record_cache_hit(ctx.parent_run_id, stage.value, key, ctx.flow_run_id, {**done.meta, "uri": uri})
        return result_from_manifest(stage, uri, key, done, time.time() - start, cached=True, run_id=run_id)

    run_id = tracker.start_child(ctx.parent_run_id, stage.value, key, ctx.flow_run_id)
    try:
        outcome, published = _run_job(config, stage, uri, upstream, run_id, tracker, ctx)
    except BaseException:
        tracker.finish(run_id, ok=False)  # no child run is left RUNNING, whatever failed
        raise
    tracker.finish(run_id, ok=True)
    result = result_from_manifest(stage, uri, key, published, time.time() - start, cached=False, run_id=run_id)
    return result.model_copy(update={"job_seconds": outcome.seconds, "ray_job_id": outcome.job_id})


def _run_job(config: PipelineConfig, stage: Stage, uri: str, upstream: dict[str, StageResult], run_id: str,
             tracker: Tracker, ctx: RunContext) -> tuple[ray_jobs.JobOutcome, manifest.Manifest]:
    log = get_run_logger()
    config_uri = storage.join(uri, "job", "config.yaml")
    storage.write_text(config_uri, dump_config(config))
    env = {k: v for k, v in os.environ.items() if k.startswith(PASSTHROUGH_PREFIXES)}
    env.update({"MLFLOW_TRACKING_URI": tracker.uri, RUN_ID_ENV: run_id})
    entry = ray_jobs.stage_entrypoint(stage.module, config_uri, uri, {name: r.uri for name, r in upstream.items()})
    log.info("%s: submitting Ray job to %s: %s", stage.value, ctx.ray_address, entry)
    outcome = ray_jobs.run_job(
        ctx.ray_address, entry, env, stage.value, config.ray.job_timeout_s, on_log=lambda line: log.info("%s", line),
        on_submit=lambda job_id: tracker.set_tag(run_id, "ray.job_id", job_id),
    )
    published = manifest.verify(uri)
    if published is None:
        raise RuntimeError(f"{stage.value}: job {outcome.job_id} succeeded but {uri} has no verified manifest")
    return outcome, published


def result_from_manifest(stage: Stage, uri: str, key: str, published: manifest.Manifest, seconds: float,
                         cached: bool, run_id: str | None) -> StageResult:
    metrics = {k: float(v) for k, v in (published.meta.get("metrics") or {}).items()}
    return StageResult(stage=stage.value, uri=uri, cache_key=key, digest=published.digest, cached=cached,
                       seconds=seconds, metrics=metrics, mlflow_run_id=run_id,
                       source_run_id=published.meta.get("mlflow_run_id"))
