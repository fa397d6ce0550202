"""The SFT stage on the tiny model, on CPU, for real: learning, publishing, resume, ZeRO, two workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from alignflow.infra import manifest
from alignflow.infra.ports import free_port
from alignflow.stages.common.checkpoint import tag
from alignflow.stages.sft.stage import FAIL_AT_STEP_ENV, InjectedFailure, main

from .conftest import ROOT, losses, sft_config, weights


def greedy_accuracy(model_dir: str, rows: list[dict]) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    right = 0
    for row in rows:
        ids = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = model.generate(**ids, max_new_tokens=8, do_sample=False)
        right += tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True) == row["response"]
    return right / len(rows)


def test_tiny_sft_learns_publishes_and_is_cached(tiny_sft):
    cfg, result = tiny_sft  # configs/tiny.yaml as shipped: what `make demo` runs
    summary = result["metrics"]
    first, last = summary["eval/loss_initial"], summary["eval/loss"]
    print(f"held-out loss {first:.3f} -> {last:.3f}")
    assert last < first / 3, (first, last)

    published = manifest.verify(result["uri"])
    assert published is not None and "model/model.safetensors" in published.files
    assert {"config.yaml", "metrics.json", "MODEL_CARD.md"} <= set(published.files)
    rows = [json.loads(line) for line in (ROOT / "data/sft/eval.jsonl").read_text().splitlines()[:40]]
    accuracy = greedy_accuracy(str(Path(result["uri"]) / "model"), rows)
    print(f"greedy accuracy on 40 held-out prompts: {accuracy:.2f}")
    # 0.35 here (the untrained model: 0): the noisy reversal demonstrations (data/README.md) cap what greedy
    # decoding gets right; word reversal is learned first, addition takes longer.
    assert accuracy >= 0.3

    again = main(cfg, "sft")  # a finished stage is not trained twice
    assert again["cached"] and again["uri"] == result["uri"]


def test_killed_run_resumes_to_the_same_weights(tmp_path, monkeypatch, caplog):
    common = ("sft.batch.max_steps=12", "sft.checkpoint.every_steps=3", "sft.checkpoint.keep_last=2")
    straight = main(sft_config(tmp_path / "a", *common), "sft")

    cfg = sft_config(tmp_path / "b", *common)
    monkeypatch.setenv(FAIL_AT_STEP_ENV, "8")
    with pytest.raises(InjectedFailure):
        main(cfg, "sft")
    monkeypatch.delenv(FAIL_AT_STEP_ENV)
    stage = Path(tmp_path / "b/out/sft") / straight["cache_key"]
    assert sorted(p.name for p in (stage / "checkpoints").iterdir()) == [tag(3), tag(6)]  # keep_last=2
    assert manifest.read_manifest(str(stage)) is None  # not published

    # Corrupt the newest checkpoint: resume must skip it (warning) and use step 3.
    shard = next(p for p in (stage / "checkpoints" / tag(6)).rglob("*model_states.pt"))
    shard.write_bytes(shard.read_bytes()[:100])
    resumed = main(cfg, "sft")
    assert resumed["resumed_from_step"] == 3
    assert "skipping checkpoint step_00000006" in caplog.text

    a, b = weights(straight["uri"]), weights(resumed["uri"])
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert losses(straight["uri"]) == losses(resumed["uri"])


def test_lora_sft_learns_from_the_random_base(tmp_path):
    """LoRA adapts a trained model: on builtin:tiny's random weights a rank-16 update per matrix learns far less than
    full training (measured over the full 290 steps: held-out loss 4.68 -> 3.68 with LoRA, -> 0.57 in full), so the
    full test's threshold (a third of the start) does not apply; 60 steps must still take off a tenth. ZeRO-2."""
    result = main(sft_config(tmp_path, "sft.lora.rank=16", "sft.optim.lr=1e-2", "sft.batch.max_steps=60",
                             "sft.deepspeed.zero_stage=2", "sft.checkpoint.every_steps=30"), "sft")
    m = result["metrics"]
    print(f"LoRA sft: held-out loss {m['eval/loss_initial']:.3f} -> {m['eval/loss']:.3f}")
    assert m["eval/loss"] < 0.9 * m["eval/loss_initial"]
    assert m["params/trainable"] < m["params/total"] / 5
    assert {"adapter/adapter_model.safetensors", "model/model.safetensors"} <= set(manifest.verify(result["uri"]).files)


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_zero_stages_train_like_plain_data_parallel(tmp_path, zero_stage):
    steps = ("sft.batch.max_steps=10",)
    plain = main(sft_config(tmp_path / "z0", *steps), "sft")
    zero = main(sft_config(tmp_path / f"z{zero_stage}", *steps, f"sft.deepspeed.zero_stage={zero_stage}"), "sft")
    assert losses(zero["uri"]) == pytest.approx(losses(plain["uri"]), rel=1e-5)
    a, b = weights(plain["uri"]), weights(zero["uri"])
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("lora", [[], ["sft.lora.rank=8", "sft.optim.lr=1e-2"]], ids=["full", "lora"])
def test_two_workers_match_one_worker(tmp_path, lora):
    """Same global batch over 2 gloo workers (accumulation 1) vs 1 worker (accumulation 2), with packing."""
    overrides = ["sft.batch.max_steps=8", "sft.data.packing=true", "sft.batch.global_batch_size=8",
                 "sft.batch.micro_batch_size=4", *lora, "sft.logging.progress=false", f"storage.root={tmp_path}/two"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "alignflow.stages", "--config", "configs/tiny.yaml",
           "--stage", "sft"]
    cmd += [a for o in overrides for a in ("--set", o)] + ["--summary-json", str(tmp_path / "two.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((tmp_path / "two.json").read_text())
    one = main(sft_config(tmp_path / "one", *overrides[:-2]), "sft")
    print("1 worker:", losses(one["uri"]), "\n2 workers:", losses(two["uri"]))
    assert losses(two["uri"]) == pytest.approx(losses(one["uri"]), rel=1e-5)
    a, b = weights(one["uri"]), weights(two["uri"])
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-5, rtol=1e-4)
