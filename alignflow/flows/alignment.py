"""The Prefect flow `alignment`: the config's stage graph, each stage a cached task running a Ray job.

Stages run in dependency order; stages whose inputs are published run at the same time (at most
`ray.max_parallel_stages` jobs; on a local head the CPUs are shared out between the jobs that train in
their own process). When a stage fails, its siblings already running finish and publish, the stages
that need it are skipped, and the flow fails naming every failed stage. Two stages with the same cache
key run once. The flow opens the MLflow parent run, registers the configured stage's model (alias
`candidate` only when it passes its gate) and returns a summary. Killing the flow's process with
SIGTERM stops the stage jobs it waits on.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import Completed, Failed

from alignflow.config import ConfigError, PipelineConfig, load_config
from alignflow.flows.run_record import check_storage, close_parent, flow_run_name, open_parent, plan, published_inputs
from alignflow.infra import ray_jobs
from alignflow.infra.tracking import Tracker
from alignflow.tasks.results import RunContext, StageResult, stage_key, tracking_settings
from alignflow.tasks.stage import run_stage

RAY_ADDRESS_ENV = "ALIGNFLOW_RAY_ADDRESS"
POLL_S = 0.2


def ray_address(config: PipelineConfig) -> str:
    address = config.ray.address or os.environ.get(RAY_ADDRESS_ENV)
    if not address:
        raise RuntimeError(
            "no Ray cluster to run stages on: set `ray.address` (the dashboard URL, http://host:8265) or "
            f"{RAY_ADDRESS_ENV}, or start one with `alignflow run` / `alignflow services up`"
        )
    return address


def _stop_jobs_on_sigterm() -> None:
    """A killed flow process (SIGTERM: cancellation, a worker shutting down) stops its Ray jobs first."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum, frame):
        ray_jobs.stop_active()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def local_cpus(config: PipelineConfig, address: str) -> int | None:
    """CPUs of a head on this machine (shared out between concurrent jobs); None for a remote cluster."""
    return (config.ray.num_cpus or os.cpu_count() or 1) if ray_jobs.is_local_address(address) else None


