"""`alignflow run` against a real Ray head, Prefect server, MLflow server and S3 API server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from alignflow.infra import storage

from alignflow.infra.tracking import STAGE_URI_TAG

from ..serving import greedy, logged_model, predict_in_fresh_process
from .conftest import ROOT, SECRET, alignflow, ray_jobs

FAST = ["--set", "sft.batch.max_steps=30", "--set", "sft.checkpoint.every_steps=10", "--set", "sft.logging.eval_every=10"]


def run_args(root: str, *extra: str) -> list[str]:
    return ["run", "configs/tiny.yaml", "--set", f"storage.root={root}", *FAST, *extra]


def test_run_then_rerun_is_fully_cached(services, tmp_path):
    from mlflow import MlflowClient

    root = "s3://alignflow-test/e2e-run"
    jobs_before = ray_jobs(services)
    first = alignflow(services, *run_args(root, "--set", "name=e2e-run"), "--summary-json", str(tmp_path / "1.json"),
                      env={"HF_TOKEN": HF_CANARY})
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    summary = json.loads((tmp_path / "1.json").read_text())
    (sft,) = summary["stages"]
    assert not sft["cached"] and sft["ray_job_id"] in set(ray_jobs(services)) - set(jobs_before)
    assert sft["uri"].startswith(f"{root}/sft/")
    rows = {k: v for k, v in sft["metrics"].items() if k.startswith("data/train/")}  # row accounting reaches the summary
    assert rows["data/train/read"] == rows["data/train/used"] > 0 and rows["data/train/skipped"] == 0, rows
    n = f"{rows['data/train/read']:.0f}"
    assert f"{n} rows read, {n} used" in " ".join((first.stdout + first.stderr).split())  # the job's console line, in Prefect's log
    assert "forked from the warm stage server" in first.stdout + first.stderr  # the head's warm server ran the job (infra/warm.py)

    with urllib.request.urlopen(f"{services['prefect']}/flow_runs/{summary['prefect']['flow_run_id']}", timeout=10) as r:
        flow_run = json.loads(r.read())
    assert flow_run["name"] == summary["prefect"]["flow_run_name"] and flow_run["name"].startswith("e2e-run-")
    assert {"alignflow", "pipeline:e2e-run", "stage:sft"} <= set(flow_run["tags"])
    query = json.dumps({"artifacts": {"flow_run_id": {"any_": [flow_run["id"]]}}}).encode()
    with urllib.request.urlopen(urllib.request.Request(f"{services['prefect']}/artifacts/filter", data=query, method="POST",
                                                       headers={"Content-Type": "application/json"}), timeout=10) as r:
        (artifact,) = json.loads(r.read())
    assert artifact["key"] == "stage-sft" and artifact["type"] == "markdown"
    assert sft["uri"] in artifact["data"] and "| data/train/read |" in artifact["data"] and "| eval/loss |" in artifact["data"]

    client = MlflowClient(services["mlflow"])
    parent = client.get_run(summary["mlflow"]["parent_run_id"])
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True).stdout.strip()
    assert parent.data.tags["mlflow.source.git.commit"] == head and parent.data.tags["mlflow.user"]  # MLflow's standard tags
    assert client.get_experiment(parent.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    (child,) = children
    assert child.data.tags["alignflow.stage"] == "sft" and child.data.tags["ray.job_id"] == sft["ray_job_id"]
    assert child.data.tags["alignflow.cache_key"] == sft["cache_key"]
    assert len(client.get_metric_history(child.info.run_id, "train/loss")) == 30
    assert child.data.metrics["data/train/read"] == rows["data/train/read"]  # one naming scheme: `/` as everywhere else
    assert "eval/loss" in child.data.metrics and "eval_loss" not in child.data.metrics
    assert any(k.startswith("system/cpu_utilization") for k in child.data.metrics)  # system metrics, sampled in the job
    datasets = {d.dataset.name: d for d in child.inputs.dataset_inputs}
    assert set(datasets) == {"train.jsonl", "eval.jsonl"}
    assert datasets["train.jsonl"].dataset.digest == storage.fingerprint(str(ROOT / "data" / "sft" / "train.jsonl"))[:36]
    assert {t.value for t in datasets["train.jsonl"].tags} == {"training"}
    assert child.data.params["data.train.rows"] == f"{rows['data/train/read']:.0f} rows read, {rows['data/train/used']:.0f} used"
    artifacts = {a.path for a in client.list_artifacts(child.info.run_id)}
    assert {"config.yaml", "MANIFEST.json", "MODEL_CARD.md", "curves.png", "metrics.json"} <= artifacts
    everything = json.dumps([parent.data.params, parent.data.tags, child.data.params, child.data.tags])
    assert SECRET not in everything and SECRET not in first.stdout + first.stderr
    assert_no_credentials_leaked(services, [root, "s3://alignflow-test/mlflow"], first.stdout + first.stderr)

    version = client.get_model_version_by_alias("e2e-run-sft", "candidate")  # <config name>-<registered stage>
    assert version.tags[STAGE_URI_TAG] == sft["uri"] and version.tags["alignflow.cache_key"] == sft["cache_key"]
    assert child.info.run_name == "sft" and child.data.tags["alignflow.kind"] == "sft"
    # The version is an MLflow model (server x S3): a fresh process with only MLflow loads it and generates.
    assert logged_model(client, version).artifact_location.startswith("mlflow-artifacts:/")
    served = predict_in_fresh_process([(services["mlflow"], "models:/e2e-run-sft@candidate")], env={**os.environ, **services["env"]})
    assert served["models:/e2e-run-sft@candidate"]["text"] == greedy(str(storage.download_dir(storage.join(sft["uri"], "model"),
                                                                                           tmp_path / "candidate")))

    exported = alignflow(services, "export", "models:/e2e-run-sft@candidate", str(tmp_path / "serving"))
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "serving" / "model.safetensors").exists() and (tmp_path / "serving" / "tokenizer.json").exists()

    jobs_mid = ray_jobs(services)
    start = time.time()
    second = alignflow(services, *run_args(root, "--set", "name=e2e-run"), "--summary-json", str(tmp_path / "2.json"))
    wall = time.time() - start
    assert second.returncode == 0, second.stdout[-3000:]
    again = json.loads((tmp_path / "2.json").read_text())
    assert [s["cached"] for s in again["stages"]] == [True]
    assert {k: v for k, v in again["stages"][0]["metrics"].items() if k.startswith("data/train/")} == rows
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

    # A same-size change to the published weights: no cache answers for it; the stage runs again from its last
    # checkpoint and publishes the very weights the first run did.
    def weights_sha() -> str:
        return json.loads(storage.read_text(storage.join(sft["uri"], "MANIFEST.json")))["files"]["model/model.safetensors"]["sha256"]

    published = weights_sha()
    fs, weights = storage.filesystem(storage.join(sft["uri"], "model", "model.safetensors"))
    blob = bytearray(fs.cat_file(weights))
    blob[-64:-48] = bytes(255 - b for b in blob[-64:-48])
    fs.pipe_file(weights, bytes(blob))
    fourth = alignflow(services, *run_args(root, "--set", "name=e2e-run"), "--summary-json", str(tmp_path / "4.json"))
    assert fourth.returncode == 0, fourth.stdout[-3000:]
    (stage4,) = json.loads((tmp_path / "4.json").read_text())["stages"]
    assert not stage4["cached"] and "model/model.safetensors does not match its sha256" in fourth.stdout + fourth.stderr
    assert json.loads(storage.read_text(storage.join(sft["uri"], "metrics.json")))["resumed_from_step"] == 20
    assert weights_sha() == published and storage.sha256_of(storage.join(sft["uri"], "model", "model.safetensors")) == published


HF_CANARY = "hf_af-e2e-canary-41c0de"


def leftover_credentials() -> list:
    """Credentials folders whose process is gone (a live run elsewhere on this machine may hold its own)."""
    from alignflow.infra.lease import owner_gone

    return [f for f in Path(tempfile.gettempdir()).glob("alignflow-secrets-*") if owner_gone(f)]


def assert_no_credentials_leaked(services, roots: list[str], console: str) -> None:
    """The run's S3 secret and HF token (the job needed the first to publish) are nowhere: not in the
    Jobs API, Ray's session logs, the Prefect or MLflow databases and logs, storage or the console."""
    canaries = [SECRET.encode(), HF_CANARY.encode()]
    with urllib.request.urlopen(services["ray"] + "/api/jobs/") as response:
        places = {"Jobs API": response.read(), "console": console.encode()}
    for name, home in services["homes"].items():
        for path in Path(home).rglob("*"):
            if path.is_file() and not path.is_symlink() and path.stat().st_size < 200 << 20:
                places[f"{name}: {path}"] = path.read_bytes()
    for root in roots:
        for rel in storage.walk_files(root):
            fs, path = storage.filesystem(storage.join(root, rel))
            places[storage.join(root, rel)] = fs.cat_file(path)
    leaks = [where for where, blob in places.items() if any(c in blob for c in canaries)]
    assert not leaks, f"credentials found in: {leaks[:10]}"
    assert len(places) > 50  # the scan saw the logs, databases and objects
    assert not leftover_credentials()  # the job's credentials file is gone (and any an earlier, killed run left)


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


