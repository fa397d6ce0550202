"""The rl stage on the tiny model, on CPU, with real Ray worker groups: GRPO learns the tiny
tasks, PPO with a critic raises the reward model's score, Dr. GRPO runs with dynamic sampling, a killed run
resumes exactly (also one step off-policy, with asynchronous rollout), and bad input stops it."""

from __future__ import annotations


from pathlib import Path

import numpy as np
import pytest
import torch

from alignflow.config import load_config
from alignflow.stages.common.run import FAIL_AT_STEP_ENV, InjectedFailure
from alignflow.stages.rl.rewards import RewardError
from alignflow.stages.rl.stage import main

from ..heldout import episodes_gained
from .conftest import QUIET, ROOT, history, weights

pytestmark = pytest.mark.usefixtures("ray_session")  # the session's private Ray


def config(root, *overrides, file="tiny.yaml"):
    """`file` with an rl stage from its sft stage (tiny.yaml: its rl defaults, GRPO; tiny-ppo.yaml has one already)."""
    return load_config(ROOT / "configs" / file, [f"storage.root={root}", *QUIET, "rl.from=sft", *overrides])


def test_grpo_raises_held_out_accuracy(tiny_sft, tmp_path):
    _, sft = tiny_sft
    result = main(config(tmp_path), "rl", None, {"from": sft["uri"]})  # configs/tiny.yaml's rl defaults as shipped
    m, steps = result["metrics"], [r for r in history(result["uri"]) if "reward/mean" in r]
    first, last = sum(r["reward/mean"] for r in steps[:10]) / 10, sum(r["reward/mean"] for r in steps[-10:]) / 10
    print(f"\ngrpo: held-out greedy accuracy {m['eval/reward_initial']:.3f} -> {m['eval/reward']:.3f}; "
          f"training reward (mean of 10 steps) {first:.3f} -> {last:.3f}")
    assert episodes_gained(m["eval/reward"], m["eval/reward_initial"]) >= 20  # +0.10
    assert last > first
    # hybrid: the actor generated, so its log-probs were the generator's and no step needed the pass
    assert all(r["train/old_logprob_pass"] == 0 and r["train/logprob_mismatch"] < 1e-5 for r in steps)


def test_the_old_logprob_pass_comes_back_when_the_engine_drifts_from_the_actor(tiny_sft, tmp_path, monkeypatch):
    """A separate rollout worker whose weight push is switched off keeps sampling from the SFT weights while the actor
    moves. Step 1 samples from the actor's own weights: no pass. From step 2 the first micro-batch measures the drift,
    past the tolerance, and the pass runs over the other optimizer step's 64 rows: the first micro-batch's own were
    just scored at the old weights."""
    from alignflow.stages.rl.stage import Roles

    _, sft = tiny_sft
    monkeypatch.setattr(Roles, "sync_weights", lambda self: None)
    result = main(config(tmp_path, "rl.workers.hybrid=false", "rl.batch.max_steps=3", "rl.logging.eval_every=100",
                         "rl.optim.lr=1e-3", "rl.policy.old_logprob_tolerance=1e-4"), "rl", None, {"from": sft["uri"]})
    steps = [r for r in history(result["uri"]) if "train/policy_loss" in r]
    drift = [r["train/logprob_mismatch"] for r in steps]
    print(f"\nengine left behind: logprob mismatch per step {[f'{x:.1e}' for x in drift]}")
    assert [r["train/old_logprob_pass"] for r in steps] == [0.0, 1.0, 1.0]
    assert [r["train/old_logprob_rows"] for r in steps] == [0.0, 64.0, 64.0]
    assert drift[0] < 1e-5 and min(drift[1:]) > 1e-4


