"""`alignflow run` against a real Ray head, Prefect server, MLflow server and S3 API server."""

from __future__ import annotations

import json
import signal
import time

import pytest

from alignflow.infra import storage

from .conftest import SECRET, alignflow, ray_jobs

FAST = ["--set", "sft.batch.max_steps=30", "--set", "sft.checkpoint.every_steps=10", "--set", "sft.logging.eval_every=10"]


def run_args(root: str, *extra: str) -> list[str]:
    return ["run", "configs/tiny.yaml", "--set", f"storage.root={root}", *FAST, *extra]


def test_run_then_rerun_is_fully_cached(services, tmp_path):
    from mlflow import MlflowClient

    root = "s3://alignflow-test/e2e-run"
    jobs_before = ray_jobs(services)
    first = alignflow(services, *run_args(root, "--set", "name=e2e-run"), "--summary-json", str(tmp_path / "1.json"))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    summary = json.loads((tmp_path / "1.json").read_text())
    (sft,) = summary["stages"]
    assert not sft["cached"] and sft["ray_job_id"] in set(ray_jobs(services)) - set(jobs_before)
    assert sft["uri"].startswith(f"{root}/sft/")

    client = MlflowClient(services["mlflow"])
    parent = client.get_run(summary["mlflow"]["parent_run_id"])
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    (child,) = children
    assert child.data.tags["alignflow.stage"] == "sft" and child.data.tags["ray.job_id"] == sft["ray_job_id"]
    assert child.data.tags["alignflow.cache_key"] == sft["cache_key"]
    assert len(client.get_metric_history(child.info.run_id, "loss")) == 30
    artifacts = {a.path for a in client.list_artifacts(child.info.run_id)}
    assert {"config.yaml", "MANIFEST.json", "MODEL_CARD.md", "curves.png", "metrics.json"} <= artifacts
    everything = json.dumps([parent.data.params, parent.data.tags, child.data.params, child.data.tags])
    assert SECRET not in everything and SECRET not in first.stdout + first.stderr

    version = client.get_model_version_by_alias("e2e-run", "candidate")
    assert version.source == storage.join(sft["uri"], "model") and version.tags["alignflow.cache_key"] == sft["cache_key"]
    assert child.info.run_name == "sft" and child.data.tags["alignflow.kind"] == "sft"
    model_dir = storage.download_dir(version.source, tmp_path / "candidate")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "rev abcd"}], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert model.generate(**ids, max_new_tokens=6, do_sample=False).shape[1] > ids["input_ids"].shape[1]

    exported = alignflow(services, "export", "models:/e2e-run@candidate", str(tmp_path / "serving"))
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "serving" / "model.safetensors").exists() and (tmp_path / "serving" / "tokenizer.json").exists()

    jobs_mid = ray_jobs(services)
    start = time.time()
    second = alignflow(services, *run_args(root, "--set", "name=e2e-run"), "--summary-json", str(tmp_path / "2.json"))
    wall = time.time() - start
    assert second.returncode == 0, second.stdout[-3000:]
    again = json.loads((tmp_path / "2.json").read_text())
    assert [s["cached"] for s in again["stages"]] == [True]
    assert ray_jobs(services) == jobs_mid  # no Ray job submitted
    hit = client.get_run(again["stages"][0]["mlflow_run_id"])
    assert hit.data.tags["alignflow.cache_hit"] == "true" and hit.data.tags["alignflow.source_run_id"] == child.info.run_id
    print(f"first run {summary['seconds']:.1f}s (flow), cached re-run {again['seconds']:.1f}s (flow), {wall:.1f}s (command)")

    # A third run is answered by Prefect's own cache (the second run stored the result under its key).
    third = alignflow(services, *run_args(root, "--set", "name=e2e-run"), "--summary-json", str(tmp_path / "3.json"))
    assert third.returncode == 0, third.stdout[-3000:]
    (stage3,) = json.loads((tmp_path / "3.json").read_text())["stages"]
    assert stage3["cached"] and ray_jobs(services) == jobs_mid
    assert client.get_run(stage3["mlflow_run_id"]).data.tags["alignflow.source_run_id"] == child.info.run_id


def _wait_for_checkpoint(root_prefix: str, timeout: float = 300) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        for key in storage.list_dirs(root_prefix):
            ckpts = storage.join(root_prefix, key, "checkpoints")
            for name in storage.list_dirs(ckpts):
                if storage.exists(storage.join(ckpts, name, "CHECKPOINT_MANIFEST.json")):
                    return key
        time.sleep(0.5)
    raise AssertionError(f"no checkpoint under {root_prefix} within {timeout}s")


