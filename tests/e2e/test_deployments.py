"""Deployments: `alignflow serve` in the background, `prefect deployment run` from the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from alignflow.infra.tracking import STAGE_URI_TAG

from .conftest import ROOT, alignflow

PREFECT = str(Path(sys.executable).parent / "prefect")


def prefect_cli(services, *args, timeout=600):
    env = {**os.environ, **services["env"]}
    return subprocess.run([PREFECT, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def wait_flow_run(services, flow_run_id: str, timeout: float = 480, after: float = 0.0) -> str:
    """Poll the Prefect API until the flow run reaches a terminal state (set after `after`)."""
    import urllib.request

    deadline = time.time() + timeout
    while time.time() < deadline:
        with urllib.request.urlopen(f"{services['prefect']}/flow_runs/{flow_run_id}", timeout=10) as r:
            state = json.loads(r.read())["state"]
        if state["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") and _ts(state["timestamp"]) > after:
            return state["type"]
        time.sleep(1)
    raise AssertionError(f"flow run {flow_run_id} did not finish in {timeout}s")


def _ts(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


# One served stage for the module: the deployment run, its retry and the work pool's run share it.
OVERRIDES = ["storage.root=s3://alignflow-test/e2e-deploy", "sft.batch.max_steps=80", "sft.checkpoint.every_steps=10",
             "ray.retries=0", "name=e2e-deploy", "sft.optim.lr=0.002"]


def test_served_deployment_runs_from_the_prefect_cli_and_a_flow_run_retry_resumes_it(services, tmp_path):
    """`alignflow serve`, then what the run form does: the config stays a path, a few values change through
    `overrides`. Its Ray job is stopped after a checkpoint: the flow run fails; `prefect flow-run retry` resumes the
    stage from that checkpoint."""
    import re

    from mlflow import MlflowClient
    from ray.job_submission import JobSubmissionClient

    from alignflow.infra import storage

    from .conftest import ray_jobs
    from .test_pipeline import _running_job, _wait_for_checkpoint

    served = [o for o in OVERRIDES if not o.startswith("sft.optim.lr")]
    serve = alignflow(services, "serve", *[a for o in served for a in ("--set", o)], wait=False)
    try:
        deadline = time.time() + 180
        while prefect_cli(services, "deployment", "inspect", "alignment/tiny").returncode != 0:
            assert serve.poll() is None, serve.stdout.read()[-3000:]
            assert time.time() < deadline, "deployment alignment/tiny never appeared"
            time.sleep(2)
        listed = prefect_cli(services, "deployment", "ls").stdout
        for variant in ("tiny", "tiny-ppo", "tiny-grpo", "tiny-tulu3", "tiny-compare", "tiny-multiturn", "tiny-agent"):
            assert f"alignment/{variant}" in listed
        inspected = prefect_cli(services, "deployment", "inspect", "alignment/tiny-ppo").stdout
        assert "configs/tiny-ppo.yaml" in inspected and "sft.batch.max_steps=80" in inspected  # a path, not a copy

        before = ray_jobs(services)
        started = prefect_cli(services, "deployment", "run", "alignment/tiny", "--params", json.dumps({"overrides": OVERRIDES}))
        flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", started.stdout).group(1)
        job = _running_job(services, before, timeout=180)
        key = _wait_for_checkpoint("s3://alignflow-test/e2e-deploy/sft")
        JobSubmissionClient(services["ray"]).stop_job(job)
        assert wait_flow_run(services, flow_run_id, 300) == "FAILED"

        retried_at = time.time()
        retry = prefect_cli(services, "flow-run", "retry", flow_run_id)
        assert retry.returncode == 0, retry.stdout + retry.stderr
        assert wait_flow_run(services, flow_run_id, 480, after=retried_at) == "COMPLETED"
    finally:
        serve.terminate()
        serve.wait(timeout=60)
    metrics = json.loads(storage.read_text(f"s3://alignflow-test/e2e-deploy/sft/{key}/metrics.json"))
    assert metrics["resumed_from_step"] >= 10

    client = MlflowClient(services["mlflow"])
    runs = client.search_runs([client.get_experiment_by_name("alignflow").experiment_id],
                              "tags.`alignflow.name` = 'e2e-deploy' and attributes.status = 'FINISHED'")
    assert runs and runs[0].data.params["sft.optim.lr"] == "0.002"  # the run form's value
    version = client.get_model_version_by_alias("e2e-deploy-sft", "candidate")
    assert version.tags[STAGE_URI_TAG].startswith("s3://alignflow-test/e2e-deploy/") and version.source.startswith("models:/m-")


def test_prefect_yaml_deploys_to_a_process_work_pool_and_a_worker_runs_it(services, tmp_path):
    import yaml

    from alignflow.config import load_config

    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    assert {d["name"] for d in spec["deployments"]} == {"tiny", "tiny-ppo", "tiny-grpo", "tiny-tulu3", "tiny-compare", "tiny-multiturn",
                                                       "tiny-rejection-sampling", "tiny-iterative-dpo", "tiny-agent"}
    assert all(not s["active"] for d in spec["deployments"] for s in d["schedules"])
    for d in spec["deployments"]:  # every deployment names a shipped config, loadable as is (base: included)
        load_config(ROOT / d["parameters"]["config"], d["parameters"]["overrides"])

    assert prefect_cli(services, "work-pool", "create", "alignflow", "--type", "process").returncode == 0
    deploy = prefect_cli(services, "--no-prompt", "deploy", "--all")
    assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
    worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", "alignflow"], cwd=ROOT,
                              env={**os.environ, **services["env"]}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # The served deployment's stage settings: the worker's run is answered by the stage cache (no training).
        overrides = [*OVERRIDES, "name=e2e-worker"]
        run = prefect_cli(services, "deployment", "run", "alignment/tiny", "--params", json.dumps({"overrides": overrides}),
                          "--watch", "--watch-timeout", "480")
        assert run.returncode == 0 and "Completed" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    finally:
        worker.terminate()  # a worker may take its time to deregister; CI once waited past 60 s
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait(timeout=30)