class Scheduler:
    """Submits each stage once its inputs are published; at most `cap` in flight; failures stop only their
    descendants."""

    def __init__(self, config: PipelineConfig, stages: list[str], done: dict[str, StageResult], ctx: RunContext, cpus: int | None):
        self.config, self.pending, self.ctx, self.cpus = config, list(stages), ctx, cpus
        self.results, self.failed, self.skipped = dict(done), {}, []
        self.running: dict[str, Any] = {}  # name -> Prefect future
        self.by_key: dict[str, str] = {}  # cache key -> the stage that runs it
        self.twins: dict[str, str] = {}  # a stage whose key another stage already runs -> that stage
        self.keys: dict[str, str] = {}  # computed once per stage: a key hashes the stage's data
        self.task = run_stage.with_options(retries=config.ray.retries, retry_delay_seconds=config.ray.retry_delay_s)

    def run(self) -> None:
        while self.pending or self.running:
            self._submit_ready()
            self._collect()
            if self.running:
                time.sleep(POLL_S)

    def _ready(self) -> list[str]:
        ready = []
        for name in list(self.pending):
            ups = set(self.config.inputs_of(name).values())
            if ups & (set(self.failed) | set(self.skipped)):
                self.pending.remove(name)
                self.skipped.append(name)
                get_run_logger().warning("%s: skipped: an input failed", name)
            elif ups <= set(self.results):
                ready.append(name)
        return ready

    def _submit_ready(self) -> None:
        ready = self._ready()
        in_process = [n for n in [*ready, *self.running] if not self.config.kind(n).own_workers]
        threads = max(1, self.cpus // max(1, min(len(in_process), self.config.ray.max_parallel_stages))) if self.cpus else None
        for name in ready:
            upstream = {role: self.results[up] for role, up in self.config.inputs_of(name).items()}
            if name not in self.keys:
                self.keys[name] = stage_key(self.config, name, upstream)
            key = self.keys[name]
            if key in self.by_key:  # the same result under another name: run once
                self.twins[name] = self.by_key[key]
                self.pending.remove(name)
                continue
            if len(self.running) >= self.config.ray.max_parallel_stages:
                break
            self.by_key[key] = name
            ctx = self.ctx.model_copy(update={"threads": threads})
            self.running[name] = self.task.submit(config=self.config, stage=name, key=key, upstream=upstream, ctx=ctx)
            self.pending.remove(name)

    def _collect(self) -> None:
        for name, future in list(self.running.items()):
            future.wait(timeout=0)  # records the final state (with its result in memory) once the task is done
            if not future.state.is_final():
                continue
            del self.running[name]
            try:
                self.results[name] = future.result()
            except BaseException as exc:  # noqa: BLE001 (recorded; the flow fails after the siblings finish)
                self.failed[name] = exc
                get_run_logger().error("%s: failed: %s", name, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        for twin, source in list(self.twins.items()):
            if source in self.results:
                self.results[twin] = self.results[source].model_copy(update={"stage": twin, "cached": True, "seconds": 0.0,
                                                                             "inputs": self.config.inputs_of(twin)})
                del self.twins[twin]
            elif source in self.failed:
                self.failed[twin] = self.failed[source]
                del self.twins[twin]


@flow(name="alignment", log_prints=True)
def alignment(config: str = "configs/tiny.yaml", overrides: list[str] | None = None, until: str | None = None,
              only: str | None = None) -> Any:
    """Run a pipeline config's stage graph. `config`: a config file (path or storage URI); `overrides`:
    KEY=VALUE items such as `dpo.optim.lr=5e-4`; `until`: run this stage and what it needs; `only`: run one
    stage whose inputs are published."""
    log = get_run_logger()
    _stop_jobs_on_sigterm()
    started = time.time()
    cfg = load_config(config, overrides or [])
    stages = plan(cfg, until, only)
    check_storage(cfg)
    inputs = published_inputs(cfg, only) if only else {}
    address = ray_address(cfg)  # fails before any MLflow run is opened
    tracker = Tracker(tracking_settings(cfg))
    ray_jobs.prewarm()  # after MLflow's import: the two share modules that must not be imported by two threads at once
    flow_run_id = _flow_run_id()
    _name_flow_run(cfg, stages, flow_run_id)
    parent = open_parent(cfg, stages, tracker, flow_run_id, log.warning)
    scheduler = Scheduler(cfg, stages, inputs, RunContext(ray_address=address, parent_run_id=parent, flow_run_id=flow_run_id),
                          local_cpus(cfg, address))
    try:
        scheduler.run()
        if scheduler.failed:
            names = ", ".join(scheduler.failed)
            skipped = f" (skipped: {', '.join(scheduler.skipped)})" if scheduler.skipped else ""
            details = "\n".join(f"{n}: {exc}" for n, exc in scheduler.failed.items())
            if all(isinstance(e, ray_jobs.StageJobError) and not e.retryable for e in scheduler.failed.values()):
                # Bad input: the run ends with its exit code (a re-run as it is would fail the same way).
                raise ConfigError(f"stages failed on bad input: {names}{skipped}; fix it and run again\n{details}")
            raise RuntimeError(f"stages failed: {names}{skipped}; re-run to resume them from their checkpoints\n{details}")
        results = {n: scheduler.results[n] for n in stages}
        out = close_parent(cfg, tracker, parent, results, flow_run_id, started)
    except BaseException:
        tracker.finish(parent, ok=False)
        raise
    for name, r in results.items():
        log.info("%s: %s in %.1fs -> %s", name, "cache hit" if r.cached else "done", r.seconds, r.uri)
    registered = out["registered_model"]
    if registered and not registered["promoted"]:
        message = f"not promoted: {registered['gate']}"
        return Failed(message=message, data=out) if cfg.registration.gate.fail else Completed(message=message, name="NotPromoted", data=out)
    return out


def _flow_run_id() -> str | None:
    from prefect.runtime import flow_run

    return str(flow_run.id) if flow_run.id else None


def _name_flow_run(config: PipelineConfig, stages: list[str], flow_run_id: str | None) -> None:
    """Name the flow run `<name>-<config hash>` and tag it with the pipeline and its stages, so the Prefect UI
    lists runs by what they ran (Prefect names them at random); trouble here is only a warning."""
    if not flow_run_id:
        return
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            known = client.read_flow_run(flow_run_id).tags or []
            client.update_flow_run(flow_run_id, name=flow_run_name(config),
                                   tags=sorted({*known, "alignflow", f"pipeline:{config.name}", *(f"stage:{s}" for s in stages)}))
    except Exception as exc:  # noqa: BLE001 - a name is not worth failing a run for
        get_run_logger().warning("could not name the flow run %s: %s", flow_run_id, exc)
