"""Graphs through `alignflow run`: Tülu 3 (SFT -> DPO -> GRPO on vLLM -> eval, with a gate) on the session's
real services and S3, and the side-by-side comparison (one SFT -> DPO, IPO, KTO at once -> eval) on a private
Ray head with local storage and sqlite tracking."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

from alignflow.infra import storage

from ..heldout import episodes_gained
from .conftest import ROOT, alignflow
from .test_pipeline import FAST as FAST_SFT

LATER = ["--set", "dpo.batch.max_steps=8", "--set", "dpo.logging.eval_every=4"]
RL_FAST = ["--set", "grpo.batch.max_steps=3", "--set", "grpo.logging.eval_every=3", "--set", "grpo.checkpoint.every_steps=2",
           "--set", "grpo.generation.engine=vllm"]
EVAL_PROMPTS = 64  # held-out prompts each model is evaluated on: its accuracy is a share of these
EVAL_FAST = ["--set", f"defaults.eval.prompts.max_samples={EVAL_PROMPTS}", "--set", "defaults.eval.pairs.max_samples=64",
             "--set", "defaults.eval.nll.max_samples=64"]
ROOT_S3 = "s3://alignflow-test/e2e"  # one SFT for every graph of the session: same settings, same key, one job


def tulu3(services, tmp_path, name: str, *extra: str):
    out = tmp_path / f"{name}.json"
    proc = alignflow(services, "run", "configs/tiny-tulu3.yaml", "--set", f"storage.root={ROOT_S3}", "--set", "name=e2e-tulu3",
                     *FAST_SFT, *LATER, *RL_FAST, *EVAL_FAST, *extra, "--summary-json", str(out))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout + proc.stderr


def test_tulu3_graph_runs_evaluates_and_gates(services, tmp_path):
    from mlflow import MlflowClient

    client = MlflowClient(services["mlflow"])
    first, output = tulu3(services, tmp_path, "first")
    stages = {s["stage"]: s for s in first["stages"]}
    assert list(stages) == ["sft", "dpo", "grpo", "eval"] and [s["kind"] for s in stages.values()] == ["sft", "dpo", "rl", "eval"]
    for name, stage in stages.items():
        assert stage["uri"].startswith(f"{ROOT_S3}/{stage['kind']}/")
        child = client.get_run(stage["mlflow_run_id"])
        assert child.info.run_name == name and child.data.tags["alignflow.kind"] == stage["kind"]
    manifest = json.loads(storage.read_text(storage.join(stages["grpo"]["uri"], "MANIFEST.json")))
    assert manifest["inputs"]["upstream:from"] == {"uri": stages["dpo"]["uri"], "digest": stages["dpo"]["digest"]}
    assert stages["grpo"]["metrics"]["train/logprob_mismatch"] < 2e-4  # vLLM engine and actor agree after each sync

    table = first["eval"]["eval"]
    assert set(table) == {"sft", "dpo", "grpo"} and all(0 <= row["eval/accuracy"] <= 1 for row in table.values())
    for name in ("table.md", "table.csv", "chart.png", "metrics.json", "MANIFEST.json"):
        assert storage.exists(storage.join(stages["eval"]["uri"], name)), name
    assert "| sft |" in output.replace("│", "|") or "sft" in output  # the eval table is printed

    # The gate: promoted iff GRPO's accuracy >= SFT's + 0.05, i.e. at least 4 more of the 64 held-out prompts right
    # (counted in whole episodes: a plain float comparison decides an exact margin by rounding); either way a version
    # exists, tagged with why.
    reg = first["registered_model"]
    gained = episodes_gained(table["grpo"]["eval/accuracy"], table["sft"]["eval/accuracy"], episodes=EVAL_PROMPTS)
    should_pass = gained >= math.ceil(0.05 * EVAL_PROMPTS)
    assert reg["promoted"] == should_pass and first["promoted"] == should_pass
    version = client.get_model_version("e2e-tulu3-grpo", reg["version"])
    assert version.tags["alignflow.gate"] == ("passed" if should_pass else "rejected")
    assert "## Lineage" in version.description and "### dpo (dpo)" in version.description and "## Evaluation `eval`" in version.description
    parent = client.get_run(first["mlflow"]["parent_run_id"])
    assert "graph.mmd" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert "eval/eval/accuracy" not in parent.data.metrics and "eval/grpo/eval/accuracy" in parent.data.metrics
    if not should_pass:
        assert "NOT PROMOTED" in output
        aliases = client.get_registered_model("e2e-tulu3-grpo").aliases
        assert aliases.get("candidate") != reg["version"]


def test_compare_graph_runs_branches_at_once_and_a_failed_branch_fails_only_itself(services, tmp_path):
    """The first run has no session services: `alignflow run` starts Prefect's temporary server and, beside it once
    it knows a stage must run, a private Ray head; tracking is the sqlite store beside local storage. The second
    takes the session's Ray head and Prefect server (the same storage and tracking: what it finds published is the
    first run's). A last, fully cached run without them starts no Ray head."""
    root = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "ALIGNFLOW_RAY"))}
    env["ALIGNFLOW_HOME"] = str(tmp_path / "home")
    env["ALIGNFLOW_SERVICES_HOME"] = str(tmp_path / "no-services")  # none of `services up` in the checkout either
    fast = [*FAST_SFT, "--set", "sft.batch.max_steps=10", "--set", f"storage.root={root}", *EVAL_FAST]  # no accuracy is asserted here
    for stage in ("dpo", "ipo", "kto"):
        fast += ["--set", f"{stage}.batch.max_steps=6", "--set", f"{stage}.logging.eval_every=6"]

    def run(*extra, on: dict[str, str] | None = None):
        cmd = [sys.executable, "-m", "alignflow.cli", "run", "configs/tiny-compare.yaml", *fast, *extra]
        return subprocess.run(cmd, cwd=ROOT, env={**env, **(on or {})}, capture_output=True, text=True, timeout=1200)

    out = tmp_path / "s.json"
    proc = run("--set", "register.enabled=true", "--set", "register.stage=dpo", "--summary-json", str(out))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads(out.read_text())
    stages = {s["stage"]: s for s in summary["stages"]}
    branches = [stages[n] for n in ("dpo", "ipo", "kto")]
    assert max(s["job_started_at"] for s in branches) < min(s["job_ended_at"] for s in branches), (  # all three ran at once
        [(s["stage"], s["job_started_at"], s["job_ended_at"], s["seconds"]) for s in branches], proc.stderr[-6000:])
    assert set(summary["eval"]["eval"]) == {"sft", "dpo", "ipo", "kto"}
    assert stages["ipo"]["cache_key"] != stages["dpo"]["cache_key"]
    reg = summary["registered_model"]  # sqlite tracking x local storage
    assert reg["promoted"] and reg["source"] == storage.join(stages["dpo"]["uri"], "model")
    assert summary["mlflow"]["tracking_uri"].startswith("sqlite:")
    from mlflow import MlflowClient

    tracked = MlflowClient(summary["mlflow"]["tracking_uri"])
    for branch in branches:  # each branch's run has the data files it read (all three log the same ones at once)
        assert {d.dataset.name for d in tracked.get_run(branch["mlflow_run_id"]).inputs.dataset_inputs} == {"train.jsonl", "eval.jsonl"}
    assert proc.stderr.count("starting a local Ray head") == 1  # the branches share it
    # Started as soon as the run knew a stage must run, beside Prefect's temporary server, not after it.
    assert proc.stderr.index("starting a local Ray head") < proc.stderr.index("Starting temporary server"), proc.stderr[-4000:]

    # A broken branch beside a running one: the sibling finishes and publishes, the flow fails naming the broken one.
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1", "completion": "2", "label": true}\n' * 40 + '{"prompt": "2+2"}\n')
    kto_before = set(storage.list_dirs(str(root / "kto")))
    failed = run("--set", "kto.batch.max_steps=5", "--set", "broken.kind=kto", "--set", "broken.from=sft",
                 "--set", f"broken.data.path={bad}", "--set", "eval.models=[sft, broken]", "--set", "ray.retries=2",
                 "--set", "ray.retry_delay_s=0", on={k: services["env"][k] for k in ("ALIGNFLOW_RAY_ADDRESS", "PREFECT_API_URL")})
    text = failed.stdout + failed.stderr
    assert failed.returncode == 2 and "stages failed on bad input: broken (skipped: eval)" in text, text[-4000:]
    assert f"error: {bad}:41: missing key 'completion'" in text
    # A stage added (broken) and one changed (kto) in a finished graph: only they submit Ray jobs; the rest are cache hits.
    assert set(re.findall(r"- (\w+): submitting Ray job", text)) == {"kto", "broken"}, text[-4000:]
    assert all(f"{name}: cache hit at" in text for name in ("sft", "dpo", "ipo")), text[-4000:]
    new_kto = set(storage.list_dirs(str(root / "kto"))) - kto_before
    published = [k for k in new_kto if storage.exists(str(root / "kto" / k / "MANIFEST.json"))]
    assert len(published) == 1  # the kto sibling (5 steps) published; the broken stage did not

    # Without the session's services again, every stage it needs published: cache hits only, answered before
    # Prefect's temporary server or a Ray head would start, and recorded in MLflow as the flow records them.
    again = run("--until", "ipo", "--summary-json", str(tmp_path / "again.json"))
    text = again.stdout + again.stderr
    assert again.returncode == 0 and "starting a local Ray head" not in text, text[-4000:]
    assert "answered without Prefect" in again.stderr and "Starting temporary server" not in text, text[-4000:]
    cached = json.loads((tmp_path / "again.json").read_text())
    assert [(s["stage"], s["cached"]) for s in cached["stages"]] == [("sft", True), ("ipo", True)]
    client = MlflowClient(cached["mlflow"]["tracking_uri"])
    parent = client.get_run(cached["mlflow"]["parent_run_id"])
    assert parent.info.status == "FINISHED" and parent.data.tags["alignflow.prefect"].startswith("no flow run")
    for stage in cached["stages"]:
        hit = client.get_run(stage["mlflow_run_id"]).data.tags
        assert hit["mlflow.parentRunId"] == parent.info.run_id and hit["alignflow.cache_hit"] == "true"
        assert hit["alignflow.source_run_id"] == stages[stage["stage"]]["mlflow_run_id"]  # the run that trained it
    # --flow-run: the same answer through Prefect (its temporary server), for a run that must show in its UI.
    flowed = run("--until", "ipo", "--flow-run")
    assert flowed.returncode == 0 and "answered without Prefect" not in flowed.stderr, flowed.stderr[-4000:]
    assert "ipo: cache hit in" in flowed.stdout + flowed.stderr and "Starting temporary server" in flowed.stderr



