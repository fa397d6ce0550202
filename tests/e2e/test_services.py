"""`alignflow services up/status/down`: persistent local services, stopped by their own pids."""

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


def test_services_up_status_down(tmp_path):
    env = {**os.environ, "ALIGNFLOW_HOME": str(tmp_path), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    up = cli(env, "up", "--artifacts", str(tmp_path / "artifacts"))
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        state = json.loads((tmp_path / "services.json").read_text())
        assert {s["name"] for s in state} == {"ray", "prefect", "mlflow"}
        for svc in state:
            assert svc["url"].startswith("http://127.0.0.1:") and psutil.pid_exists(svc["pid"])
        health = {"ray": "/api/version", "prefect": "/health", "mlflow": "/health"}
        for svc in state:
            with urllib.request.urlopen(svc["url"] + health[svc["name"]], timeout=10) as response:
                assert response.status == 200
        status = cli(env, "status")
        assert all(s["url"].removesuffix("/api") in status.stdout for s in state)
        assert cli(env, "up").returncode == 1  # already up: refused, nothing started twice
    finally:
        down = cli(env, "down")
    assert down.returncode == 0 and down.stdout.count("stopped") == 3
    for svc in state:
        assert not psutil.pid_exists(svc["pid"]) or psutil.Process(svc["pid"]).status() == psutil.STATUS_ZOMBIE
    assert not (tmp_path / "services.json").exists()
