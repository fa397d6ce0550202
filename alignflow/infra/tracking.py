"""MLflow run tree and Model Registry, from the orchestration side (no torch, no pipeline config).

One parent run per pipeline run; one child run per stage, created here and continued inside the Ray
job (its id travels in ALIGNFLOW_MLFLOW_RUN_ID). A cache hit gets a child run too, tagged with the
run that produced the artifact. Only config values are logged as params: credentials live in the
environment and never pass through here.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alignflow.infra import storage

RUN_ID_ENV = "ALIGNFLOW_MLFLOW_RUN_ID"


def metric_name(key: str) -> str:
    """A metric's MLflow name: ours as written everywhere (`eval/reward`; MLflow groups charts by the part
    before `/`), with `@`, which MLflow refuses, spelled `_at_` (`eval/pass@4` -> `eval/pass_at_4`)."""
    return key.replace("@", "_at_")
PARAM_LIMIT = 6000
STAGE_URI_TAG = "alignflow.stage_uri"  # the published stage folder a registered version came from
LINEAGE_TAG = "alignflow.lineage_digest"
HOLDER_TAG = "alignflow.process"  # host:pid:create time:run of the flow process that opened a parent run




@dataclass(frozen=True)
class TrackingSettings:
    uri: str | None  # unset: MLFLOW_TRACKING_URI, else a sqlite store beside local storage (or in ~/.alignflow)
    experiment: str
    storage_root: str
    artifact_location: str | None = None  # of a new experiment; unset: beside the storage root (server: its own)


def tracking_uri(settings: TrackingSettings) -> str:
    if settings.uri:
        return settings.uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    root = settings.storage_root
    folder = storage.local_path(root) if storage.is_local(root) else Path.home() / ".alignflow"
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder.resolve()}/mlflow.db"


# MLflow 3's UI opens an experiment of this kind on its training runs, not on GenAI traces.
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"


@functools.lru_cache(maxsize=1)
def _standard_tags() -> tuple[tuple[str, str], ...]:
    """MLflow's own run tags, which its UI shows: who ran it, from what, at which git commit of the project
    (asked of git once per process, not once per run)."""
    import getpass
    import subprocess
    import sys

    tags = {"mlflow.user": getpass.getuser(), "mlflow.source.type": "LOCAL",
            "mlflow.source.name": " ".join(["alignflow", *sys.argv[1:2]]) if "alignflow" in sys.argv[0] else "alignflow"}
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        if commit.returncode == 0:
            tags["mlflow.source.git.commit"] = commit.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass  # no git: no commit tag
    return tuple(tags.items())


def standard_tags() -> dict[str, str]:
    return dict(_standard_tags())


_SET_UP: set[str] = set()  # sqlite stores this process has seen set up


@contextlib.contextmanager
def _first_setup_lock(uri: str):
    """An exclusive lock beside a sqlite store while MLflow creates or upgrades it and the experiment is made;
    once per store and process (every stage task makes a Tracker: they need not queue on the lock again)."""
    if not uri.startswith("sqlite:///") or uri in _SET_UP:
        yield
        return
    import fcntl

    lock = Path(uri.removeprefix("sqlite:///") + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            from mlflow import MlflowClient

            MlflowClient(uri).search_experiments(max_results=1)  # creates the schema, under the lock
            yield
            _SET_UP.add(uri)
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def flatten(data: Any, prefix: str = "") -> dict[str, str]:
    if isinstance(data, dict):
        out: dict[str, str] = {}
        for k, v in data.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): str(data)[:PARAM_LIMIT]}


class Tracker:
    def __init__(self, settings: TrackingSettings):
        from mlflow import MlflowClient

        storage.export_s3_endpoint()  # MLflow's own S3 client reads its endpoint from MLFLOW_S3_ENDPOINT_URL

        self.settings = settings
        self.uri = tracking_uri(settings)
        with _first_setup_lock(self.uri):  # two runs on a fresh sqlite store would both migrate it
            self.client = MlflowClient(self.uri)
            self.experiment_id = self._experiment(settings.experiment)

    def _experiment(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            if found.tags.get(EXPERIMENT_KIND_TAG) is None:  # made before alignflow set it, or by hand
                self.client.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
            return found.experiment_id
        # Never MLflow's default (./mlruns under whatever the current directory is): the user's location,
        # else beside the stage outputs; a tracking server that proxies artifacts keeps its own root.
        artifacts, root = self.settings.artifact_location, self.settings.storage_root
        if artifacts is None and not self.uri.startswith(("http://", "https://", "databricks")):
            artifacts = ((storage.local_path(root) / "mlflow-artifacts").resolve().as_uri() if storage.is_local(root)
                         else storage.join(root, "mlflow-artifacts"))
        from mlflow.exceptions import MlflowException

        try:
            return self.client.create_experiment(name, artifact_location=artifacts, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
        except MlflowException:  # another run created it in between
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def run_url(self, run_id: str) -> str:
        if self.uri.startswith("http"):
            return f"{self.uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{run_id}"
        return f"{self.uri} (experiment {self.experiment_id}, run {run_id}); view with `mlflow ui --backend-store-uri {self.uri}`"

    def start_parent(self, run_name: str, tags: dict[str, str], params: dict) -> str:
        from alignflow.infra.lease import process_holder

        tags = {**standard_tags(), **tags, HOLDER_TAG: process_holder("run")}
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags)
        self.log_params(run.info.run_id, params)
        return run.info.run_id

    def start_child(self, parent_id: str, stage: str, cache_key: str, flow_run_id: str | None, params: dict,
                    tags: dict[str, str] | None = None) -> str:
        tags = {**standard_tags(), "mlflow.parentRunId": parent_id, "alignflow.stage": stage, "alignflow.cache_key": cache_key,
                "prefect.flow_run_id": str(flow_run_id), **(tags or {})}
        run = self.client.create_run(self.experiment_id, run_name=stage, tags=tags)
        self.log_params(run.info.run_id, params)
        return run.info.run_id

    def log_params(self, run_id: str, data: dict) -> None:
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in sorted(flatten(data).items())]
        for i in range(0, len(params), 100):
            self.client.log_batch(run_id, params=params[i:i + 100])

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(metric_name(k), float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 500):
            self.client.log_batch(run_id, metrics=batch[i:i + 500])

    def log_text(self, run_id: str, text: str, path: str) -> None:
        self.client.log_text(run_id, text, path)

    def record_cache_hit(self, parent_id: str, stage: str, cache_key: str, flow_run_id: str | None, meta: dict,
                         params: dict, tags: dict[str, str] | None = None) -> str:
        """A child run that says where the artifact came from, instead of an empty run."""
        source = meta.get("mlflow_run_id") or ""
        run_id = self.start_child(parent_id, stage, cache_key, flow_run_id, params,
                                  {**(tags or {}), "alignflow.cache_hit": "true", "alignflow.source_run_id": source,
                                   "alignflow.artifact_uri": meta.get("uri", "")})
        self.log_metrics(run_id, meta.get("metrics") or {})
        self.client.set_terminated(run_id, "FINISHED")
        return run_id

    def fail_stale_runs(self, name: str) -> list[str]:
        """Mark FAILED, saying why, the RUNNING runs of pipeline `name` (and their stage runs) whose flow process
        on this host is gone (it was killed with SIGKILL, or the machine rebooted)."""
        from alignflow.infra.lease import holder_gone

        failed = []
        for parent in self.client.search_runs([self.experiment_id], f"tags.`alignflow.name` = '{name}' and attributes.status = 'RUNNING'"):
            holder = parent.data.tags.get(HOLDER_TAG, "")
            if not holder_gone(holder):
                continue
            children = self.client.search_runs([self.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}' "
                                                                     "and attributes.status = 'RUNNING'")
            for run in [parent, *children]:
                self.client.set_tag(run.info.run_id, "alignflow.failure", f"the flow process that ran it ({holder}) is gone")
                self.client.set_terminated(run.info.run_id, "FAILED")
                failed.append(run.info.run_id)
        return failed

    def set_tag(self, run_id: str, key: str, value: str) -> None:
        self.client.set_tag(run_id, key, value)

    def finish(self, run_id: str, ok: bool) -> None:
        self.client.set_terminated(run_id, "FINISHED" if ok else "FAILED")

    def register(self, name: str, stage_uri: str, run_id: str, tags: dict[str, str], description: str) -> tuple[str, bool]:
        """A version of `name` for the published stage's `model/` folder: (version, created). The same lineage
        digest (tag) maps to the same version, so a fully cached re-run registers nothing new.

        The version is an MLflow model (a pyfunc that generates; see model_flavor) logged to `run_id`, so its
        files live in the run's artifact store; the tag STAGE_URI_TAG says which published stage it is."""
        from mlflow.exceptions import MlflowException

        from alignflow.infra.model_flavor import global_tracking_uri, log_hf_model

        try:
            self.client.create_registered_model(name, description=f"alignflow pipeline {name!r}")
        except MlflowException as exc:
            if "RESOURCE_ALREADY_EXISTS" not in str(exc.error_code):
                raise
        for version in self.client.search_model_versions(f"name='{name}'"):
            if version.tags.get(LINEAGE_TAG) and version.tags.get(LINEAGE_TAG) == tags.get(LINEAGE_TAG):
                return version.version, False
        tags = {**tags, STAGE_URI_TAG: stage_uri}
        with global_tracking_uri(self.uri):
            model = log_hf_model(self.client, self.experiment_id, run_id, storage.join(stage_uri, "model"), tags)
            version = self.client.create_model_version(name, source=model.model_uri, run_id=run_id, description=description,
                                                       tags=tags, model_id=model.model_id)
        return version.version, True

    def set_alias(self, name: str, alias: str, version: str) -> None:
        self.client.set_registered_model_alias(name, alias, version)

    def tag_version(self, name: str, version: str, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_model_version_tag(name, version, key, value)

