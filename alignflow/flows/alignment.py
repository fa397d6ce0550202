"""The Prefect flow `alignment`: the config's pipeline, stage after stage, each a Ray job.

Each stage's inputs are published outputs of earlier stages (`Pipeline.inputs`: RM,
DPO and KTO start from SFT; RL in `full` also scores with RM). The flow
opens the MLflow parent run, runs the stages through the stage task (cache
hits cost no Ray job), registers the final model with alias `candidate`, and
returns a summary. Killing the flow's process stops the stage job it waits on.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import State

from alignflow.config import PipelineConfig, Stage
from alignflow.infra import ray_jobs, storage
from alignflow.infra.tracking import Tracker
from alignflow.tasks.stage import RunContext, StageResult, run_stage

RAY_ADDRESS_ENV = "ALIGNFLOW_RAY_ADDRESS"


def ray_address(config: PipelineConfig) -> str:
    address = config.ray.address or os.environ.get(RAY_ADDRESS_ENV)
    if not address:
        raise RuntimeError(
            "no Ray cluster to run stages on: set `ray.address` (the dashboard URL, http://host:8265) or "
            f"{RAY_ADDRESS_ENV}, or start one with `alignflow run` / `alignflow services up`"
        )
    return address


def _stop_jobs_on_sigterm() -> None:
    """A killed flow process (SIGTERM: cancellation, a worker shutting down) stops its Ray job first."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum, frame):
        ray_jobs.stop_active()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


@flow(name="alignment", log_prints=True)
def alignment(config: PipelineConfig) -> dict[str, Any]:
    log = get_run_logger()
    _stop_jobs_on_sigterm()
    started = time.time()
    address = ray_address(config)  # fails before any MLflow run is opened
    tracker = Tracker(config)
    flow_run_id = _flow_run_id()
    parent = tracker.start_parent(flow_run_id)
    ctx = RunContext(ray_address=address, parent_run_id=parent, flow_run_id=flow_run_id)
    results: list[StageResult] = []
    try:
        for stage in config.stages:
            done = {r.stage: r for r in results}
            upstream = {up.value: done[up.value] for up in config.pipeline.inputs(stage)}
            task = run_stage.with_options(retries=config.ray.retries, retry_delay_seconds=config.ray.retry_delay_s)
            state = task(config, stage, upstream, ctx, return_state=True)
            results.append(_stage_result(state, tracker, ctx, stage))
            log.info("%s: %s in %.1fs -> %s", stage.value, "cache hit" if results[-1].cached else "done",
                     results[-1].seconds, results[-1].uri)
        registered = _register(config, tracker, parent, results)
        tracker.finish(parent, ok=True)
    except BaseException:
        tracker.finish(parent, ok=False)
        raise
    return summary(config, tracker, parent, results, registered, time.time() - started)


def _flow_run_id() -> str | None:
    from prefect.runtime import flow_run

    return str(flow_run.id) if flow_run.id else None


def _stage_result(state: State, tracker: Tracker, ctx: RunContext, stage: Stage) -> StageResult:
    result: StageResult = state.result()  # raises the task's exception on failure
    if state.name == "Cached":  # Prefect's cache answered: the task body (and its MLflow record) did not run
        meta = {"mlflow_run_id": result.source_run_id, "metrics": result.metrics, "uri": result.uri}
        run_id = tracker.record_cache_hit(ctx.parent_run_id, stage.value, result.cache_key, ctx.flow_run_id, meta)
        result = result.model_copy(update={"cached": True, "seconds": 0.0, "mlflow_run_id": run_id, "ray_job_id": None})
    return result


def _register(config: PipelineConfig, tracker: Tracker, parent: str, results: list[StageResult]) -> dict[str, str] | None:
    if not config.tracking.register_model or not results:
        return None
    if config.stages != config.pipeline.stages:
        get_run_logger().info("stop_after=%s: the pipeline stopped early; its last model is not registered as a candidate",
                              config.stop_after.value)
        return None
    final = results[-1]
    card = storage.read_text(storage.join(final.uri, "MODEL_CARD.md"))
    lineage = " -> ".join(f"{r.stage}:{r.cache_key}" for r in results)
    tags = {"alignflow.cache_key": final.cache_key, "alignflow.stage": final.stage, "alignflow.lineage": lineage,
            "alignflow.manifest_digest": final.digest}
    version = tracker.register(storage.join(final.uri, "model"), parent, tags, card)
    return {"name": config.name, "version": version, "alias": "candidate", "source": storage.join(final.uri, "model")}


def summary(config: PipelineConfig, tracker: Tracker, parent: str, results: list[StageResult],
            registered: dict[str, str] | None, seconds: float) -> dict[str, Any]:
    return {
        "pipeline": config.pipeline.value,
        "name": config.name,
        "seconds": seconds,
        "mlflow": {"tracking_uri": tracker.uri, "parent_run_id": parent, "parent_run": tracker.run_url(parent)},
        "registered_model": registered,
        "stages": [r.model_dump() | {"mlflow_run": tracker.run_url(r.mlflow_run_id) if r.mlflow_run_id else None}
                   for r in results],
    }