LOOP_FAST = ["--set", "defaults.generate.prompts.max_samples=32", "--set", "defaults.generate.shard_size=16",
             "--set", "defaults.generate.generation.n_samples_per_prompt=4", "--set", "online.stages.generate.generation.engine=vllm",
             "--set", "defaults.label.reward=rewards/tiny_tasks.py:partial_credit", "--set", "online.stages.dpo.batch.max_steps=2",
             "--set", "online.stages.dpo.batch.global_batch_size=8", "--set", "online.stages.dpo.batch.micro_batch_size=8",
             "--set", "defaults.dpo.logging.eval_every=2", "--set", "defaults.dpo.data.eval_path=null",
             "--set", "defaults.dpo.data.eval_fraction=0.1", "--set", "defaults.eval.prompts.max_samples=32"]


def test_iterative_dpo_on_vllm_runs_by_rounds_and_more_rounds_rerun_none(services, tmp_path):
    """The iterative-DPO graph with vLLM engines through Prefect -> Ray -> MLflow -> S3; raising the rounds from 1
    to 2 takes round 1 from the cache, and round 2 samples from round 1's model."""
    from mlflow import MlflowClient

    def run(rounds: int, *until: str) -> dict:
        out = tmp_path / f"rounds{rounds}.json"
        proc = alignflow(services, "run", "configs/tiny-iterative-dpo.yaml", "--set", f"storage.root={ROOT_S3}",
                         "--set", "name=e2e-loop", "--set", f"online.rounds={rounds}", *FAST_SFT, *EVAL_FAST, *LOOP_FAST,
                         *until, "--summary-json", str(out))
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        return {s["stage"]: s for s in json.loads(out.read_text())["stages"]}

    one = run(1, "--until", "online.1.dpo")
    assert [s["kind"] for s in one.values()] == ["sft", "generate", "label", "select", "dpo"]
    two = run(2)
    assert all(two[name]["cached"] and two[name]["uri"] == one[name]["uri"] for name in one if name.startswith("online.1."))
    assert not two["online.2.generate"]["cached"] and not two["eval"]["cached"]
    generated = json.loads(storage.read_text(storage.join(two["online.2.generate"]["uri"], "MANIFEST.json")))
    assert generated["inputs"]["upstream:from"]["uri"] == two["online.1.dpo"]["uri"]  # round 2 samples from round 1's model
    assert generated["metrics"]["generate/rows"] == 32 * 4 and "data/part-00001.parquet" in generated["files"]
    trained = json.loads(storage.read_text(storage.join(two["online.2.dpo"]["uri"], "MANIFEST.json")))
    assert trained["inputs"]["upstream:data"]["uri"] == two["online.2.select"]["uri"]
    run_inputs = MlflowClient(services["mlflow"]).get_run(two["online.2.dpo"]["mlflow_run_id"]).inputs.dataset_inputs
    assert any(two["online.2.select"]["uri"] in d.dataset.source for d in run_inputs)  # the dataset stage, as an MLflow input
    assert set(json.loads(storage.read_text(storage.join(two["eval"]["uri"], "metrics.json")))["models"]) == {
        "sft", "online.1.dpo", "online.2.dpo"}


