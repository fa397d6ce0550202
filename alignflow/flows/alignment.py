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
from alignflow.flows.handoff import eval_table, register
from alignflow.infra import manifest, ray_jobs, storage
from alignflow.infra.tracking import Tracker
from alignflow.lineage import published_uri
from alignflow.tasks.stage import RunContext, StageResult, result_from_manifest, run_stage, stage_key, tracking_settings

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


def check_storage(config: PipelineConfig) -> None:
    """The storage root can take the run's outputs (bucket exists, folder writable, disk not full): bad input if not."""
    try:
        storage.preflight(config.storage.root)
    except storage.StorageError as exc:
        raise ConfigError(str(exc)) from None


def plan(config: PipelineConfig, until: str | None = None, only: str | None = None) -> list[str]:
    """The stages this run executes, in dependency order."""
    if until and only:
        raise ConfigError("give --until or --only, not both")
    for flag, name in (("--until", until), ("--only", only)):
        if name is not None and name not in config.stages:
            raise ConfigError(f"{flag} {name}: no such stage (stages: {', '.join(config.stages)})")
    if only:
        return [only]
    return config.needed_for(until) if until else config.order()


def published_inputs(config: PipelineConfig, stage: str) -> dict[str, StageResult]:
    """--only: the stage's inputs must be published already; each becomes a result without running."""
    found, missing = {}, []
    for up in dict.fromkeys(config.inputs_of(stage).values()):
        uri = published_uri(config, up)
        if uri is None:
            missing.append(up)
            continue
        key = uri.rstrip("/").rsplit("/", 1)[-1]
        found[up] = result_from_manifest(config, up, uri, key, manifest.verify(uri), 0.0, cached=True, run_id=None)
    if missing:
        raise ConfigError(f"--only {stage}: its inputs {', '.join(missing)} are not published for this config; run them "
                          f"first (alignflow run CONFIG --until {missing[0]})")
    return found


def local_cpus(config: PipelineConfig, address: str) -> int | None:
    """CPUs of a head on this machine (shared out between concurrent jobs); None for a remote cluster."""
    return (config.ray.num_cpus or os.cpu_count() or 1) if ray_jobs.is_local_address(address) else None


def mermaid(config: PipelineConfig, stages: list[str]) -> str:
    lines = ["graph LR"] + [f'  {n}["{n} ({config.kind(n).value})"]' for n in stages]
    lines += [f"  {up} -->|{role}| {n}" for n in stages for role, up in config.inputs_of(n).items() if up in stages]
    return "\n".join(lines) + "\n"


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
    for run_id in tracker.fail_stale_runs(cfg.name):
        log.warning("MLflow run %s was left RUNNING by a flow process that is gone; marked FAILED", run_id)
    flow_run_id = _flow_run_id()
    _name_flow_run(cfg, stages, flow_run_id)
    tags = {"alignflow.name": cfg.name, "alignflow.config_hash": cfg.config_hash(), "alignflow.stages": ",".join(stages),
            "prefect.flow_run_id": str(flow_run_id)}
    parent = tracker.start_parent(cfg.name, tags, {n: cfg.section(n).model_dump(mode="json", by_alias=True) for n in stages})
    tracker.log_text(parent, mermaid(cfg, stages), "graph.mmd")
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
        registered = register(cfg, tracker, parent, results)
        tracker.log_metrics(parent, {f"{n}/{k}": v for n, r in results.items()
                                     for k, v in r.metrics.items() if k.startswith("eval/") or r.kind == "eval"})
        tracker.finish(parent, ok=True)
    except BaseException:
        tracker.finish(parent, ok=False)
        raise
    for name, r in results.items():
        log.info("%s: %s in %.1fs -> %s", name, "cache hit" if r.cached else "done", r.seconds, r.uri)
    out = summary(cfg, tracker, parent, results, registered, time.time() - started)
    if registered and not registered["promoted"]:
        message = f"not promoted: {registered['gate']}"
        return Failed(message=message, data=out) if cfg.registration.gate.fail else Completed(message=message, name="NotPromoted", data=out)
    return out


def _flow_run_id() -> str | None:
    from prefect.runtime import flow_run

    return str(flow_run.id) if flow_run.id else None


def flow_run_name(config: PipelineConfig) -> str:
    return f"{config.name}-{config.config_hash()[:8]}"


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


def summary(config: PipelineConfig, tracker: Tracker, parent: str, results: dict[str, StageResult],
            registered: dict[str, Any] | None, seconds: float) -> dict[str, Any]:
    return {
        "name": config.name,
        "seconds": seconds,
        "mlflow": {"tracking_uri": tracker.uri, "parent_run_id": parent, "parent_run": tracker.run_url(parent)},
        "prefect": {"flow_run_id": _flow_run_id(), "flow_run_name": flow_run_name(config)},
        "registered_model": registered,
        "promoted": registered["promoted"] if registered else None,
        "stages": [r.model_dump() | {"mlflow_run": tracker.run_url(r.mlflow_run_id) if r.mlflow_run_id else None}
                   for r in results.values()],
        "eval": {n: eval_table(r) for n, r in results.items() if r.kind == "eval"},
    }
