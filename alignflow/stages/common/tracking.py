"""The stage's side of MLflow: continue the child run the orchestrator created.

Active only when ALIGNFLOW_MLFLOW_RUN_ID is set (by the stage task); a stage run
by hand logs to stdout and metrics.json only. Metrics are sent in batches; the
stage's data files are logged as dataset inputs with their sha256; system metrics
(CPU, memory; GPU when present) are sampled every SYSTEM_METRICS_EVERY_S seconds
unless ALIGNFLOW_SYSTEM_METRICS=0.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from alignflow.infra.tracking import RUN_ID_ENV, metric_name  # RUN_ID_ENV: set by the stage task

log = logging.getLogger(__name__)



SYSTEM_METRICS_EVERY_S = 5
DATA_CONTEXTS = {"data": "training", "eval_data": "evaluation"}
DATASET_ATTEMPTS = 3


class StageTracking:
    def __init__(self, active: bool, flush_every: int = 20):
        self.run_id = os.environ.get(RUN_ID_ENV) if active else None
        self.flush_every = flush_every
        self._buffer: list = []
        self.client = self._monitor = None
        if self.run_id:
            from mlflow import MlflowClient

            from alignflow.infra.storage import export_s3_endpoint

            export_s3_endpoint()  # artifacts of a sqlite store go to S3 storage through MLflow's own client
            self.client = MlflowClient()  # MLFLOW_TRACKING_URI comes from the job's environment
            if os.environ.get("ALIGNFLOW_SYSTEM_METRICS", "1") != "0":
                self._start_system_metrics()

    def _start_system_metrics(self) -> None:
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._monitor = SystemMetricsMonitor(self.run_id, sampling_interval=SYSTEM_METRICS_EVERY_S)
            self._monitor.start()
        except Exception as exc:  # noqa: BLE001 - monitoring is never worth failing a stage for
            log.warning("system metrics are off for MLflow run %s: %s", self.run_id, exc)

    def log_datasets(self, datasets: dict[str, tuple]) -> None:
        """The stage's data as MLflow dataset inputs: name -> (source, sha256 digest[, schema {column: type}])."""
        if not (self.client and datasets):
            return
        import json

        from mlflow.entities import Dataset, DatasetInput, InputTag

        def entity(source: str, digest: str, schema: dict | None = None) -> Dataset:
            return Dataset(name=Path(source).name, digest=digest[:36], source_type="path" if "://" not in source else source.split("://")[0],
                           source=source, schema=json.dumps({"columns": schema}) if schema else None)

        inputs = [DatasetInput(entity(*value), tags=[InputTag("mlflow.data.context", DATA_CONTEXTS.get(name.split(":")[0], name))])
                  for name, value in datasets.items()]
        for attempt in range(DATASET_ATTEMPTS):
            try:
                self.client.log_inputs(self.run_id, datasets=inputs)
                return
            except Exception as exc:
                # MLflow's sqlite store looks a dataset up, then inserts it: of two jobs reading the same file at once
                # (parallel branches), the later insert fails on the unique key. Asked again, it finds the row.
                if attempt == DATASET_ATTEMPTS - 1:
                    log.warning("could not log the datasets of MLflow run %s: %s", self.run_id, exc)

    def close(self) -> None:
        self.flush()
        if self._monitor is not None:
            monitor, self._monitor = self._monitor, None
            monitor.finish()
            self._publish_last_samples(monitor)

    def _publish_last_samples(self, monitor) -> None:
        """MLflow's monitor drops the samples it holds when it is stopped within an interval, so a stage shorter
        than SYSTEM_METRICS_EVERY_S logged no system metrics at all: what it holds is published here."""
        try:
            metrics = monitor.aggregate_metrics()
            if metrics:
                monitor.publish_metrics(metrics)
                monitor.mlflow_logger.flush()
        except Exception as exc:  # noqa: BLE001 - as above
            log.warning("could not log the last system metrics of MLflow run %s: %s", self.run_id, exc)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if not self.client:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._buffer += [Metric(metric_name(k), float(v), now, step) for k, v in metrics.items()]
        if len(self._buffer) >= self.flush_every * 4:
            self.flush()

    def log_params(self, params: dict[str, str]) -> None:
        """Params of the stage's run (values cut to MLflow's limit); trouble is logged, never fatal."""
        if not (self.client and params):
            return
        from mlflow.entities import Param

        try:
            self.client.log_batch(self.run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])
        except Exception as exc:
            log.warning("could not send params to MLflow run %s: %s", self.run_id, exc)

    def flush(self) -> None:
        """Send buffered metrics. Tracking trouble (an MLflow outage) is logged, never fatal to training."""
        if not (self.client and self._buffer):
            return
        try:
            for i in range(0, len(self._buffer), 1000):
                self.client.log_batch(self.run_id, metrics=self._buffer[i:i + 1000])
        except Exception as exc:
            log.warning("could not send %d metrics to MLflow run %s: %s", len(self._buffer), self.run_id, exc)
        self._buffer = []

    def log_artifacts(self, files: list[Path]) -> None:
        if not self.client:
            return
        self.flush()
        for path in files:
            if path.exists():
                try:
                    self.client.log_artifact(self.run_id, str(path))
                except Exception as exc:
                    log.warning("could not log artifact %s to MLflow run %s: %s", path.name, self.run_id, exc)


def plot_curves(history: list[dict[str, float]], keys: list[str], path: Path) -> Path:
    """One PNG with a panel per metric against the step. Without pyplot's global state, so it can draw in a
    thread while the stage saves its model."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    keys = [k for k in keys if any(k in r for r in history)]
    fig = Figure(figsize=(4 * max(1, len(keys)), 3))
    axes = fig.subplots(1, max(1, len(keys)), squeeze=False)
    for ax, key in zip(axes[0], keys):
        points = [(r["step"], r[key]) for r in history if key in r]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 30 else None)
        ax.set_title(key)
        ax.set_xlabel("step")
        for axis in (ax.xaxis, ax.yaxis):  # ticks and their labels are most of a panel's drawing time
            axis.set_major_locator(MaxNLocator(4))
    # Fixed margins: tight_layout measures every label first, a second full draw (0.2 s of a stage's publish).
    fig.subplots_adjust(left=0.6 / fig.get_figwidth(), right=1 - 0.15 / fig.get_figwidth(), bottom=0.17, top=0.88,
                        wspace=0.3)
    fig.savefig(path, dpi=80)
    return path
