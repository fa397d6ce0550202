"""`alignflow plan` against hand-worked numbers for the two LoRA presets (the arithmetic in their headers), with the
models' config.json in a Hugging Face cache as `huggingface-cli download <name> config.json` leaves it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alignflow.config import load_config
from alignflow.plan import GB, plan

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.unit

LLAMA_31 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "head_dim": 128, "hidden_act": "silu",
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
            "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "vocab_size": 128256, "num_key_value_heads": 8, "torch_dtype": "bfloat16"}
SHAPES = {
    "meta-llama/Llama-3.1-8B-Instruct": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                                         "num_attention_heads": 32},
    "meta-llama/Llama-3.1-70B-Instruct": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                                          "num_attention_heads": 64},
}


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """Only config.json of each model, laid out as the Hugging Face cache keeps it."""
    import huggingface_hub.constants

    for name, shape in SHAPES.items():
        repo = tmp_path / f"models--{name.replace('/', '--')}"
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text("0" * 40)
        snapshot = repo / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text(json.dumps({**LLAMA_31, **shape}))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.chdir(ROOT)
    return tmp_path


def test_70b_dpo_lora_on_eight_48gb_gpus(hub_cache):
    (p,) = plan(load_config(ROOT / "configs" / "70b-dpo-lora.yaml"), gpu_gb=48, workers=8)
    (m,) = p.roles
    # Llama 3.1 70B: 70,553,706,496 parameters; LoRA r=16 on q,k,v,o,gate,up,down adds per layer
    # 16*(8192+8192)*2 + 16*(8192+1024)*2 + 16*(8192+28672)*3 = 2,588,672, x 80 layers = 207,093,760.
    assert (m.params, m.trainable) == (70_553_706_496 + 207_093_760, 207_093_760)
    assert m.weights == pytest.approx(70_760_800_256 * 2 / 8)  # 17.69 GB
    assert m.grads == pytest.approx(207_093_760 * 2 / 8)
    assert m.optimizer == pytest.approx(207_093_760 * 12 / 8)
    # 80 checkpointed layer inputs + one layer recomputed + fp32 logits and log-probs, for 2,048 tokens.
    assert m.activations == pytest.approx(80 * 2048 * 8192 * 2 + 34 * 2048 * 8192 + 8 * 2048 * 128256)
    assert p.per_gpu / GB == pytest.approx(23.41, abs=0.005) and p.fits
    assert not plan(load_config(ROOT / "configs" / "70b-dpo-lora.yaml"), gpu_gb=16, workers=8)[0].fits


def test_8b_grpo_lora_on_four_48gb_gpus(hub_cache):
    (p,) = plan(load_config(ROOT / "configs" / "8b-grpo-lora.yaml"), gpu_gb=48, workers=1)
    roles = {m.role: m for m in p.roles}
    assert set(roles) == {"actor", "rollout"}  # LoRA: no reference worker
    actor, rollout = roles["actor"], roles["rollout"]
    assert (actor.params, actor.trainable) == (8_030_261_248 + 41_943_040, 41_943_040)
    assert actor.weights == pytest.approx(8_072_204_288 * 2 / 4)
    assert actor.optimizer == pytest.approx(41_943_040 * 12 / 4)
    assert actor.activations == pytest.approx(32 * 6144 * 4096 * 2 + 34 * 6144 * 4096 + 8 * 6144 * 128256)
    assert rollout.engine == pytest.approx(24e9)
    assert rollout.kv_tokens == (24_000_000_000 - 8_030_261_248 * 2) // (2 * 32 * 8 * 128 * 2)  # 60,573
    # The engines sleep while the actor trains: the peak is generation's (actor states + engine).
    assert p.per_gpu == pytest.approx(actor.states + 24e9) and p.per_gpu / GB == pytest.approx(28.18, abs=0.005)
    assert p.gpus == 4 and p.fits
    awake = plan(load_config(ROOT / "configs" / "8b-grpo-lora.yaml", ["rl.generation.sleep=false"]), 48, 1)[0]
    assert awake.per_gpu == pytest.approx(actor.total + 24e9)


def test_plan_command_prints_the_roles_and_refuses_what_does_not_fit(hub_cache):
    from typer.testing import CliRunner

    from alignflow.cli import app

    run = lambda *args: CliRunner().invoke(app, ["plan", "configs/8b-grpo-lora.yaml", *args])  # noqa: E731
    ok = run("--gpu-memory-gb", "48")
    assert ok.exit_code == 0, ok.output
    assert "actor" in ok.stdout and "KV cache: 60,573 tokens" in ok.stdout and "28.18 GB of 48 GB: fits" in ok.stdout
    small = run("--gpu-memory-gb", "24")
    assert small.exit_code == 2 and "does NOT fit" in small.stdout
    missing = run("--set", "rl.model.name_or_path=org/not-downloaded")
    assert missing.exit_code == 2 and "huggingface-cli download org/not-downloaded config.json" in missing.stderr