@pytest.mark.parametrize("kill", ["flow_sigkill"])
def test_killed_stage_resumes_from_its_checkpoint(services, tmp_path, kill):
    """Kill the flow's process with SIGKILL (it can do nothing then: the job sees its lease go unrenewed and stops
    itself); the re-run resumes from the checkpoint as the one writer. (A killed Ray job and its resume, by a Prefect
    flow-run retry: tests/e2e/test_deployments.py.)"""
    from mlflow import MlflowClient

    root = f"s3://alignflow-test/e2e-kill-{kill}"
    args = run_args(root, "--set", "sft.batch.max_steps=200", "--set", "ray.retries=0", "--set", f"name=kill-{kill}",
                    "--set", "ray.lease_timeout_s=5")  # the job stops itself ~5-8 s after the kill, long before step 200
    before = ray_jobs(services)
    proc = alignflow(services, *args, wait=False)
    job = _running_job(services, before)
    key = _wait_for_checkpoint(f"{root}/sft")
    if kill == "ray_job":
        from ray.job_submission import JobSubmissionClient

        JobSubmissionClient(services["ray"]).stop_job(job)
    else:
        proc.send_signal(signal.SIGKILL)
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
    assert not storage.exists(f"{root}/sft/{key}/job/LEASE.json")  # released
    assert not leftover_credentials()  # the killed run's credentials folder too
    if kill == "flow_sigkill":
        from ray.job_submission import JobSubmissionClient

        assert "stopping this stage job: the run that started this job stopped renewing" in JobSubmissionClient(services["ray"]).get_job_logs(job)
        client = MlflowClient(services["mlflow"])
        runs = client.search_runs([client.get_experiment_by_name("alignflow").experiment_id], "tags.`alignflow.name` = 'kill-flow_sigkill'")
        killed = [r for r in runs if r.info.status == "FAILED"]
        assert len(killed) == 1 and "is gone" in killed[0].data.tags["alignflow.failure"]  # not left RUNNING
    print(f"killed ({kill}) and resumed from step {metrics['resumed_from_step']}")


