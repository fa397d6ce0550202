"""Real services, started once for this tier and shared by its tests: S3 API (moto server), Ray head,
MLflow server (sqlite store, artifacts on the S3 server), Prefect server. All on 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECRET = "af-e2e-secret-7f3a9c"  # an S3 secret key that must never show up in MLflow


@pytest.fixture(scope="package")
def services(s3_server, tmp_path_factory):
    """Stopped when the e2e tier's last test is done, not at the end of the session: idle, the three take 13% of a
    core (Prefect's loop services, Ray's dashboard, agent and prestarted workers) from the tiers that run after."""
    from alignflow.infra.services import remove_home, start_all, start_mlflow_server, start_prefect_server, start_ray_head

    os.environ["AWS_SECRET_ACCESS_KEY"] = SECRET
    base = str(tmp_path_factory.mktemp("services"))
    started = []
    try:
        started = start_all(lambda: start_ray_head(num_cpus=2), lambda: start_mlflow_server("s3://alignflow-test/mlflow", base="/tmp"),
                            lambda: start_prefect_server(base="/tmp"))
        ray, mlflow, prefect = started
        env = {"ALIGNFLOW_RAY_ADDRESS": ray.url, "MLFLOW_TRACKING_URI": mlflow.url, "PREFECT_API_URL": prefect.url,
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "ALIGNFLOW_HOME": base, "ALIGNFLOW_SERVICES_HOME": base,
               "PREFECT_LOCAL_STORAGE_PATH": f"{base}/prefect-results"}
        yield {"ray": ray.url, "mlflow": mlflow.url, "prefect": prefect.url, "env": env, "base": base,
               "homes": {s.name: s.home for s in started}}
    finally:
        for service in reversed(started):
            service.stop()
            remove_home(service)


def alignflow(services, *args, env=None, timeout=900, wait=True):
    """Run the `alignflow` CLI against the session's services."""
    cmd = [sys.executable, "-m", "alignflow.cli", *args]
    full_env = {**os.environ, **services["env"], **(env or {})}
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def ray_jobs(services) -> dict[str, str]:
    from ray.job_submission import JobSubmissionClient

    return {j.submission_id: str(j.status) for j in JobSubmissionClient(services["ray"]).list_jobs()}


def cmdline(process) -> list[str]:
    """A process's command line, or [] once it has exited (a zombie not yet reaped has none; psutil raises)."""
    import psutil

    try:
        return process.cmdline()
    except psutil.Error:
        return []
