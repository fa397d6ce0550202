"""The dpo, kto and full (up to rm) pipelines through `alignflow run`, on the session's real
services, with storage on the S3 API server: later stages download the SFT model from S3."""

from __future__ import annotations

import json

from alignflow.infra import storage

from .conftest import alignflow, ray_jobs
from .test_pipeline import FAST as FAST_SFT
from .test_pipeline import run_args

LATER = ["--set", "rm.batch.max_steps=12", "--set", "dpo.batch.max_steps=8", "--set", "kto.batch.max_steps=8",
         "--set", "rm.logging.eval_every=6", "--set", "dpo.logging.eval_every=4", "--set", "kto.logging.eval_every=4"]


def test_dpo_kto_and_full_pipelines_share_one_sft_stage(services, tmp_path):
    from mlflow import MlflowClient

    root, client = "s3://alignflow-test/e2e-pref", MlflowClient(services["mlflow"])
    summaries = {}
    for pipeline in ("dpo", "kto", "full"):
        extra = ["--set", f"pipeline={pipeline}", "--set", "name=e2e-pref", *LATER]
        extra += ["--set", "stop_after=rm"] if pipeline == "full" else []
        out = tmp_path / f"{pipeline}.json"
        proc = alignflow(services, *run_args(root, *extra), "--summary-json", str(out))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        summaries[pipeline] = json.loads(out.read_text())

    stages = {p: [(s["stage"], s["cached"]) for s in summary["stages"]] for p, summary in summaries.items()}
    assert stages == {"dpo": [("sft", False), ("dpo", False)], "kto": [("sft", True), ("kto", False)],
                      "full": [("sft", True), ("rm", False)]}
    sft = summaries["dpo"]["stages"][0]
    for pipeline, stage in (("dpo", "dpo"), ("kto", "kto"), ("full", "rm")):
        result = summaries[pipeline]["stages"][1]
        manifest = json.loads(storage.read_text(storage.join(result["uri"], "MANIFEST.json")))
        assert manifest["inputs"]["upstream:sft"] == {"uri": sft["uri"], "digest": sft["digest"]}
        assert result["uri"].startswith(f"{root}/e2e-pref/{stage}/")
        child = client.get_run(result["mlflow_run_id"])
        assert child.data.tags["alignflow.stage"] == stage and child.data.tags["ray.job_id"] == result["ray_job_id"]
        assert len(client.get_metric_history(child.info.run_id, "loss")) == (12 if stage == "rm" else 8)

    dpo_metrics = summaries["dpo"]["stages"][1]["metrics"]
    assert "time/reference_s" in dpo_metrics and "eval/rewards/margin" in dpo_metrics
    assert summaries["dpo"]["registered_model"]["source"] == storage.join(summaries["dpo"]["stages"][1]["uri"], "model")
    assert summaries["kto"]["registered_model"]["source"] == storage.join(summaries["kto"]["stages"][1]["uri"], "model")
    assert summaries["full"]["registered_model"] is None  # stop_after=rm: an intermediate model is not a candidate
    rm_config = json.loads(storage.read_text(storage.join(summaries["full"]["stages"][1]["uri"], "model", "config.json")))
    assert rm_config["architectures"] == ["LlamaForSequenceClassification"] and "alignflow_reward_std" in rm_config

    jobs = ray_jobs(services)
    again = alignflow(services, *run_args(root, "--set", "pipeline=dpo", "--set", "name=e2e-pref", *LATER),
                      "--summary-json", str(tmp_path / "again.json"))
    assert again.returncode == 0, again.stdout[-3000:]
    assert [s["cached"] for s in json.loads((tmp_path / "again.json").read_text())["stages"]] == [True, True]
    assert ray_jobs(services) == jobs


RL_FAST = ["--set", "rl.batch.max_steps=3", "--set", "rl.logging.eval_every=3", "--set", "rl.checkpoint.every_steps=2"]


def test_grpo_and_full_ppo_pipelines_run_rl_on_ray_worker_groups(services, tmp_path):
    """grpo = SFT -> GRPO with the shipped reward function, generating with the vLLM engine (its CPU build);
    full = SFT -> RM -> PPO (critic, reward model), generating with HF. The RL job starts its worker groups
    inside the session's Ray cluster and reads the SFT and RM models from S3."""
    from mlflow import MlflowClient

    root, client = "s3://alignflow-test/e2e-pref", MlflowClient(services["mlflow"])
    runs = {}
    grpo = ["configs/tiny.yaml", "--set", "pipeline=grpo", "--set", "rl.generation.engine=vllm"]
    for name, args in (("grpo", grpo), ("full", ["configs/tiny-ppo.yaml"])):
        out = tmp_path / f"{name}.json"
        proc = alignflow(services, "run", *args, "--set", f"storage.root={root}", "--set", "name=e2e-pref", *FAST_SFT, *LATER,
                         *RL_FAST, "--summary-json", str(out))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[name] = json.loads(out.read_text())
    assert [s["stage"] for s in runs["grpo"]["stages"]] == ["sft", "rl"]
    assert [s["stage"] for s in runs["full"]["stages"]] == ["sft", "rm", "rl"] and runs["full"]["stages"][0]["cached"]
    for name, summary in runs.items():
        rl = summary["stages"][-1]
        assert not rl["cached"] and summary["registered_model"]["source"] == storage.join(rl["uri"], "model")
        child = client.get_run(rl["mlflow_run_id"])
        metrics = set(child.data.metrics)
        assert {"reward_mean", "policy_loss", "kl", "entropy", "phase_train_s", "gen_tokens_per_s"} <= metrics, metrics
        manifest = json.loads(storage.read_text(storage.join(rl["uri"], "MANIFEST.json")))
        assert "upstream:sft" in manifest["inputs"] and ("upstream:rm" in manifest["inputs"]) == (name == "full")
        assert any(f.startswith("model/") for f in manifest["files"])
    assert "value_loss" in runs["full"]["stages"][-1]["metrics"]
    assert runs["grpo"]["stages"][-1]["metrics"]["logprob_mismatch"] < 2e-4  # vLLM engine and actor agree after each sync
