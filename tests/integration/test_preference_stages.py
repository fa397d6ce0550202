"""The rm, dpo and kto stages on the tiny model, on CPU, for real: learning, scoring, resume,
micro-batch invariance, and bad input stopped before any training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from alignflow.config import ConfigError, load_config
from alignflow.infra import manifest
from alignflow.infra.ports import free_port
from alignflow.stages.common.run import FAIL_AT_STEP_ENV, InjectedFailure

from .conftest import QUIET, ROOT, losses, weights


def stage_main(stage: str):
    return __import__(f"alignflow.stages.{stage}.stage", fromlist=["main"]).main


def config(root: Path | str, *overrides: str):
    return load_config(ROOT / "configs" / "tiny.yaml", [f"storage.root={root}", *QUIET, *overrides])


def eval_rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (ROOT / "data" / name / "eval.jsonl").read_text().splitlines()]


def test_rm_learns_and_its_published_model_scores_the_same(tiny_sft, tiny_rm):
    _, sft = tiny_sft
    _, result = tiny_rm  # configs/tiny.yaml's rm, run with no --input: the SFT output is found from the config
    m = result["metrics"]
    print(f"rm: held-out pairwise accuracy {m['eval/accuracy_initial']:.3f} -> {m['eval/accuracy']:.3f}, "
          f"margin {m['eval/margin']:.2f}, reward mean {m['reward/mean']:.3f} std {m['reward/std']:.3f}")
    assert m["eval/accuracy"] >= 0.9
    published = manifest.verify(result["uri"])
    assert published.meta["inputs"]["upstream:from"]["uri"] == sft["uri"]

    from alignflow.stages.rm.scoring import RewardScorer

    model_dir = str(Path(result["uri"]) / "model")
    config_json = json.loads((Path(model_dir) / "config.json").read_text())
    assert config_json["architectures"] == ["LlamaForSequenceClassification"]
    assert config_json["alignflow_reward_mean"] == pytest.approx(m["reward/mean"])
    scorer = RewardScorer(model_dir)
    rows = eval_rows("preference")
    chosen = scorer.score([r["prompt"] for r in rows], [r["chosen"] for r in rows])
    rejected = scorer.score([r["prompt"] for r in rows], [r["rejected"] for r in rows])
    assert (chosen > rejected).float().mean().item() == pytest.approx(m["eval/accuracy"], abs=1e-6)
    assert chosen.mean().item() == pytest.approx(m["eval/reward/chosen"], abs=1e-4)
    ids = [scorer.tokenizer(scorer.text(rows[0]["prompt"], rows[0]["chosen"]), add_special_tokens=False)["input_ids"]]
    assert scorer.score_ids(ids)[0].item() == pytest.approx(chosen[0].item(), abs=1e-5)  # token ids in, same score
    normalized = RewardScorer(model_dir, normalize=True).score([r["prompt"] for r in rows[:4]], [r["chosen"] for r in rows[:4]])
    torch.testing.assert_close(normalized, (chosen[:4] - m["reward/mean"]) / m["reward/std"])


def test_dpo_margin_and_accuracy_rise_with_reference_computed_once(tiny_sft, tmp_path, capsys):
    _, sft = tiny_sft
    result = stage_main("dpo")(config(tmp_path, "dpo.from=sft"), "dpo", None, {"from": sft["uri"]})
    m = result["metrics"]
    assert "reference log-probs: computed for 2200 rows" in capsys.readouterr().out
    with capsys.disabled():
        print(f"\ndpo: held-out reward accuracy {m['eval/rewards/accuracy_initial']:.3f} -> {m['eval/rewards/accuracy']:.3f}, "
              f"margin {m['eval/rewards/margin_initial']:.3f} -> {m['eval/rewards/margin']:.3f}, reference pass {m['time/reference_s']:.1f}s")
    assert m["eval/rewards/margin"] > 0.3 and m["eval/rewards/accuracy"] >= 0.7
    assert m["eval/loss"] < m["eval/loss_initial"]
    assert "reference/logps.pt" in manifest.verify(result["uri"]).files


def test_kto_rewards_of_desirable_and_undesirable_separate(tiny_sft, tmp_path):
    _, sft = tiny_sft
    m = stage_main("kto")(config(tmp_path, "kto.from=sft"), "kto", None, {"from": sft["uri"]})["metrics"]
    print(f"kto: held-out rewards desirable {m['eval/rewards/desirable']:.3f}, undesirable {m['eval/rewards/undesirable']:.3f} "
          f"(margin {m['eval/rewards/margin_initial']:.3f} -> {m['eval/rewards/margin']:.3f}), KL estimate {m['eval/kl']:.3f}")
    assert m["eval/rewards/margin"] > 0.5 and m["eval/rewards/desirable"] > m["eval/rewards/undesirable"]
    assert m["eval/loss"] < m["eval/loss_initial"]


SHORT = "{s}.batch.max_steps=6 {s}.checkpoint.every_steps=2 {s}.checkpoint.keep_last=2 {s}.data.max_samples=256 {s}.logging.eval_every=3"


LORA = "{s}.lora.rank=8 {s}.lora.alpha=16"


@pytest.mark.parametrize("stage,extra", [("rm", ""), ("dpo", ""), ("kto", ""), ("rm", LORA),
                                         ("dpo", LORA + " {s}.reference=on_the_fly")],
                         ids=["rm", "dpo", "kto", "rm-lora", "dpo-lora-on-the-fly"])
def test_killed_run_resumes_to_the_same_weights(tiny_sft, tmp_path, monkeypatch, capsys, stage, extra):
    """LoRA: checkpoints hold the adapter (and a reward model's score head), not the frozen base."""
    _, sft = tiny_sft
    main, inputs = stage_main(stage), {"from": sft["uri"]}
    overrides = [f"{stage}.from=sft", *SHORT.format(s=stage).split(), *extra.format(s=stage).split()]
    straight = main(config(tmp_path / "a", *overrides), stage, None, inputs)
    cfg = config(tmp_path / "b", *overrides)
    monkeypatch.setenv(FAIL_AT_STEP_ENV, "5")
    with pytest.raises(InjectedFailure):
        main(cfg, stage, None, inputs)
    monkeypatch.delenv(FAIL_AT_STEP_ENV)
    capsys.readouterr()
    resumed = main(cfg, stage, None, inputs)
    assert resumed["resumed_from_step"] == 4
    if stage != "rm" and "on_the_fly" not in extra:
        assert "reference log-probs: loaded from" in capsys.readouterr().out  # not recomputed by the resumed policy
    a, b = weights(straight["uri"]), weights(resumed["uri"])
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert losses(straight["uri"]) == losses(resumed["uri"])


@pytest.mark.parametrize("stage", ["dpo", "kto"])
def test_micro_batches_do_not_change_the_update(tiny_sft, tmp_path, stage):
    """One micro-batch of 32 vs four of 8: the same step losses and weights (KTO's KL reference
    point is taken over the whole step either way)."""
    _, sft = tiny_sft
    common = [f"{stage}.from=sft", f"{stage}.batch.max_steps=3", f"{stage}.data.max_samples=128", f"{stage}.logging.eval_every=100"]
    runs = [stage_main(stage)(config(tmp_path / str(micro), *common, f"{stage}.batch.micro_batch_size={micro}"), stage, None,
                               {"from": sft["uri"]})
            for micro in (32, 8)]
    assert losses(runs[1]["uri"]) == pytest.approx(losses(runs[0]["uri"]), rel=1e-5)
    a, b = weights(runs[0]["uri"]), weights(runs[1]["uri"])
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-5, rtol=1e-4)


