"""Deployments: `alignflow serve` in the background, `prefect deployment run` from the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .conftest import ROOT, alignflow

PREFECT = str(Path(sys.executable).parent / "prefect")


def prefect_cli(services, *args, timeout=600):
    env = {**os.environ, **services["env"]}
    return subprocess.run([PREFECT, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_served_deployment_runs_from_the_prefect_cli(services, tmp_path):
    from mlflow import MlflowClient

    serve = alignflow(services, "serve", "--set", "storage.root=s3://alignflow-test/e2e-deploy",
                      "--set", "sft.batch.max_steps=20", "--set", "name=e2e-deploy", wait=False)
    try:
        deadline = time.time() + 180
        while prefect_cli(services, "deployment", "inspect", "alignment/sft").returncode != 0:
            assert serve.poll() is None, serve.stdout.read()[-3000:]
            assert time.time() < deadline, "deployment alignment/sft never appeared"
            time.sleep(2)
        listed = prefect_cli(services, "deployment", "ls").stdout
        for variant in ("sft", "full", "grpo", "dpo", "kto"):
            assert f"alignment/{variant}" in listed

        run = prefect_cli(services, "deployment", "run", "alignment/sft", "--watch", "--watch-timeout", "480")
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert "Completed" in run.stdout
    finally:
        serve.terminate()
        serve.wait(timeout=60)

    client = MlflowClient(services["mlflow"])
    runs = client.search_runs([client.get_experiment_by_name("alignflow").experiment_id],
                              "tags.`alignflow.name` = 'e2e-deploy'")
    assert runs and runs[0].info.status == "FINISHED"
    assert client.get_model_version_by_alias("e2e-deploy", "candidate").source.startswith("s3://alignflow-test/e2e-deploy/")


def test_prefect_yaml_deploys_to_a_process_work_pool_and_a_worker_runs_it(services, tmp_path):
    import yaml

    from alignflow.config import load_config

    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    assert {d["name"] for d in spec["deployments"]} == {"sft", "full", "grpo", "dpo", "kto"}
    assert all(not s["active"] for d in spec["deployments"] for s in d["schedules"])
    tiny = yaml.safe_load((ROOT / "configs/tiny.yaml").read_text())
    assert spec["definitions"]["tiny"]["sft"] == tiny["sft"]  # prefect.yaml stays in step with the shipped config

    assert prefect_cli(services, "work-pool", "create", "alignflow", "--type", "process").returncode == 0
    deploy = prefect_cli(services, "--no-prompt", "deploy", "--all")
    assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
    worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", "alignflow"], cwd=ROOT,
                              env={**os.environ, **services["env"]}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        params = dict(spec["deployments"][0]["parameters"]["config"])
        params.update(name="e2e-worker", storage={"root": "s3://alignflow-test/e2e-worker"})
        params["sft"] = {**params["sft"], "batch": {**params["sft"]["batch"], "max_steps": 10}}
        load_config_dict = tmp_path / "c.yaml"
        load_config_dict.write_text(yaml.safe_dump(params))
        load_config(load_config_dict)  # the parameters are a valid config
        run = prefect_cli(services, "deployment", "run", "alignment/sft", "--params", json.dumps({"config": params}),
                          "--watch", "--watch-timeout", "480")
        assert run.returncode == 0 and "Completed" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    finally:
        worker.terminate()
        worker.wait(timeout=60)
