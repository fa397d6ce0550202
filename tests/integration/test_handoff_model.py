"""The registered version is an MLflow model that generates: `mlflow.pyfunc.load_model("models:/NAME@candidate")`
in a fresh process, from a sqlite registry with local and with S3 storage (the server pairs are in the e2e tier)."""

from __future__ import annotations

from pathlib import Path

from alignflow.infra import storage
from alignflow.infra.tracking import LINEAGE_TAG, STAGE_URI_TAG, Tracker, TrackingSettings

from ..serving import greedy, logged_model, predict_in_fresh_process


def register(db: str, root: str, stage_uri: str, name: str, lineage: str) -> tuple[Tracker, str, bool]:
    tracker = Tracker(TrackingSettings(uri=db, experiment="alignflow", storage_root=root))
    parent = tracker.start_parent(name, {}, {})
    version, created = tracker.register(name, stage_uri, parent, {LINEAGE_TAG: lineage}, f"# {name}\nmodel card")
    tracker.set_alias(name, "candidate", version)
    return tracker, version, created


def test_registered_version_loads_with_mlflow_pyfunc_and_generates(tiny_sft, s3_server, tmp_path):
    _, sft = tiny_sft
    db = f"sqlite:///{tmp_path}/mlflow.db"
    local, version, created = register(db, str(tmp_path / "out"), sft["uri"], "tiny-sft", "lineage-a")
    assert created and register(db, str(tmp_path / "out"), sft["uri"], "tiny-sft", "lineage-a")[1:] == (version, False)

    s3_stage = f"s3://alignflow-test/handoff/sft/{sft['cache_key']}"
    storage.upload_dir(sft["uri"], s3_stage)
    s3_db = f"sqlite:///{tmp_path}/s3-mlflow.db"
    on_s3, _, _ = register(s3_db, "s3://alignflow-test/handoff", s3_stage, "tiny-sft-s3", "lineage-b")

    for tracker, name, where in ((local, "tiny-sft", (tmp_path / "out" / "mlflow-artifacts").as_uri()),
                                 (on_s3, "tiny-sft-s3", "s3://alignflow-test/handoff/mlflow-artifacts/")):
        v = tracker.client.get_model_version_by_alias(name, "candidate")
        model = logged_model(tracker.client, v)
        assert model.artifact_location.startswith(where), model.artifact_location  # in the run's artifact store
        assert v.run_id and v.description.startswith(f"# {name}") and v.tags[STAGE_URI_TAG] in (sft["uri"], s3_stage)

    got = predict_in_fresh_process([(db, "models:/tiny-sft@candidate"), (s3_db, "models:/tiny-sft-s3@candidate")])
    expected = greedy(str(Path(sft["uri"]) / "model"))
    assert got["models:/tiny-sft@candidate"]["text"] == got["models:/tiny-sft-s3@candidate"]["text"] == expected, (got, expected)
