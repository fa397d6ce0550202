"""`alignflow services up/status/env/down`: local services whose stores persist in the project, stopped by
their own pids."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import psutil

from .conftest import ROOT


def cli(env, *args):
    return subprocess.run([sys.executable, "-m", "alignflow.cli", "services", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        return response.read()


def test_services_up_status_env_down_keep_their_stores(tmp_path):
    from mlflow import MlflowClient

    home = tmp_path / "services"
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("ALIGNFLOW_SERVICES_HOME", None)
    up = cli(env, "up", "--home", str(home), "--artifacts", str(tmp_path / "artifacts"))
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        state = json.loads((home / "services.json").read_text())
        assert {s["name"] for s in state} == {"ray", "prefect", "mlflow"}
        urls = {s["name"]: s["url"] for s in state}
        for svc in state:
            assert svc["url"].startswith("http://127.0.0.1:") and psutil.pid_exists(svc["pid"])
        get(urls["ray"] + "/api/version"), get(urls["prefect"] + "/health"), get(urls["mlflow"] + "/health")
        assert json.loads(get(urls["prefect"].removesuffix("/api") + "/ui-settings"))["api_url"] == urls["prefect"]  # the UI talks to this port, not 4200
        status = cli(env, "status", "--home", str(home))
        assert all(url.removesuffix("/api") in status.stdout for url in urls.values())
        exports = cli(env, "env", "--home", str(home)).stdout.splitlines()
        assert exports == [f"export ALIGNFLOW_RAY_ADDRESS={urls['ray']}", f"export PREFECT_API_URL={urls['prefect']}",
                           f"export MLFLOW_TRACKING_URI={urls['mlflow']}"]
        assert cli(env, "up", "--home", str(home)).returncode == 1  # already up: refused, nothing started twice
        assert "no local services" in cli(env, "status", "--home", str(tmp_path / "other-checkout")).stdout
        MlflowClient(urls["mlflow"]).create_experiment("kept", artifact_location=str(tmp_path / "artifacts"))
    finally:
        down = cli(env, "down", "--home", str(home))
    assert down.returncode == 0 and down.stdout.count("stopped") == 3
    for svc in state:
        assert not psutil.pid_exists(svc["pid"]) or psutil.Process(svc["pid"]).status() == psutil.STATUS_ZOMBIE
    assert not (home / "services.json").exists() and (home / "mlflow" / "mlflow.db").exists()

    again = cli(env, "up", "--home", str(home), "--artifacts", str(tmp_path / "artifacts"))  # the stores come back
    try:
        assert again.returncode == 0, again.stdout + again.stderr
        mlflow_url = {s["name"]: s["url"] for s in json.loads((home / "services.json").read_text())}["mlflow"]
        assert MlflowClient(mlflow_url).get_experiment_by_name("kept") is not None
    finally:
        purged = cli(env, "down", "--home", str(home), "--purge")
    assert purged.returncode == 0 and not home.exists()
