"""One Prefect task that runs any stage of the graph as a Ray job (no torch here).

Order of checks: the manifest store first (so a lost Prefect database loses no work), Prefect's cache
second (its key function is over the stage's cache key, which hashes the stage's kind and result fields,
its data content and its inputs' digests, and it only answers while the manifest it points at still
exists, and every file of it still matches its sha256). Before a job, the task takes the stage's lease
(`infra/lease.py`): one run writes a stage at a time, and the job stops itself when the lease goes
unrenewed. The key the flow computed travels to the job, which refuses to run under another; credentials
travel apart from it (`infra/secrets.py`). A failed job is retried by Prefect unless it failed on bad input.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from typing import Any

from prefect import get_run_logger, task

from alignflow.config import PipelineConfig, dump_config
from alignflow.infra import lease, manifest, ray_jobs, secrets, services, storage
from alignflow.infra.tracking import RUN_ID_ENV, Tracker
from alignflow.lineage import stage_output_uri
from alignflow.tasks.results import (RunContext, StageResult, cache_hit, child_tags, result_from_manifest, stage_params,
                                     tracking_settings)

# Environment a stage job needs from the caller: credentials (sent apart, see infra/secrets.py), endpoints,
# caches, test hooks.
PASSTHROUGH_PREFIXES = ("AWS_", "ALIGNFLOW_", "MLFLOW_S3_", "MLFLOW_TRACKING_", "HF_")


def prefect_cache_key(context: Any, params: dict[str, Any]) -> str | None:
    """Prefect's cache answers only for a stage whose manifest is in storage now, and only with
    a result recorded for that very manifest: the key covers the stage URI (storage root included),
    the manifest's content digest and the MLflow run that produced it. Prefect keeps cached
    results on local disk across servers; without this, a result from another storage or
    another tracking server could answer."""
    config, stage, key = params["config"], params["stage"], params["key"]
    uri = stage_output_uri(config, stage, key)
    published = manifest.verify(uri)  # every file's sha256 (cheap when unchanged since it last verified)
    if published is None:
        return None
    identity = f"{uri}|{published.digest}|{published.meta.get('mlflow_run_id')}|{stage}"
    return f"alignflow-{config.kind(stage).value}-{hashlib.sha256(identity.encode()).hexdigest()[:32]}"


def retry_unless_bad_input(task, task_run, state) -> bool:
    try:
        state.result()
    except ray_jobs.StageJobError as exc:
        return exc.retryable
    except lease.LeaseHeld:  # asked to fail at once rather than wait for the other run
        return False
    except Exception:
        return True
    return False


def _task_run_name() -> str:
    from prefect.runtime import task_run

    return str(task_run.parameters["stage"])


@task(name="stage", task_run_name=_task_run_name, cache_key_fn=prefect_cache_key, persist_result=True,
      retry_condition_fn=retry_unless_bad_input)
def run_stage(config: PipelineConfig, stage: str, key: str, upstream: dict[str, StageResult], ctx: RunContext) -> StageResult:
    tracker = Tracker(tracking_settings(config))
    result = _run_or_reuse(config, stage, key, upstream, ctx, tracker)
    _stage_artifact(result, tracker)
    return result


def _stage_artifact(result: StageResult, tracker: Tracker) -> None:
    """A markdown artifact on the task run: the stage's figures, where it published, its MLflow run."""
    from prefect.artifacts import create_markdown_artifact

    whole = result.kind in ("eval", "generate", "label", "select")  # their figures are few and all worth showing
    shown = {k: v for k, v in sorted(result.metrics.items()) if k.startswith(("eval/", "data/")) or whole}
    done = "cache hit" if result.cached else ("made" if result.kind in ("generate", "label", "select") else "trained")
    lines = [f"### {result.stage} ({result.kind}): {done} in {result.seconds:.1f} s", "",
             f"- published: `{result.uri}`",
             f"- MLflow run: {tracker.run_url(result.mlflow_run_id) if result.mlflow_run_id else 'none'}", "",
             "| metric | value |", "|---|---|", *[f"| {k} | {v:.4g} |" for k, v in shown.items()]]
    try:
        create_markdown_artifact(markdown="\n".join(lines), key=re.sub(r"[^a-z0-9-]+", "-", f"stage-{result.stage}".lower()),
                                 description=f"alignflow stage {result.stage}")
    except Exception as exc:  # noqa: BLE001 - an artifact is not worth failing a stage for
        get_run_logger().warning("%s: could not create the Prefect artifact: %s", result.stage, exc)