def test_sigkilled_run_leaves_no_process_of_its_private_ray_head(services, tmp_path):
    import os
    import sys

    import psutil

    from .conftest import ROOT, cmdline

    env = {k: v for k, v in {**os.environ, **services["env"]}.items() if k != "ALIGNFLOW_RAY_ADDRESS"}
    proc = subprocess.Popen([sys.executable, "-m", "alignflow.cli", *run_args(str(tmp_path / "out"), "--set", "sft.batch.max_steps=200")],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, ours = time.time() + 180, []
    while time.time() < deadline and not any("raylet" in " ".join(cmdline(p)) for p in ours):
        time.sleep(1)
        ours = psutil.Process(proc.pid).children(recursive=True)
    time.sleep(3)
    ours = psutil.Process(proc.pid).children(recursive=True)
    assert len(ours) > 5, [p.cmdline()[:2] for p in ours]  # the head's processes
    (home,) = {Path(a.split("=", 1)[1]) for p in ours for a in cmdline(p) if a.startswith("--temp-dir=")}
    assert (home / "ray.log").exists()
    proc.kill()
    proc.wait()
    _, alive = psutil.wait_procs(ours, timeout=60)
    assert not alive, [p.cmdline()[:3] for p in alive]
    deadline = time.time() + 30  # the watchdog removes the head's folder (logs, sockets) once its processes are gone
    while time.time() < deadline and home.exists():
        time.sleep(0.5)
    assert not home.exists(), sorted(p.name for p in home.iterdir())


def test_two_runs_of_one_stage_make_one_writer(services, tmp_path):
    """At once, on a fresh sqlite store and storage root: one trains, the other waits for it and takes its
    result; the store's first-time setup is not raced."""
    db = f"sqlite:///{tmp_path}/mlflow.db"
    args = run_args(f"s3://alignflow-test/e2e-twice-{tmp_path.name}", "--set", "sft.batch.max_steps=10", "--set", "name=twice")
    before = ray_jobs(services)
    procs = [alignflow(services, *args, "--summary-json", str(tmp_path / f"{i}.json"), env={"MLFLOW_TRACKING_URI": db}, wait=False)
             for i in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[-2000:] for o in outs]
    stages = [json.loads((tmp_path / f"{i}.json").read_text())["stages"][0] for i in range(2)]
    assert sorted(s["cached"] for s in stages) == [False, True] and stages[0]["digest"] == stages[1]["digest"]
    assert len(set(ray_jobs(services)) - set(before)) == 1
    assert any("another run is writing" in o for o in outs)
    # The job logged its artifacts to the sqlite store's artifact root on S3 (MLflow's own S3 client, endpoint
    # and credentials from the job's environment).
    from mlflow import MlflowClient

    storage.export_s3_endpoint()  # this process's MLflow client reads the S3 server's address from MLFLOW_S3_ENDPOINT_URL
    trained = next(s for s in stages if not s["cached"])
    logged = {a.path for a in MlflowClient(db).list_artifacts(trained["mlflow_run_id"])}
    assert {"MANIFEST.json", "metrics.json", "config.yaml"} <= logged


def test_bad_input_fails_before_any_job_and_is_not_retried(services, tmp_path):
    before = ray_jobs(services)
    bad_config = alignflow(services, "run", "configs/tiny.yaml", "--set", "sft.optim.lr=-1")
    assert bad_config.returncode == 2 and "sft.optim.lr: Input should be greater than 0" in bad_config.stderr
    reward = tmp_path / "reward.py"
    reward.write_text("def score(completions, **kw):\n    return [1.0 for c in completions\n")
    for override, message in [("sft.model.name_or_path=builtin:nope", "unknown built-in model 'builtin:nope'"),
                              ("sft.model.name_or_path=./no/such/model", "local model folder './no/such/model' does not exist"),
                              (f"rl.reward.function={reward}:score", f"{reward}:2: '[' was never closed")]:
        bad = alignflow(services, "run", "configs/tiny-grpo.yaml", "--set", override)
        assert bad.returncode == 2 and message in bad.stderr and len(bad.stderr.splitlines()) < 10, bad.stderr
    assert ray_jobs(services) == before

    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "1+1", "response": "2"}\n' * 40 + '{"prompt": "2+2"}\n')
    bad_data = alignflow(services, *run_args("s3://alignflow-test/e2e-bad", "--set", f"sft.data.path={data}",
                                             "--set", "ray.retries=2", "--set", "ray.retry_delay_s=0"))
    assert bad_data.returncode == 2  # the run's own exit code says: bad input
    (job,) = set(ray_jobs(services)) - set(before)  # one job, no retry
    error = bad_data.stderr[bad_data.stderr.index("error: stages failed on bad input: sft"):]
    assert f"error: {data}:41: missing key 'response'" in error and len(error.splitlines()) < 8, error
    saved = error.split("full log: ")[1].split()[0]
    assert saved.endswith(f"/job/{job}.log") and f"{data}:41: missing key 'response'" in storage.read_text(saved)


