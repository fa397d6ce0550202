from alignflow.infra.lease import OWNER_FILE
from alignflow.stages.common.checkpoint import remove_staging, staging_dir


def test_staging_is_per_published_folder_and_a_dead_runs_is_swept(tmp_path, monkeypatch, dead_holder):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    a, b = staging_dir("k1", "s3://bucket/a/sft/k1"), staging_dir("k1", "/local/b/sft/k1")
    assert a != b and a.parent == b.parent == tmp_path / "alignflow-staging"
    assert staging_dir("k1", "s3://bucket/a/sft/k1") == a  # the ranks of one run share it
    (b / OWNER_FILE).write_text(dead_holder)  # b's run crashed
    (b / "checkpoints").mkdir()
    staging_dir("k2", "s3://bucket/a/sft/k2")  # the next run sweeps it
    assert not b.exists() and a.exists()
    remove_staging(a)
    assert not a.exists()
