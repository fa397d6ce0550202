"""The GPU presets load against the config schema and say what the README says they do (they are
not run here), and the GSM8K reward function of the 7B GRPO preset scores as documented."""

from __future__ import annotations

from pathlib import Path

import pytest

from alignflow.config import load_config
from alignflow.stages.rl.config import Estimator

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # reward function paths are relative to the repository


def test_7b_grpo_preset():
    cfg = load_config(ROOT / "configs" / "7b-grpo.yaml")
    rl = cfg.section("rl")
    assert cfg.order() == ["sft", "rl"] and cfg.inputs_of("rl") == {"from": "sft"}
    assert cfg.section("sft") == load_config(ROOT / "configs" / "7b-sft-zero3.yaml").section("sft")
    assert rl.advantage.estimator == Estimator.GROUP_NORM and rl.critic is None and rl.kl.coef > 0  # reference, no critic
    assert (rl.deepspeed.zero_stage, rl.deepspeed.offload_optimizer, rl.deepspeed.precision) == (3, False, "bf16")
    g, w = rl.generation, rl.workers
    assert (g.engine, g.engines, g.tensor_parallel_size, g.sleep) == ("vllm", 8, 1, True)
    assert (w.colocate, w.actor, w.reference, w.gpus_per_worker) == ("all", 8, 8, 1)  # one node: 8 GPUs, each shared
    assert rl.reward.function.endswith("rewards/gsm8k.py:final_number")
    assert rl.batch.global_batch_size % (rl.batch.micro_batch_size * w.actor) == 0


def test_70b_ppo_preset():
    cfg = load_config(ROOT / "configs" / "70b-ppo.yaml")
    rl = cfg.section("rl")
    assert cfg.order() == ["sft", "rm", "rl"] and cfg.inputs_of("rl") == {"from": "sft", "reward_model": "rm"}
    assert rl.advantage.estimator == Estimator.GAE and rl.reward.model == "rm"
    for section in (cfg.section("sft"), cfg.section("rm"), rl):  # every 70B model trains with ZeRO-3 and the optimizer in host memory
        assert (section.deepspeed.zero_stage, section.deepspeed.offload_optimizer, section.deepspeed.precision) == (3, True, "bf16")
        assert section.model.gradient_checkpointing
    g, w = rl.generation, rl.workers
    assert (g.engine, g.engines, g.tensor_parallel_size, g.sleep) == ("vllm", 1, 8, False)
    assert w.colocate == "pairs" and (w.actor, w.reference, w.critic, w.reward) == (16, 16, 8, 8)
    gpus = max(w.actor, w.reference) + max(w.critic, w.reward) + g.engines * g.tensor_parallel_size
    assert gpus == 32  # 4 nodes x 8 GPUs, as the README says
    for workers in (w.actor, w.critic):
        assert rl.batch.global_batch_size % (rl.batch.micro_batch_size * workers) == 0


@pytest.mark.parametrize("completion, answer, reward", [
    ("She has 3 + 4 = 7 apples.\n#### 7", "3 + 4 = 7\n#### 7", 1.0),
    ("The answer is 1,234.", "#### 1234", 1.0),
    ("12 - 4 = 8, so 8.0", "8", 1.0),
    ("#### 7 and then 9", "#### 7", 1.0),  # its own `####` decides, not the last number
    ("It is 6.", "#### 7", 0.0),
    ("no idea", "#### 7", 0.0),
    ("-3", "#### -3", 1.0),
])
def test_gsm8k_reward(completion, answer, reward):
    from alignflow.stages.rl.rewards import FunctionReward  # as the rl stage loads it

    score = FunctionReward(load_config(ROOT / "configs" / "7b-grpo.yaml").section("rl").reward.function)
    assert score(["q"], [completion], [[1]], [[2]], {"answer": [answer]}).tolist() == [reward]
