"""RL worker groups with several workers per role: PPO with a reward model (so actor, critic,
reference and reward groups all exist) on 2 workers per group under DeepSpeed ZeRO-3 over gloo
trains like 1 worker per group with the same global batch, and ZeRO-3 really partitions the
frozen roles' weights over their workers.

Cheap on purpose: the upstream SFT and reward model are the session's (trained once for every module that
needs them), and PPO runs 2 RL steps of 32 responses each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from alignflow.config import load_config
from alignflow.infra import manifest
from alignflow.stages.rl.experience import Experience
from alignflow.stages.rl.workers import ReferenceWorker

from .conftest import QUIET, ROOT, weights

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session")]

STEPS = 2
# Same global batch for both runs: 8 prompts x 4 samples = 32 responses per RL step, two optimizer
# steps of 16 each; 1 worker accumulates 2 micro-batches of 8, 2 workers take one each.
PPO = [f"rl.batch.max_steps={STEPS}", "rl.rollout.prompts_per_step=8", "rl.generation.n_samples_per_prompt=4",
       "rl.batch.global_batch_size=16", "rl.batch.micro_batch_size=8", "rl.logging.eval_every=100", "rl.checkpoint.every_steps=1",
       "rl.workers.colocate=all",
       # The KL in the loss, so the actor checks the generator's log-probs itself (a KL in the reward needs the old
       # log-probs before training: the pass over every row). Every step then runs the old-log-prob pass (the fp32 gap,
       # ~1e-7, passes this tolerance) over the rows that no rank's first micro-batch has scored: 24 of 32 with one
       # worker, 16 with two.
       "rl.kl.placement=loss", "rl.policy.old_logprob_tolerance=1e-12"]
# Per-step figures that must agree, and how closely: float32 sums in another order (gathered
# ZeRO-3 shards, gradients reduced over 2 ranks) move them by ~1e-7 relative here.
COMPARED = ["train/policy_loss", "train/value_loss", "reward/mean", "train/kl", "train/entropy", "train/grad_norm", "train/critic_grad_norm"]
REL, ABS = 1e-4, 1e-6


@pytest.fixture(scope="module")
def upstream(tiny_sft, tiny_rm) -> dict[str, str]:
    """The session's SFT model and reward model (tiny.yaml's, trained once for every module that needs them):
    {input role: stage URI}."""
    return {"from": tiny_sft[1]["uri"], "reward_model": tiny_rm[1]["uri"]}


def ppo(root: Path, inputs: dict[str, str], workers: int, zero_stage: int) -> dict:
    from alignflow.stages.rl.stage import main

    per_role = [f"rl.workers.{role}={workers}" for role in ("actor", "critic", "reference", "reward")]
    # colocate: all puts worker i of every role in bundle i; `workers` bundles of 2/workers CPUs fill the 2 cores.
    cfg = load_config(ROOT / "configs" / "tiny-ppo.yaml", [f"storage.root={root}", *QUIET, *PPO, *per_role,
                                                           f"rl.workers.cpus_per_worker={2 / workers}",
                                                           f"rl.deepspeed.zero_stage={zero_stage}"])
    return main(cfg, "rl", None, inputs)


def step_metrics(result: dict) -> list[dict]:
    history = json.loads((Path(result["uri"]) / "metrics.json").read_text())["history"]
    return [r for r in history if "train/policy_loss" in r]


def test_two_workers_per_group_under_zero3_train_like_one_worker(upstream, tmp_path):
    one = ppo(tmp_path / "one", upstream, workers=1, zero_stage=0)
    two = ppo(tmp_path / "two", upstream, workers=2, zero_stage=3)
    a, b = step_metrics(one), step_metrics(two)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    for ra, rb in zip(a, b):
        print(f"\nstep {ra['step']}: " + ", ".join(f"{k} {ra[k]:.6g} vs {rb[k]:.6g}" for k in COMPARED))
        for k in COMPARED:
            assert rb[k] == pytest.approx(ra[k], rel=REL, abs=ABS), (ra["step"], k)
    worst = max((abs(rb[k] - ra[k]) / max(abs(ra[k]), ABS), k, ra["step"]) for ra, rb in zip(a, b) for k in COMPARED)
    print(f"largest relative difference, 2 workers (ZeRO-3) vs 1: {worst[0]:.2e} ({worst[1]}, step {worst[2]})")
    # the policy moved away from the reference (at step 1 the logged KL is the generator's log-probs against the
    # reference's, equal but for rounding)
    assert abs(a[0]["train/kl"]) < 1e-5 and a[-1]["train/kl"] > 1e-3
    assert [(r["train/old_logprob_pass"], r["train/old_logprob_rows"]) for r in a] == [(1.0, 24.0)] * STEPS
    assert [(r["train/old_logprob_pass"], r["train/old_logprob_rows"]) for r in b] == [(1.0, 16.0)] * STEPS
    # Before any training: greedy held-out responses scored by 1 vs 2 reward-model workers.
    initial = "eval/reward_initial"
    assert two["metrics"][initial] == pytest.approx(one["metrics"][initial], rel=REL, abs=ABS)
    wa, wb = weights(one["uri"]), weights(two["uri"])  # the published policy, gathered from ZeRO-3 shards
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], atol=1e-5, rtol=1e-4)
    print(f"largest weight difference: {max(float((wb[n] - wa[n]).abs().max()) for n in wa):.2e}")
    for role in ("actor", "critic"):  # the checkpoints of each trained role, written by both ranks
        folders = sorted((Path(two["uri"]) / "checkpoints" / role).glob("*/"))
        assert folders and all(manifest.verify(str(f), manifest.CHECKPOINT_MANIFEST).meta["world_size"] == 2 for f in folders)


class PartitionProbe(ReferenceWorker):
    def held_numel(self) -> tuple[int, int]:
        """(weight elements this worker holds, elements of the whole model)."""
        params = list(self.strategy.engine.parameters())
        return (sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params),
                sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in params))


def test_frozen_roles_are_partitioned_under_zero3(tiny_model_path, tokenizer):
    """Under ZeRO-3 each of 2 reference workers holds half of the weights, and the log-probs the
    group computes are those of one unpartitioned worker."""
    from alignflow.stages.common.generation import Rollout
    from alignflow.stages.common.workers import WorkerGroup, plan_slots, release

    rl = load_config(ROOT / "configs" / "tiny-ppo.yaml", [*QUIET, *PPO, "rl.deepspeed.zero_stage=3"]).section("rl")
    plain = rl.model_copy(update={"deepspeed": rl.deepspeed.model_copy(update={"zero_stage": 0})})
    g, vocab = torch.Generator().manual_seed(0), len(tokenizer)
    ids = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    lengths = torch.randint(1, 10, (20, 2), generator=g).tolist()  # 20 rows of various prompt and response lengths
    exp = Experience.from_rollouts([Rollout(ids(p + 1), ids(r), [0.0] * r, "length") for p, r in lengths], tokenizer.pad_token_id)
    slots = plan_slots({"reference": 2, "single": 1}, 0.5, 0, "none")
    groups = []
    try:
        for role in ("reference", "single"):
            groups.append(WorkerGroup(role, PartitionProbe, slots[role]))
        two, one = groups
        two.call("setup", rl, tiny_model_path)
        one.call("setup", plain, tiny_model_path)
        (held_a, total), (held_b, _) = two.call("held_numel")
        print(f"\nZeRO-3 reference workers hold {held_a} and {held_b} of {total} weight elements")
        assert held_a + held_b >= total and max(held_a, held_b) <= total // 2 + 4096
        assert one.call("held_numel") == [(total, total)]
        torch.testing.assert_close(two.call("logprobs", exp)[0], one.call("logprobs", exp)[0], atol=1e-6, rtol=1e-5)
    finally:
        for group in groups:
            group.kill()
        release(slots)