def test_registration_works_with_every_tracking_and_storage_pair(services, tmp_path):
    """server x S3 and sqlite x local run in tests/e2e/test_graphs.py; here server x local and sqlite x S3."""
    from mlflow import MlflowClient

    local = alignflow(services, "run", "configs/tiny.yaml", "--set", f"storage.root={tmp_path / 'out'}", "--set", "name=e2e-local",
                      "--set", "sft.batch.max_steps=4", "--set", "sft.logging.eval_every=4", "--summary-json", str(tmp_path / "l.json"))
    assert local.returncode == 0, local.stdout[-3000:] + local.stderr[-3000:]
    reg = json.loads((tmp_path / "l.json").read_text())["registered_model"]
    server = MlflowClient(services["mlflow"])
    version = server.get_model_version_by_alias("e2e-local-sft", "candidate")
    assert version.version == reg["version"] and version.run_id  # the model's files went to the server's artifact store
    assert logged_model(server, version).artifact_location.startswith("mlflow-artifacts:/")
    exported = alignflow(services, "export", "models:/e2e-local-sft@candidate", str(tmp_path / "serving"))
    assert exported.returncode == 0 and (tmp_path / "serving" / "model.safetensors").exists(), exported.stderr

    db = f"sqlite:///{tmp_path}/mlflow.db"
    s3 = alignflow(services, *run_args("s3://alignflow-test/e2e-run", "--set", "name=e2e-sqlite"), "--summary-json",
                   str(tmp_path / "s.json"), env={"MLFLOW_TRACKING_URI": db})
    assert s3.returncode == 0, s3.stdout[-3000:] + s3.stderr[-3000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["mlflow"]["tracking_uri"] == db
    on_s3 = MlflowClient(db).get_model_version_by_alias("e2e-sqlite-sft", "candidate")
    assert on_s3.tags[STAGE_URI_TAG].startswith("s3://alignflow-test/e2e-run/sft/")
    assert logged_model(MlflowClient(db), on_s3).artifact_location.startswith("s3://alignflow-test/e2e-run/mlflow-artifacts/")
    served = predict_in_fresh_process([(services["mlflow"], "models:/e2e-local-sft@candidate"), (db, "models:/e2e-sqlite-sft@candidate")],
                                      env={**os.environ, **services["env"]})
    assert served["models:/e2e-local-sft@candidate"]["text"] == greedy(reg["source"])  # local storage: the published folder
    # Artifacts go beside the S3 storage, not to ./mlruns under the current directory.
    (experiment,) = MlflowClient(db).search_experiments(filter_string="name = 'alignflow'")
    assert experiment.artifact_location == "s3://alignflow-test/e2e-run/mlflow-artifacts"
    runs = MlflowClient(db).search_runs([experiment.experiment_id])
    assert runs and all(r.info.artifact_uri.startswith("s3://alignflow-test/e2e-run/mlflow-artifacts/") for r in runs)
