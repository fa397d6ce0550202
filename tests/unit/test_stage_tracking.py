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


def test_two_jobs_logging_the_same_dataset_at_once_both_get_it(tmp_path, monkeypatch, caplog):
    """Parallel branches read the same data file: MLflow's sqlite store looks the dataset up, then inserts it, so the
    second of two jobs that looked before either inserted fails on the unique key. The race is forced here with
    SQLAlchemy's own statement hook: the other job logs between this job's look-up and its insert."""
    import sqlalchemy
    from mlflow import MlflowClient
    from mlflow.tracking._tracking_service import utils

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setattr(utils, "_tracking_uri", None)
    monkeypatch.setenv("ALIGNFLOW_SYSTEM_METRICS", "0")
    client = MlflowClient(uri)
    experiment = client.create_experiment("e", artifact_location=str(tmp_path / "artifacts"))
    runs = [client.create_run(experiment).info.run_id for _ in range(2)]
    data = {"data": ("/data/preference/train.jsonl", "c62a3e3bdb33332c2629d6e593f4930200f8aa")}
    monkeypatch.setenv(RUN_ID_ENV, runs[0])
    first = tracking.StageTracking(active=True)
    monkeypatch.setenv(RUN_ID_ENV, runs[1])
    second = tracking.StageTracking(active=True)

    raced = []

    def other_job_inserts_first(conn, cursor, statement, *args):
        if statement.startswith("INSERT INTO datasets") and not raced:
            raced.append(statement)
            second.log_datasets(data)

    engine = first.client._tracking_client.store.engine
    sqlalchemy.event.listen(engine, "before_cursor_execute", other_job_inserts_first)
    try:
        first.log_datasets(data)
    finally:
        sqlalchemy.event.remove(engine, "before_cursor_execute", other_job_inserts_first)
    assert raced, "the race was not staged: MLflow no longer inserts the dataset row this way"
    assert "could not log the datasets" not in caplog.text
    for run_id in runs:
        (logged,) = client.get_run(run_id).inputs.dataset_inputs
        assert logged.dataset.name == "train.jsonl"
