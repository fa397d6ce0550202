"""The newcomer's path: `alignflow services up`, `alignflow run` on them (found through the project, nothing
exported by hand), the Prefect and MLflow UIs in a real browser, `export` from the registry, `services down`
keeping the stores, and `--purge`."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import urllib.request
from pathlib import Path

import psutil

from .browser import open_page
from .conftest import ROOT, cmdline

SCREENSHOTS_ENV = "ALIGNFLOW_SCREENSHOTS"  # a folder to keep the UI screenshots in (docs/ has the README's)


def cli(env, *args, timeout=600):
    return subprocess.run([sys.executable, "-m", "alignflow.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        return response.read()


def test_services_up_run_uis_export_down_keep_their_stores(tmp_path):
    home = tmp_path / "services"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "ALIGNFLOW_RAY"))}
    env.update({"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "ALIGNFLOW_SERVICES_HOME": str(home)})  # as the project's default
    up = cli(env, "services", "up", "--artifacts", str(tmp_path / "artifacts"))
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        state = json.loads((home / "services.json").read_text())
        assert {s["name"] for s in state} == {"ray", "prefect", "mlflow"}
        urls = {s["name"]: s["url"] for s in state}
        for svc in state:
            assert svc["url"].startswith("http://127.0.0.1:") and psutil.pid_exists(svc["pid"])
        get(urls["ray"] + "/api/version"), get(urls["prefect"] + "/health"), get(urls["mlflow"] + "/health")
        # The head came up having run one no-op job, so its first stage does not pay the job agent's start.
        (ready,) = json.loads(get(urls["ray"] + "/api/jobs/"))
        assert (ready["submission_id"], ready["entrypoint"], ready["status"]) == ("alignflow-head-ready", "true", "SUCCEEDED")
        assert ready["metadata"] == {"alignflow": "head start-up check"}
        mlflow_tree = psutil.Process(next(s["pid"] for s in state if s["name"] == "mlflow")).children(recursive=True)
        assert not [p for p in mlflow_tree if "huey" in " ".join(p.cmdline())]  # no GenAI job runner polling beside training
        assert json.loads(get(urls["prefect"].removesuffix("/api") + "/ui-settings"))["api_url"] == urls["prefect"]  # the UI talks to this port, not 4200
        status = cli(env, "services", "status")
        assert all(url.removesuffix("/api") in status.stdout for url in urls.values())
        exports = cli(env, "services", "env").stdout.splitlines()
        assert exports == [f"export ALIGNFLOW_RAY_ADDRESS={urls['ray']}", f"export PREFECT_API_URL={urls['prefect']}",
                           f"export MLFLOW_TRACKING_URI={urls['mlflow']}"]
        assert cli(env, "services", "up").returncode == 1  # already up: refused, nothing started twice
        assert "no local services" in cli(env, "services", "status", "--home", str(tmp_path / "other-checkout")).stdout

        # A short SFT that trains (a cache hit's run logs its figures at step 0 only, and MLflow draws no curve of it),
        # on these services only.
        run = cli(env, "run", "configs/tiny.yaml", "--set", f"storage.root={tmp_path / 'out'}", "--set", "name=e2e-ui",
                  "--set", "sft.batch.max_steps=10", "--set", "sft.logging.eval_every=5", "--summary-json", str(tmp_path / "run.json"),
                  timeout=900)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        summary = json.loads((tmp_path / "run.json").read_text())
        assert summary["mlflow"]["tracking_uri"] == urls["mlflow"] and "Starting temporary server" not in run.stdout + run.stderr
        browse_the_uis(urls, summary, Path(os.environ.get(SCREENSHOTS_ENV) or tmp_path / "screenshots"))

        exported = cli(env, "export", "models:/e2e-ui-sft@candidate", str(tmp_path / "serving"))
        assert exported.returncode == 0 and (tmp_path / "serving" / "MANIFEST.json").exists(), exported.stderr
    finally:
        down = cli(env, "services", "down")
    assert down.returncode == 0 and down.stdout.count("stopped") == 3
    for svc in state:
        assert not psutil.pid_exists(svc["pid"]) or psutil.Process(svc["pid"]).status() == psutil.STATUS_ZOMBIE
    assert not (home / "services.json").exists()
    with sqlite3.connect(home / "mlflow" / "mlflow.db") as db:  # the stores stay: the next `up` serves them again
        assert ("e2e-ui-sft",) in db.execute("select name from registered_models").fetchall()
    with sqlite3.connect(home / "prefect" / "prefect.db") as db:
        assert (summary["prefect"]["flow_run_name"],) in db.execute("select name from flow_run").fetchall()

    purged = cli(env, "services", "down", "--purge")
    assert purged.returncode == 0 and not home.exists()


def browse_the_uis(urls: dict[str, str], summary: dict, shots: Path) -> None:
    """What a person opens: the flow run and its task run in Prefect; the run tree, a metric chart and the
    registered model in MLflow. Each page is rendered by Chromium; one screenshot of each UI is kept."""
    prefect, mlflow = urls["prefect"].removesuffix("/api"), urls["mlflow"]
    flow_run = summary["prefect"]["flow_run_id"]
    with open_page(f"{prefect}/runs/flow-run/{flow_run}") as page:
        text = page.wait_text(summary["prefect"]["flow_run_name"], "Completed", "1 Task run", "sft prefect.task_runs")
        assert summary["prefect"]["flow_run_name"] in text and "Completed" in text and "1 Task run" in text, text[:2000]
        assert "pipeline:e2e-ui" in text and "sft prefect.task_runs" in text  # its tags, and the sft task run's log lines
        page.screenshot(shots / "prefect-flow-run.png")

    (stage,) = summary["stages"]
    experiment = summary["mlflow"]["parent_run"].split("/experiments/")[1].split("/")[0]
    with open_page(f"{mlflow}/#/experiments/{experiment}/runs") as page:
        runs = page.wait_text("2 matching runs", "e2e-ui-sft v1")
        assert "Training runs" in runs and "e2e-ui" in runs and "2 matching runs" in runs, runs[:2000]  # the parent and its child
        assert "e2e-ui-sft v1" in runs  # the parent's registered model, in the Models column
        page.screenshot(shots / "mlflow-runs.png")
    with open_page(f"{mlflow}/#/experiments/{experiment}/runs/{stage['mlflow_run_id']}/model-metrics") as page:
        page.wait_text("train (", timeout_s=60)
        page.type_into("Search metric charts", "train/loss")  # as a person finds one chart among the sections
        charts = page.wait_text("sft (train/loss)", "Step")
        assert "train (1)" in charts and "Step" in charts and "sft (train/loss)" in charts, charts[:2000]  # the chart, drawn
    with open_page(f"{mlflow}/#/models/e2e-ui-sft/versions/1") as page:
        model = page.wait_text("Source Run", "@ candidate", "Inputs (2) Outputs (1)")
        assert "Source Run : e2e-ui" in model and "@ candidate" in model and "Lineage" in model, model[:2000]
        assert "Inputs (2) Outputs (1)" in model  # the signature: messages or prompt in, text out
        page.screenshot(shots / "mlflow-model.png")


def test_serve_without_services_gets_a_private_head_that_has_run_its_start_up_job(tmp_path, monkeypatch):
    """`alignflow serve` with nothing up: its head is started at once (its deployments' flow runs are processes of
    their own) and runs the start-up job first, so that the first flow run's stage does not pay for the job agent.
    Its folder is claimed by this process and removed when it stops."""
    from alignflow import cli as alignflow_cli
    from alignflow.config import load_config
    from alignflow.infra import lease

    monkeypatch.delenv("ALIGNFLOW_RAY_ADDRESS", raising=False)
    monkeypatch.setenv("ALIGNFLOW_SERVICES_HOME", str(tmp_path / "none-up"))
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [])
    with alignflow_cli._services_for(cfg, on_demand=False):
        url = os.environ["ALIGNFLOW_RAY_ADDRESS"]
        (ready,) = json.loads(get(url + "/api/jobs/"))
        assert (ready["submission_id"], ready["status"]) == ("alignflow-head-ready", "SUCCEEDED")
        port = url.rsplit(":", 1)[1]
        (start,) = [line for line in map(cmdline, psutil.Process().children()) if f"--dashboard-port={port}" in line]
        home = Path(next(a for a in start if a.startswith("--temp-dir=")).split("=", 1)[1])
        assert lease.process_holder("ray-home").rsplit(":", 1)[0] == (home / lease.OWNER_FILE).read_text().rsplit(":", 1)[0]
    assert "ALIGNFLOW_RAY_ADDRESS" not in os.environ and not home.exists()
