"""The stage's MLflow side against a real MLflow store (sqlite, in this process)."""

import time

from alignflow.infra.tracking import RUN_ID_ENV
from alignflow.stages.common import tracking


def test_a_stage_shorter_than_the_sampling_interval_still_logs_its_system_metrics(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from mlflow.tracking._tracking_service import utils

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # a stage job's only source of the URI
    monkeypatch.setattr(utils, "_tracking_uri", None)  # one another test set in this process would win over it
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("e", artifact_location=str(tmp_path / "artifacts")))
    monkeypatch.setenv(RUN_ID_ENV, run.info.run_id)
    started = time.monotonic()
    stage = tracking.StageTracking(active=True)
    assert stage._monitor is not None
    time.sleep(0.5)
    stage.close()
    assert time.monotonic() - started < tracking.SYSTEM_METRICS_EVERY_S  # MLflow's monitor had published nothing
    metrics = client.get_run(run.info.run_id).data.metrics
    assert any(k.startswith("system/cpu_utilization") for k in metrics), sorted(metrics)
