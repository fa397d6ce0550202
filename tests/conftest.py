"""Test tiers follow folders: tests/unit -> `unit`, tests/integration -> `integration`, tests/e2e -> `e2e`.

`make test-fast` runs the unit tier alone (seconds, no services, no training).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the suite may touch a hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def pytest_collection_modifyitems(items):
    for item in items:
        tier = Path(str(item.fspath)).relative_to(ROOT / "tests").parts[0]
        if tier in ("unit", "integration", "e2e"):
            item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from alignflow.stages.common.builtin_model import resolve_builtin

    return resolve_builtin("builtin:tiny")


@pytest.fixture(scope="session")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 API server (moto's server mode) on 127.0.0.1, with a bucket `alignflow-test`.

    Sets the AWS_* variables and ALIGNFLOW_S3_ENDPOINT_URL for the session's processes.
    """
    import subprocess
    import sys
    import time
    import urllib.request

    from alignflow.infra.ports import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=2)
            break
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto S3 server did not start")
            time.sleep(0.3)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "ALIGNFLOW_S3_ENDPOINT_URL": endpoint}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import s3fs

    s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}).mkdir("alignflow-test")
    try:
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def dead_holder() -> str:
    """The `process_holder` of a process that has exited: what a run killed with SIGKILL leaves behind."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", "from alignflow.infra.lease import process_holder; print(process_holder('x'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
