"""A pipeline run's parts that need no Prefect: the plan, the MLflow parent run that opens and closes it
(registration, summary), and the fully cached run, answered without Prefect at all.

A fully cached run has nothing to schedule, retry or cache: `alignflow run` answers it here, before it would
start Prefect's temporary server, when no Prefect server is configured (`prefect_server_configured`). It keeps
the MLflow record a flow would make (a parent run, a cache-hit child run per stage, the registry version) and
records no Prefect flow run, which a temporary server would only hold to say that nothing ran. With a Prefect
server, or `alignflow run --flow-run`, the flow runs as always.
"""

from __future__ import annotations

import os
import time
import tomllib
from pathlib import Path
from typing import Any, Callable

from alignflow.config import ConfigError, PipelineConfig
from alignflow.flows.handoff import eval_table, register
from alignflow.infra import manifest, storage
from alignflow.infra.tracking import Tracker
from alignflow.lineage import published_uri, stage_output_uri
from alignflow.tasks.results import StageResult, cache_hit, result_from_manifest, stage_key, tracking_settings

PREFECT_TAG = "alignflow.prefect"  # on a parent run with no Prefect flow run: why there is none


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


def mermaid(config: PipelineConfig, stages: list[str]) -> str:
    lines = ["graph LR"] + [f'  {n}["{n} ({config.kind(n).value})"]' for n in stages]
    lines += [f"  {up} -->|{role}| {n}" for n in stages for role, up in config.inputs_of(n).items() if up in stages]
    return "\n".join(lines) + "\n"


def flow_run_name(config: PipelineConfig) -> str:
    return f"{config.name}-{config.config_hash()[:8]}"


def summary(config: PipelineConfig, tracker: Tracker, parent: str, results: dict[str, StageResult],
            registered: dict[str, Any] | None, seconds: float, flow_run_id: str | None) -> dict[str, Any]:
    return {
        "name": config.name,
        "seconds": seconds,
        "mlflow": {"tracking_uri": tracker.uri, "parent_run_id": parent, "parent_run": tracker.run_url(parent)},
        "prefect": {"flow_run_id": flow_run_id, "flow_run_name": flow_run_name(config)},
        "registered_model": registered,
        "promoted": registered["promoted"] if registered else None,
        "stages": [r.model_dump() | {"mlflow_run": tracker.run_url(r.mlflow_run_id) if r.mlflow_run_id else None}
                   for r in results.values()],
        "eval": {n: eval_table(r) for n, r in results.items() if r.kind == "eval"},
    }


def open_parent(config: PipelineConfig, stages: list[str], tracker: Tracker, flow_run_id: str | None,
                warn: Callable[..., Any], tags: dict[str, str] | None = None) -> str:
    """The run's MLflow parent run (after failing the runs of this pipeline whose flow process is gone)."""
    for run_id in tracker.fail_stale_runs(config.name):
        warn("MLflow run %s was left RUNNING by a flow process that is gone; marked FAILED", run_id)
    tags = {"alignflow.name": config.name, "alignflow.config_hash": config.config_hash(), "alignflow.stages": ",".join(stages),
            "prefect.flow_run_id": str(flow_run_id), **(tags or {})}
    parent = tracker.start_parent(config.name, tags, {n: config.section(n).model_dump(mode="json", by_alias=True) for n in stages})
    tracker.log_text(parent, mermaid(config, stages), "graph.mmd")
    return parent


def close_parent(config: PipelineConfig, tracker: Tracker, parent: str, results: dict[str, StageResult],
                 flow_run_id: str | None, started: float) -> dict[str, Any]:
    """Register the model (gate decided), log the held-out figures on the parent run, finish it: the summary."""
    registered = register(config, tracker, parent, results)
    tracker.log_metrics(parent, {f"{n}/{k}": v for n, r in results.items()
                                 for k, v in r.metrics.items() if k.startswith("eval/") or r.kind == "eval"})
    out = summary(config, tracker, parent, results, registered, time.time() - started, flow_run_id)
    tracker.finish(parent, ok=True)
    return out


def published_graph(config: PipelineConfig, stages: list[str],
                    inputs: dict[str, StageResult]) -> dict[str, tuple[StageResult, manifest.Manifest]] | None:
    """Every stage's verified published result (a cache hit with no MLflow run yet) and its manifest, or None as
    soon as one is missing or does not verify (the flow then runs it, and says what did not verify)."""
    results, found = dict(inputs), {}
    for name in stages:
        key = stage_key(config, name, {role: results[up] for role, up in config.inputs_of(name).items()})
        uri = stage_output_uri(config, name, key)
        done, _ = manifest.check(uri)
        if done is None:
            return None
        results[name] = result_from_manifest(config, name, uri, key, done, 0.0, cached=True, run_id=None)
        found[name] = results[name], done
    return found


def run_fully_cached(config: PipelineConfig, stages: list[str], inputs: dict[str, StageResult],
                     log: Callable[..., Any]) -> dict[str, Any] | None:
    """The run's summary when every stage is published, recorded in MLflow as the flow records cache hits;
    None (nothing recorded) when a stage must run."""
    started = time.time()
    published = published_graph(config, stages, inputs)
    if published is None:
        return None
    tracker = Tracker(tracking_settings(config))
    parent = open_parent(config, stages, tracker, None, log, {PREFECT_TAG: "no flow run: every stage was published"})
    try:
        results = {}
        for name, (found, done) in published.items():
            log("%s: cache hit at %s (no Ray job)", name, found.uri)
            results[name] = cache_hit(config, name, found.cache_key, found.uri, done, tracker, parent, None, time.time())
        return close_parent(config, tracker, parent, results, None, started)
    except BaseException:
        tracker.finish(parent, ok=False)
        raise


def prefect_server_configured() -> bool:
    """Whether Prefect would use a server rather than start its temporary one: PREFECT_API_URL in the
    environment, in the active profile, or in ./prefect.toml, ./pyproject.toml ([tool.prefect]) or ./.env, where
    Prefect 3 reads its settings. Read without importing Prefect (2 s); a file that cannot be read counts as
    configured, so the flow runs."""
    if os.environ.get("PREFECT_API_URL"):
        return True
    home = Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser()
    try:
        profiles_path = Path(os.environ.get("PREFECT_PROFILES_PATH") or home / "profiles.toml").expanduser()
        profiles = tomllib.loads(profiles_path.read_text()) if profiles_path.exists() else {}
        active = os.environ.get("PREFECT_PROFILE") or profiles.get("active", "ephemeral")
        if profiles.get("profiles", {}).get(active, {}).get("PREFECT_API_URL"):
            return True
        here = Path("prefect.toml")
        if here.is_file() and tomllib.loads(here.read_text()).get("api", {}).get("url"):
            return True
        project = Path("pyproject.toml")
        if project.is_file() and tomllib.loads(project.read_text()).get("tool", {}).get("prefect", {}).get("api", {}).get("url"):
            return True
        env = Path(".env")
        return env.is_file() and any(line.strip().startswith("PREFECT_API_URL") for line in env.read_text().splitlines())
    except (OSError, tomllib.TOMLDecodeError, AttributeError):
        return True