def test_grpo_in_bf16_measures_its_rounding_gap_and_publishes_bf16(tiny_sft, tmp_path):
    """bf16 weights under DeepSpeed's bf16 engine. Sampling and training score the same tokens in batches of other
    shapes, which in bf16 round differently (~1e-3 a token here, against <1e-5 in fp32): the guard measures that gap
    every step and runs the old-log-prob pass exactly when it passes `policy.old_logprob_tolerance` (1e-3)."""
    from safetensors import safe_open

    _, sft = tiny_sft
    result = main(config(tmp_path, "rl.model.dtype=bfloat16", "rl.deepspeed.precision=bf16", "rl.batch.max_steps=4",
                         "rl.logging.eval_every=100"), "rl", None, {"from": sft["uri"]})
    steps = [r for r in history(result["uri"]) if "train/policy_loss" in r]
    gap = [r["train/logprob_mismatch"] for r in steps]
    print(f"\nbf16 grpo: logprob mismatch per step {[f'{x:.1e}' for x in gap]}, "
          f"old-log-prob pass {[r['train/old_logprob_pass'] for r in steps]}")
    assert len(steps) == 4 and all(torch.isfinite(torch.tensor(v)) for r in steps for v in r.values())
    assert all(1e-5 < x < 1e-2 for x in gap)  # bf16 rounding: there, yet small
    assert [r["train/old_logprob_pass"] for r in steps] == [float(x > 1e-3) for x in gap]
    assert [r["train/old_logprob_rows"] for r in steps] == [64.0 * (x > 1e-3) for x in gap]  # 128 rows, 64 scored already
    with safe_open(str(Path(result["uri"]) / "model" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


def test_ppo_with_critic_raises_the_reward_model_score(tiny_sft, tiny_rm, tmp_path):
    (_, sft), (_, rm) = tiny_sft, tiny_rm
    # configs/tiny-ppo.yaml's 40 steps as shipped: the score rises once the critic has learned, and when depends on
    # the CPU's kernels (on an AVX2-only EPYC: 0.551 at step 0, 0.585 at 20, 0.771 at 30, 0.889 at 40).
    result = main(config(tmp_path, file="tiny-ppo.yaml"), "rl", None, {"from": sft["uri"], "reward_model": rm["uri"]})
    m, steps = result["metrics"], [r for r in history(result["uri"]) if "reward/mean" in r]
    first, last = sum(r["reward/mean"] for r in steps[:5]) / 5, sum(r["reward/mean"] for r in steps[-5:]) / 5
    kl = max(r["train/kl"] for r in steps)
    print(f"\nppo: reward-model score of held-out greedy answers {m['eval/reward_initial']:.3f} -> {m['eval/reward']:.3f}, "
          f"of samples (5-step means) {first:.3f} -> {last:.3f}, max KL {kl:.4f}, "
          f"value loss {steps[0]['train/value_loss']:.3f} -> {steps[-1]['train/value_loss']:.3f}")
    # The held-out greedy score measures the policy; a step's mean over its 64 sampled answers swings by +-0.2
    # from step to step (0.33-0.73 in one run), so 5-step means of it can fall while the policy improves.
    assert m["eval/reward"] >= m["eval/reward_initial"] + 0.10 and 0 <= kl < 1.0
    assert all("train/value_loss" in r and "train/clip_frac" in r for r in steps)


def test_dr_grpo_runs_with_dynamic_sampling_and_the_overlong_penalty(tiny_sft, tmp_path):
    """Two steps. Every estimator trains in test_rl_multiturn.py (GRPO and PPO here too), and their advantages
    are checked against hand-computed values in tests/unit/test_rl_math.py."""
    _, sft = tiny_sft
    extra = ["rl.rollout.dynamic_sampling=true", "rl.reward.overlong_buffer=4"]
    result = main(config(tmp_path, "rl.advantage.estimator=dr_grpo", "rl.batch.max_steps=2", "rl.kl.coef=0.01",
                         "rl.logging.eval_every=100", *extra), "rl", None, {"from": sft["uri"]})
    (*_, last) = [r for r in history(result["uri"]) if "train/policy_loss" in r]
    assert all(torch.isfinite(torch.tensor(v)) for v in last.values())
    assert last["train/kl_coef"] == 0.01 and "train/kl_loss" in last and last["train/logprob_mismatch"] < 1e-4
    assert 0 <= last["train/dynamic_sampling/kept_fraction"] <= 1 and 1 <= last["train/sampling_rounds"] <= 3


def test_killed_run_resumes_to_the_same_weights(tiny_sft, tmp_path, monkeypatch):
    _, sft = tiny_sft
    short = ["rl.batch.max_steps=4", "rl.checkpoint.every_steps=2", "rl.logging.eval_every=100", "rl.kl.coef=0.02", "rl.kl.target=0.01"]
    straight = main(config(tmp_path / "a", *short), "rl", None, {"from": sft["uri"]})
    cfg = config(tmp_path / "b", *short)
    monkeypatch.setenv(FAIL_AT_STEP_ENV, "3")
    with pytest.raises(InjectedFailure):
        main(cfg, "rl", None, {"from": sft["uri"]})
    monkeypatch.delenv(FAIL_AT_STEP_ENV)
    resumed = main(cfg, "rl", None, {"from": sft["uri"]})
    assert resumed["resumed_from_step"] == 2
    a, b = weights(straight["uri"]), weights(resumed["uri"])
    differing = [name for name in a if not torch.equal(a[name], b[name])]
    assert not differing, where_runs_part(straight["uri"], resumed["uri"], a, b, differing)
    key = lambda h: [(r["step"], r.get("reward/mean"), r.get("train/kl_coef")) for r in h]  # noqa: E731
    assert key(history(straight["uri"])) == key(history(resumed["uri"]))  # same samples, same adaptive β


def where_runs_part(a_uri: str, b_uri: str, a: dict, b: dict, differing: list[str]) -> str:
    """What a failure of exact resume needs to be traced: by how much the weights differ, the first step whose
    metrics (not timings) differ, and whether the two runs' step-2 checkpoints already differed (then the runs
    parted before the resume, in what any two runs of the same config should compute alike)."""
    worst = max(float((a[n] - b[n]).abs().max()) for n in differing)
    ha, hb = history(a_uri), history(b_uri)
    timing = lambda k: k.endswith(("_s", "_per_s", "_mib"))  # noqa: E731
    parted = next((f"step {ra['step']}: " + ", ".join(f"{k} {ra[k]!r} vs {rb.get(k)!r}" for k in ra if not timing(k) and ra[k] != rb.get(k))
                   for ra, rb in zip(ha, hb) if any(not timing(k) and ra[k] != rb.get(k) for k in ra)), "no metric differs")
    folders = [Path(u) / "checkpoints" / "actor" / "step_00000002" for u in (a_uri, b_uri)]
    (sa, sb), (ra, rb) = ([torch.load(f / name, weights_only=False) for f in folders] for name in ("mp_rank_00_model_states.pt", "rng_rank0.pt"))
    weights_before = [n for n in sa["module"] if not torch.equal(sa["module"][n], sb["module"][n])]
    optimizer_before = [f"{i}.{k}" for i, state in sa["optimizer"]["state"].items() for k, v in state.items()
                        if not torch.equal(v, sb["optimizer"]["state"][i][k])]
    rng_before = [k for k in ra if not same_state(ra[k], rb[k])]
    same = not (weights_before or optimizer_before or rng_before) and sa["lr_scheduler"] == sb["lr_scheduler"]
    return (f"{len(differing)} of {len(a)} weight tensors differ (first {differing[0]}, at most {worst:.3g}); metrics: {parted}; "
            f"step-2 checkpoints: weights {len(weights_before)} tensors differ, optimizer state {len(optimizer_before)} "
            f"{optimizer_before[:3]}, lr scheduler {'equal' if sa['lr_scheduler'] == sb['lr_scheduler'] else 'differs'}, "
            f"rng states {rng_before or 'equal'}" + (" (all equal: the runs parted after the resume)" if same else ""))


def same_state(x, y) -> bool:
    """Equal random-generator states: python's and numpy's are tuples (numpy's holding an array), torch's a tensor."""
    if isinstance(x, torch.Tensor):
        return torch.equal(x, y)
    if isinstance(x, np.ndarray):
        return np.array_equal(x, y)
    if isinstance(x, tuple | list):
        return len(x) == len(y) and all(same_state(a, b) for a, b in zip(x, y))
    return x == y


def test_asynchronous_rollout_trains_one_step_behind_and_resumes_exactly(tiny_sft, tmp_path, monkeypatch):
    """The rollout worker (on a core of its own) generates step t+1's samples while the actor (on the other) trains on
    step t's: from the second step on,
    the samples come from the weights one update behind the actor's (the old-log-prob pass measures the gap) and are
    ready when the step starts. A run killed after step 2 resumes with step 3's samples from the checkpoint (the
    weights that drew them are gone) and ends on the uninterrupted run's weights."""
    _, sft = tiny_sft
    short = ["rl.rollout.asynchronous=true", "rl.workers.colocate=pairs", "rl.workers.cpus_per_worker=1", "rl.batch.max_steps=3", "rl.checkpoint.every_steps=1", "rl.logging.eval_every=100",
             "rl.optim.lr=1e-3", "rl.generation.importance_cap=2.0"]
    straight = main(config(tmp_path / "a", *short), "rl", None, {"from": sft["uri"]})
    steps = [r for r in history(straight["uri"]) if "train/policy_loss" in r]
    gap = [r["train/logprob_mismatch"] for r in steps]
    print(f"\nasynchronous rollout: logprob mismatch per step {[f'{x:.1e}' for x in gap]}, generation "
          f"{[round(r.get('phase/generate_ahead_s', 0), 2) for r in steps]} s in the background")
    assert gap[0] < 1e-5 and min(gap[1:]) > 1e-4  # step 1 is sampled by the actor's weights, later steps one update behind
    assert all(r["train/old_logprob_pass"] == 1.0 for r in steps)
    # the job's memory: the driver's and both workers' peaks, each worker's above its own report
    print(f"peak RSS: job {straight['metrics']['memory/peak_rss_mib']:.0f} MiB, actor {max(r['train/actor_peak_rss_mib'] for r in steps):.0f} MiB")
    assert straight["metrics"]["memory/peak_rss_mib"] > 2 * max(r["train/actor_peak_rss_mib"] for r in steps)
    assert all(r["phase/generate_and_score_s"] < 0.5 * r["phase/generate_ahead_s"] for r in steps[1:])  # ready when taken
    cfg = config(tmp_path / "b", *short)
    monkeypatch.setenv(FAIL_AT_STEP_ENV, "2")
    with pytest.raises(InjectedFailure):
        main(cfg, "rl", None, {"from": sft["uri"]})
    monkeypatch.delenv(FAIL_AT_STEP_ENV)
    resumed = main(cfg, "rl", None, {"from": sft["uri"]})
    assert resumed["resumed_from_step"] == 2
    a, b = weights(straight["uri"]), weights(resumed["uri"])
    for name in a:
        assert torch.equal(a[name], b[name]), name
    key = lambda h: [(r["step"], r.get("reward/mean"), r.get("train/logprob_mismatch")) for r in h]  # noqa: E731
    assert key(history(straight["uri"])) == key(history(resumed["uri"]))  # the same samples, as stale


def test_bad_reward_function_fails_naming_the_sample(tiny_sft, tmp_path):
    _, sft = tiny_sft
    bad = tmp_path / "bad_reward.py"
    bad.write_text("def score(prompts, completions, answer, **kw):\n"
                   "    return [float('nan') if p.startswith('rev') else 1.0 for p in prompts]\n")
    with pytest.raises(RewardError, match=r"returned nan for sample \d+ \(prompt 'rev "):
        main(config(tmp_path, f"rl.reward.function={bad}:score", "rl.batch.max_steps=1"), "rl", None, {"from": sft["uri"]})
