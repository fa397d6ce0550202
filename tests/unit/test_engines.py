"""Generation-engine choices that must fail early and clearly, stop tokens, and truncated
importance sampling (pure math, hand-computed)."""

import math
from pathlib import Path

import pytest
import torch

from alignflow.config import ConfigError, load_config
from alignflow.stages.common import vllm_engine
from alignflow.stages.common.generation import HFGenerator, SamplingParams
from alignflow.stages.rl.losses import policy_loss, truncated_is_weight

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def rl(*overrides):
    return load_config(ROOT / "configs" / "tiny.yaml", ["rl.from=sft", *overrides])


def test_vllm_missing_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(vllm_engine.EngineUnavailable, match=r"make install-vllm.*alignflow\[vllm\]") as err:
        vllm_engine.require_vllm()
    assert isinstance(err.value, ConfigError)  # a setup error: the stage exits 2 and is not retried


def test_sleep_mode_is_refused_off_gpus():
    with pytest.raises(ConfigError, match="generation.sleep .* needs workers.gpus_per_worker > 0 and workers.colocate: all"):
        rl("rl.generation.engine=vllm", "rl.generation.sleep=true")
    with pytest.raises(ConfigError, match="generation.sleep .* needs"):
        rl("rl.generation.engine=vllm", "rl.generation.sleep=true", "rl.workers.gpus_per_worker=1", "rl.workers.colocate=pairs")
    ok = rl("rl.generation.engine=vllm", "rl.generation.sleep=true", "rl.workers.gpus_per_worker=1")
    assert ok.section("rl").generation.sleep


def test_sleep_mode_engine_refuses_without_a_gpu(monkeypatch):
    monkeypatch.setattr(vllm_engine, "require_vllm", lambda: None)
    monkeypatch.setattr(vllm_engine, "on_gpu", lambda: False)
    with pytest.raises(vllm_engine.EngineUnavailable, match="no GPU"):
        vllm_engine.VLLMGenerator("unused", 2, sleep=True)


def test_vllm_options_need_the_vllm_engine():
    with pytest.raises(ConfigError, match="vLLM options: set generation.engine: vllm"):
        rl("rl.generation.tensor_parallel_size=2")


def test_the_actor_generates_when_the_layout_allows_and_says_why_not():
    assert rl().section("rl").hybrid  # tiny.yaml: HF engine, colocate all, ZeRO-0, one actor worker
    for setting, reason in [("rl.generation.engine=vllm", "generation.engine: hf"), ("rl.workers.colocate=pairs", "colocate: all"),
                            ("rl.deepspeed.zero_stage=3", "zero_stage below 3"), ("rl.workers.actor=2", "generation.engines equal")]:
        assert not rl(setting).section("rl").hybrid  # auto: separate rollout workers
        with pytest.raises(ConfigError, match=f"workers.hybrid: true generates in the actor workers, which needs .*{reason}"):
            rl(setting, "rl.workers.hybrid=true")
    assert not rl("rl.workers.hybrid=false").section("rl").hybrid
    assert rl("rl.workers.actor=2", "rl.generation.engines=2", "rl.deepspeed.zero_stage=2").section("rl").hybrid


def test_asynchronous_rollout_needs_rollout_workers_on_devices_of_their_own():
    asynchronous = ("rl.rollout.asynchronous=true", "rl.workers.colocate=pairs")
    assert not rl(*asynchronous).section("rl").hybrid  # auto: the actor cannot train and generate at once
    with pytest.raises(ConfigError, match="workers.hybrid: true generates in the actor workers, which needs rollout.asynchronous: false"):
        rl(*asynchronous, "rl.workers.hybrid=true")
    for extra in ([], ["rl.generation.engine=vllm", "rl.generation.sleep=true", "rl.workers.gpus_per_worker=1"]):
        with pytest.raises(ConfigError, match="rollout.asynchronous generates while the trainers train: .*workers.colocate: pairs or none"):
            rl("rl.rollout.asynchronous=true", *extra)  # colocate: all, the default
    ppo = lambda *o: load_config(ROOT / "configs" / "tiny-ppo.yaml", ["rl.rollout.asynchronous=true", *o])  # noqa: E731
    with pytest.raises(ConfigError, match="scores the next step's samples with the reward model while the critic trains.*colocate: none"):
        ppo("rl.workers.colocate=pairs")
    assert ppo("rl.workers.colocate=none").section("rl").rollout.asynchronous


def test_stop_tokens_end_a_response_like_eos(tiny_model_path, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    gen = HFGenerator(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    prompt = [tokenizer("reverse: abc")["input_ids"]]
    free = gen.generate(prompt, SamplingParams(max_new_tokens=8, temperature=0))[0]
    stop = free.response_ids[1]
    cut = gen.generate(prompt, SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=(stop,)))[0]
    first = free.response_ids.index(stop) + 1
    assert cut.response_ids == free.response_ids[:first] and cut.finish_reason == "stop"
    assert cut.logprobs == free.logprobs[:first]


def test_truncated_importance_weights_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    engine = torch.log(torch.tensor([[0.25, 0.4, 0.1]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w = truncated_is_weight(old, engine, mask, cap=2.0)
    # 0.5/0.25 = 2 (at the cap), 0.2/0.4 = 0.5, padding -> 1
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 1.0]]))
    w = truncated_is_weight(old, engine, mask, cap=1.5)
    torch.testing.assert_close(w, torch.tensor([[1.5, 0.5, 1.0]]))


def test_policy_loss_scales_each_token_by_its_importance_weight():
    logp = torch.log(torch.tensor([[0.5, 0.2]])).requires_grad_()
    old = logp.detach().clone()
    adv = torch.tensor([[1.0, -2.0]])
    mask = torch.ones(1, 2)
    weight = torch.tensor([[2.0, 0.5]])
    loss, _ = policy_loss(logp, old, adv, mask, num_tokens=2.0, is_weight=weight)
    # ratio 1 -> per-token loss -A: (-1 * 2 + 2 * 0.5) / 2 = -0.5
    assert math.isclose(loss.item(), -0.5, abs_tol=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, 0.5]]))  # d/dlogp of -w·A·ratio / 2