def test_agent_graph_trains_through_its_endpoint(services, tmp_path):
    """configs/tiny-agent.yaml through Prefect -> Ray -> MLflow -> S3: the agent (openai package only) runs its own loop of
    calls against the stage's endpoint inside the Ray job, and GRPO trains on the tokens the engine sampled."""
    from mlflow import MlflowClient

    out = tmp_path / "agent.json"
    proc = alignflow(services, "run", "configs/tiny-agent.yaml", "--set", f"storage.root={ROOT_S3}", "--set", "name=e2e-agent",
                     *FAST_SFT, "--set", "rl.batch.max_steps=2", "--set", "rl.logging.eval_every=2", "--summary-json", str(out))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    stages = {s["stage"]: s for s in json.loads(out.read_text())["stages"]}
    rl, m = stages["rl"], stages["rl"]["metrics"]
    assert m["train/agent/calls"] > 1 and m["train/logprob_mismatch"] < 1e-4 and m["train/agent/dropped_fraction"] == 0
    assert 0 <= m["eval/agent/tool_call"] <= 1 and 0 <= m["eval/reward"] <= 1
    logged = MlflowClient(services["mlflow"]).get_run(rl["mlflow_run_id"]).data.metrics
    assert "train/agent/calls" in logged and "eval/agent/retried" in logged
    # The eval stage runs the same agent against the models before and after: it scores them as the rl stage's own
    # held-out evaluation did at step 0 (the SFT model) and at its last step (the same greedy episodes, HF both ways;
    # one episode of slack for batched greedy decoding).
    table = stages["eval"]["metrics"]
    assert table["sft/eval/agent/reward"] == pytest.approx(m["eval/reward_initial"], abs=0.006)
    assert table["rl/eval/agent/reward"] == pytest.approx(m["eval/reward"], abs=0.006)
    assert table["rl/eval/agent/dropped_fraction"] == 0 and "rl/eval/agent/tool_call" in table