def _run_or_reuse(config: PipelineConfig, stage: str, key: str, upstream: dict[str, StageResult], ctx: RunContext,
                  tracker: Tracker) -> StageResult:
    log = get_run_logger()
    start = time.time()
    uri = stage_output_uri(config, stage, key)
    done, problem = manifest.check(uri)
    if problem:
        log.warning("%s: the published result does not verify: %s; running the stage again (it resumes from its last "
                    "checkpoint)", stage, problem)
    if done is not None:
        log.info("%s: cache hit at %s (no Ray job)", stage, uri)
        return cache_hit(config, stage, key, uri, done, tracker, ctx.parent_run_id, ctx.flow_run_id, start)
    held = lease.acquire(uri, config.ray.lease_timeout_s, config.ray.wait_for_running_stage,
                         on_wait=lambda holder: log.info("%s: another run is writing %s (%s); waiting for it", stage, uri, holder))
    try:
        done = manifest.verify(uri)
        if done is not None:
            log.info("%s: published by the run it waited for, at %s (no Ray job)", stage, uri)
            return cache_hit(config, stage, key, uri, done, tracker, ctx.parent_run_id, ctx.flow_run_id, start)
        run_id = tracker.start_child(ctx.parent_run_id, stage, key, ctx.flow_run_id, stage_params(config, stage), child_tags(config, stage))
        try:
            outcome, published = _run_job(config, stage, key, uri, upstream, run_id, tracker, ctx, held)
        except BaseException:
            tracker.finish(run_id, ok=False)  # no child run is left RUNNING, whatever failed
            raise
        tracker.finish(run_id, ok=True)
    finally:
        held.release()
    result = result_from_manifest(config, stage, uri, key, published, time.time() - start, cached=False, run_id=run_id)
    return result.model_copy(update={"job_seconds": outcome.seconds, "ray_job_id": outcome.job_id,
                                     "job_started_at": outcome.started_at, "job_ended_at": outcome.ended_at})


def _run_job(config: PipelineConfig, stage: str, key: str, uri: str, upstream: dict[str, StageResult], run_id: str,
             tracker: Tracker, ctx: RunContext, held: lease.Lease) -> tuple[ray_jobs.JobOutcome, manifest.Manifest]:
    log = get_run_logger()
    config_uri = storage.join(uri, "job", "config.yaml")
    storage.write_text(config_uri, dump_config(config))
    env = {k: v for k, v in os.environ.items() if k.startswith(PASSTHROUGH_PREFIXES)}
    env.update({"MLFLOW_TRACKING_URI": tracker.uri, RUN_ID_ENV: run_id, lease.LEASE_ENV: held.env()})
    if ctx.threads and not config.kind(stage).own_workers:
        env["ALIGNFLOW_NUM_THREADS"] = str(ctx.threads)
    entry = ray_jobs.stage_entrypoint(stage=stage, config_uri=config_uri, output_uri=uri, cache_key=key,
                                      inputs={role: r.uri for role, r in upstream.items()})
    address = services.ray_address(ctx.ray_address)  # a private head of `alignflow run` starts with its first job
    log.info("%s: submitting Ray job to %s: %s", stage, address, entry)
    with secrets.job_env(env, local=ray_jobs.is_local_address(address)) as job_env, held.renewing():
        try:
            outcome = ray_jobs.run_job(
                address, entry, job_env, stage, config.ray.job_timeout_s, on_log=lambda line: log.info("%s: %s", stage, line),
                on_submit=lambda job_id: tracker.set_tag(run_id, "ray.job_id", job_id),
            )
        except ray_jobs.StageJobError as exc:
            raise _with_saved_log(exc, storage.join(uri, "job", f"{exc.job_id}.log")) from None
    published = manifest.verify(uri)
    if published is None:
        raise RuntimeError(f"{stage}: job {outcome.job_id} succeeded but {uri} has no verified manifest")
    return outcome, published


def _with_saved_log(exc: ray_jobs.StageJobError, log_uri: str) -> ray_jobs.StageJobError:
    """The failure, pointing at its whole log, kept beside the stage's output (a private Ray head, and its
    logs, are gone when the run ends)."""
    try:
        storage.write_text(log_uri, exc.log)
    except Exception as write_error:  # the failure matters more than its log
        return ray_jobs.StageJobError(f"{exc}\n(the full log could not be saved to {log_uri}: {write_error})", exc.retryable, exc.job_id)
    return ray_jobs.StageJobError(f"{exc}\nfull log: {log_uri}", exc.retryable, exc.job_id)