def test_kto_on_two_workers_matches_one_worker(tiny_sft, tmp_path):
    """Same global batch over 2 gloo workers vs 1: per-row values and the KL reference point
    are gathered across workers, so the losses and weights agree."""
    _, sft = tiny_sft
    common = ["kto.from=sft", "kto.batch.max_steps=3", "kto.data.max_samples=128", "kto.logging.eval_every=2",
              "kto.batch.micro_batch_size=8", "kto.batch.global_batch_size=32"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "alignflow.stages", "--config", "configs/tiny.yaml", "--stage", "kto",
           "--input", f"from={sft['uri']}"]
    cmd += [a for o in [*QUIET, *common, f"storage.root={tmp_path}/two"] for a in ("--set", o)]
    cmd += ["--summary-json", str(tmp_path / "two.json")]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((tmp_path / "two.json").read_text())
    one = stage_main("kto")(config(tmp_path / "one", *common), "kto", None, {"from": sft["uri"]})
    assert losses(two["uri"]) == pytest.approx(losses(one["uri"]), rel=1e-5)
    assert two["metrics"]["eval/rewards/margin"] == pytest.approx(one["metrics"]["eval/rewards/margin"], rel=1e-4)
    a, b = weights(one["uri"]), weights(two["uri"])
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-5, rtol=1e-4)


def test_bad_input_stops_before_training(tiny_sft, tmp_path):
    _, sft = tiny_sft
    with pytest.raises(ConfigError, match=r"rm: cannot be reached from any model: give `from: <stage>` or `model.name_or_path`"):
        stage_main("rm")(config(tmp_path, "rm.model.name_or_path=null"), "rm")  # no `from:`, and rm.model unset
    with pytest.raises(ConfigError, match=r"stage 'dpo' needs the output of 'sft', which is not published: run those stages "
                                          r"first \(`alignflow run CONFIG --until sft`\)"):
        stage_main("dpo")(config(tmp_path, "dpo.from=sft"), "dpo")
    with pytest.raises(ConfigError, match="input from=/nonexistent: no published stage output there"):
        stage_main("kto")(config(tmp_path, "kto.from=sft"), "kto", None, {"from": "/nonexistent"})
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1", "completion": "2", "label": true}\n{"prompt": "1+2", "completion": "3", "label": "yes"}\n')
    from alignflow.stages.common.data import DataError

    with pytest.raises(DataError, match=rf"{bad}:2: 'label' must be a boolean"):
        stage_main("kto")(config(tmp_path, "kto.from=sft", f"kto.data.path={bad}"), "kto", None, {"from": sft["uri"]})
    assert not (tmp_path / "kto").exists()  # nothing written


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_reward_model_under_zero3_trains_like_zero0(tiny_sft, tmp_path, lora):
    """The new score head is created under ZeRO-3's partitioned init and still starts and trains the same; with LoRA,
    the merged model is published from ZeRO-3's partitioned adapter and head."""
    _, sft = tiny_sft
    common = ["rm.from=sft", "rm.batch.max_steps=4", "rm.data.max_samples=128", "rm.logging.eval_every=2",
              *(LORA.format(s="rm").split() if lora else [])]
    runs = [stage_main("rm")(config(tmp_path / str(z), *common, f"rm.deepspeed.zero_stage={z}"), "rm", None, {"from": sft["uri"]})
            for z in (0, 3)]
    assert losses(runs[1]["uri"]) == pytest.approx(losses(runs[0]["uri"]), rel=1e-5)
    a, b = weights(runs[0]["uri"]), weights(runs[1]["uri"])
    assert "score.weight" in a
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-5, rtol=1e-4)
