import json
import os
import stat
from pathlib import Path

import pytest

from alignflow.infra import secrets
from alignflow.infra.lease import OWNER_FILE


def test_credentials_are_told_from_settings():
    env = {"AWS_SECRET_ACCESS_KEY": "s", "AWS_ACCESS_KEY_ID": "k", "AWS_SESSION_TOKEN": "t", "HF_TOKEN": "h",
           "MLFLOW_TRACKING_PASSWORD": "p", "AWS_DEFAULT_REGION": "r", "ALIGNFLOW_S3_ENDPOINT_URL": "e", "HF_HOME": "/h",
           "RAY_AUTH_TOKEN": "ray's own", secrets.SECRETS_FILE_ENV: "/f"}
    plain, secret = secrets.split(env)
    assert set(secret) == {"AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "AWS_SESSION_TOKEN", "HF_TOKEN", "MLFLOW_TRACKING_PASSWORD"}
    assert set(plain) == set(env) - set(secret)


def test_a_local_job_gets_a_private_file_removed_when_the_job_ends(monkeypatch):
    with secrets.job_env({"AWS_SECRET_ACCESS_KEY": "s3cr3t", "AWS_DEFAULT_REGION": "r"}, local=True) as env:
        assert "s3cr3t" not in json.dumps(env) and env["AWS_DEFAULT_REGION"] == "r"
        path = Path(env[secrets.SECRETS_FILE_ENV])
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        monkeypatch.setenv(secrets.SECRETS_FILE_ENV, str(path))
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
        secrets.load_job_secrets()
        assert os.environ["AWS_SECRET_ACCESS_KEY"] == "s3cr3t"
    assert not path.parent.exists()
    with pytest.raises(secrets.MissingSecrets, match="is gone"):
        secrets.load_job_secrets()


def test_a_remote_job_gets_only_the_names(monkeypatch, capsys):
    with secrets.job_env({"HF_TOKEN": "hf_x", "HF_HOME": "/h"}, local=False) as env:
        assert env == {"HF_HOME": "/h", secrets.SECRET_NAMES_ENV: "HF_TOKEN"}
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv(secrets.SECRETS_FILE_ENV, raising=False)
    monkeypatch.setenv(secrets.SECRET_NAMES_ENV, "HF_TOKEN")
    secrets.load_job_secrets()
    assert "lacks HF_TOKEN" in capsys.readouterr().out


def test_without_credentials_nothing_is_written():
    with secrets.job_env({"HF_HOME": "/h"}, local=True) as env:
        assert env == {"HF_HOME": "/h"}


def test_a_killed_runs_credentials_folder_is_removed_by_the_next_run(tmp_path, monkeypatch, dead_holder):
    import tempfile

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    left = tmp_path / f"{secrets.FOLDER_PREFIX}killed"
    left.mkdir()
    (left / OWNER_FILE).write_text(dead_holder)
    (left / "env.json").write_text('{"AWS_SECRET_ACCESS_KEY": "s"}')
    with secrets.job_env({"AWS_SECRET_ACCESS_KEY": "s"}, local=True) as env:
        assert not left.exists() and Path(env[secrets.SECRETS_FILE_ENV]).exists()
