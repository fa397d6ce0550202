"""Storage roots that cannot work fail before any job, naming what is wrong; no bucket is ever created."""

import subprocess
import sys

import pytest

from alignflow.infra import storage


def buckets() -> set[str]:
    fs, _ = storage.filesystem("s3://alignflow-test")
    return {b.rstrip("/") for b in fs.ls("", refresh=True)}


def test_a_missing_bucket_is_named_and_never_created(s3_server, repo_root):
    before = buckets()
    with pytest.raises(storage.StorageError, match="the bucket 'no-such-bucket-xyz' does not exist"):
        storage.preflight("s3://no-such-bucket-xyz/p")
    with pytest.raises(FileNotFoundError):  # a write past the preflight fails too, rather than make the bucket
        storage.write_text("s3://no-such-bucket-xyz/p/x.txt", "x")
    run = subprocess.run([sys.executable, "-m", "alignflow.cli", "run", "configs/tiny.yaml", "--set",
                          "storage.root=s3://no-such-bucket-xyz/p"], cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "the bucket 'no-such-bucket-xyz' does not exist" in run.stderr, run.stderr
    assert "starting a local Ray head" not in run.stderr  # found before any service or job
    assert buckets() == before
    storage.preflight("s3://alignflow-test/anything")


def test_bad_names_unwritable_folders_and_full_disks_are_clear(tmp_path, monkeypatch):
    with pytest.raises(storage.StorageError, match="'My_Bucket' is not a valid S3 bucket name"):
        storage.preflight("s3://My_Bucket/p")
    (tmp_path / "file").write_text("x")
    with pytest.raises(storage.StorageError, match=rf"storage.root {tmp_path}/file/out cannot be written: Not a directory"):
        storage.preflight(str(tmp_path / "file" / "out"))
    storage.preflight(str(tmp_path / "out"))
    monkeypatch.setenv(storage.MIN_FREE_ENV, str(1 << 40))  # more than any disk here has
    with pytest.raises(storage.StorageError, match=r"MiB free on its disk, less than the 1099511627776 MiB"):
        storage.preflight(str(tmp_path / "out"))