def _running_job(services, before: dict[str, str], timeout: float = 60) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        new = [j for j, status in ray_jobs(services).items() if j not in before and status == "RUNNING"]
        if new:
            return new[0]
        time.sleep(0.5)
    raise AssertionError("no running stage job")


@pytest.mark.parametrize("kill", ["ray_job", "flow_process"])
def test_killed_stage_resumes_from_its_checkpoint(services, tmp_path, kill):
    root = f"s3://alignflow-test/e2e-kill-{kill}"
    args = run_args(root, "--set", "sft.batch.max_steps=200", "--set", "ray.retries=0", "--set", f"name=kill-{kill}")
    before = ray_jobs(services)
    proc = alignflow(services, *args, wait=False)
    job = _running_job(services, before)
    key = _wait_for_checkpoint(f"{root}/sft")
    if kill == "ray_job":
        from ray.job_submission import JobSubmissionClient

        JobSubmissionClient(services["ray"]).stop_job(job)
    else:
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode != 0, out[-2000:]
    deadline = time.time() + 60
    while ray_jobs(services)[job] not in ("STOPPED", "FAILED") and time.time() < deadline:
        time.sleep(0.5)
    assert ray_jobs(services)[job] in ("STOPPED", "FAILED")  # no job outlives its flow run
    assert storage.exists(f"{root}/sft/{key}/MANIFEST.json") is False

    rerun = alignflow(services, *args, "--summary-json", str(tmp_path / "s.json"))
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    (sft,) = json.loads((tmp_path / "s.json").read_text())["stages"]
    metrics = json.loads(storage.read_text(storage.join(sft["uri"], "metrics.json")))
    assert sft["cache_key"] == key and metrics["resumed_from_step"] >= 10
    print(f"killed ({kill}) and resumed from step {metrics['resumed_from_step']}")


def test_bad_input_fails_before_any_job_and_is_not_retried(services, tmp_path):
    before = ray_jobs(services)
    bad_config = alignflow(services, "run", "configs/tiny.yaml", "--set", "sft.optim.lr=-1")
    assert bad_config.returncode == 2 and "sft.optim.lr: Input should be greater than 0" in bad_config.stderr
    assert ray_jobs(services) == before

    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "1+1", "response": "2"}\n' * 40 + '{"prompt": "2+2"}\n')
    bad_data = alignflow(services, *run_args("s3://alignflow-test/e2e-bad", "--set", f"sft.data.path={data}",
                                             "--set", "ray.retries=2", "--set", "ray.retry_delay_s=0"))
    assert bad_data.returncode != 0
    new = set(ray_jobs(services)) - set(before)
    assert len(new) == 1  # one job, no retry
    assert f"{data}:41: missing key 'response'" in bad_data.stdout + bad_data.stderr


def test_registration_works_with_every_tracking_and_storage_pair(services, tmp_path):
    """server x S3 and sqlite x local run in tests/e2e/test_graphs.py; here server x local and sqlite x S3."""
    from mlflow import MlflowClient

    local = alignflow(services, "run", "configs/tiny.yaml", "--set", f"storage.root={tmp_path / 'out'}", "--set", "name=e2e-local",
                      "--set", "sft.batch.max_steps=4", "--set", "sft.logging.eval_every=4", "--summary-json", str(tmp_path / "l.json"))
    assert local.returncode == 0, local.stdout[-3000:] + local.stderr[-3000:]
    reg = json.loads((tmp_path / "l.json").read_text())["registered_model"]
    version = MlflowClient(services["mlflow"]).get_model_version_by_alias("e2e-local", "candidate")
    assert version.version == reg["version"] and version.run_id  # a local folder is registered through the run's artifacts
    exported = alignflow(services, "export", "models:/e2e-local@candidate", str(tmp_path / "serving"))
    assert exported.returncode == 0 and (tmp_path / "serving" / "model.safetensors").exists(), exported.stderr

    db = f"sqlite:///{tmp_path}/mlflow.db"
    s3 = alignflow(services, *run_args("s3://alignflow-test/e2e-run", "--set", "name=e2e-sqlite"), "--summary-json",
                   str(tmp_path / "s.json"), env={"MLFLOW_TRACKING_URI": db})
    assert s3.returncode == 0, s3.stdout[-3000:] + s3.stderr[-3000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["mlflow"]["tracking_uri"] == db
    assert MlflowClient(db).get_model_version_by_alias("e2e-sqlite", "candidate").source.startswith("s3://alignflow-test/e2e-run/sft/")
