"""LoRA on the tiny model, on CPU, for real: what is trained and checkpointed, the reference as the policy with its
adapter off, and the published merged model and PEFT adapter."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from alignflow.config import load_config
from alignflow.infra import manifest
from alignflow.stages.common.models import load_causal_lm, with_lora
from alignflow.stages.common.pairs import load_pairs, pair_logps
from alignflow.stages.common.reference import adapter_off
from alignflow.stages.dpo.stage import main as dpo_main

from .conftest import QUIET, ROOT

LORA = ["dpo.from=sft", "dpo.lora.rank=16", "dpo.lora.alpha=32"]


def config(root: Path, *overrides: str):
    return load_config(ROOT / "configs" / "tiny.yaml", [f"storage.root={root}", *QUIET, *overrides])


@pytest.fixture(scope="module")
def lora_dpo(tiny_sft, tmp_path_factory):
    """configs/tiny.yaml's DPO with LoRA and the reference computed on the fly, from the session's SFT model."""
    _, sft = tiny_sft
    cfg = config(tmp_path_factory.mktemp("lora-dpo"), *LORA, "dpo.reference=on_the_fly")
    return cfg, dpo_main(cfg, "dpo", None, {"from": sft["uri"]})


def test_lora_dpo_learns_like_full_dpo_without_a_reference_pass(lora_dpo):
    _, result = lora_dpo
    m = result["metrics"]
    print(f"LoRA dpo: held-out reward accuracy {m['eval/rewards/accuracy_initial']:.3f} -> {m['eval/rewards/accuracy']:.3f}, "
          f"margin {m['eval/rewards/margin_initial']:.3f} -> {m['eval/rewards/margin']:.3f}")
    assert m["eval/rewards/margin"] > 0.3 and m["eval/rewards/accuracy"] >= 0.7  # the full-weight DPO test's thresholds
    assert m["eval/loss"] < m["eval/loss_initial"]
    files = manifest.verify(result["uri"]).files
    assert not any(f.startswith("reference/") for f in files)  # on the fly: nothing stored, no up-front pass
    assert {"model/model.safetensors", "adapter/adapter_model.safetensors", "adapter/adapter_config.json"} <= set(files)


def test_only_the_adapter_is_trained_and_checkpointed(lora_dpo, tiny_sft):
    from peft import LoraConfig, get_peft_model

    cfg, result = lora_dpo
    _, sft = tiny_sft
    base = load_causal_lm(str(Path(sft["uri"]) / "model"), cfg.section("dpo").model)
    ours = with_lora(base, cfg.section("dpo").lora)
    theirs = get_peft_model(load_causal_lm(str(Path(sft["uri"]) / "model"), cfg.section("dpo").model),
                            LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    trainable, total = theirs.get_nb_trainable_parameters()
    assert (result["metrics"]["params/trainable"], result["metrics"]["params/total"]) == (trainable, total)
    assert ours.get_nb_trainable_parameters() == (trainable, total)
    assert f"{trainable:,} of {total:,} parameters trained" in (Path(result["uri"]) / "MODEL_CARD.md").read_text()

    # The step checkpoint holds the adapter's weights and optimizer state, not the frozen base.
    (states,) = (Path(result["uri"]) / "checkpoints").glob("step_*/*model_states.pt")
    saved = torch.load(states, weights_only=False)
    assert saved["module"] and all("lora_" in k for k in saved["module"]), list(saved["module"])[:5]
    assert sum(t.numel() for t in saved["module"].values()) == trainable
    exp_avg = [s["exp_avg"].numel() for s in saved["optimizer"]["state"].values()]
    assert sum(exp_avg) == trainable


def test_published_adapter_on_the_base_gives_the_merged_models_logits(lora_dpo, tiny_sft):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, result = lora_dpo
    _, sft = tiny_sft
    merged = AutoModelForCausalLM.from_pretrained(Path(result["uri"]) / "model").eval()
    base = AutoModelForCausalLM.from_pretrained(Path(sft["uri"]) / "model")
    adapted = PeftModel.from_pretrained(base, Path(result["uri"]) / "adapter").eval()
    ids = torch.randint(3, merged.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = merged(input_ids=ids).logits, adapted(input_ids=ids).logits
        with adapted.disable_adapter():
            before = adapted(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # fp32: W + BA merged vs applied apart
    assert (before - want).abs().max() > 1e-2  # the adapter changed the model: the check above can fail


def test_adapter_off_reference_equals_a_separately_loaded_reference(tiny_sft, tmp_path):
    """The policy with a trained (non-zero) adapter, switched off, gives the starting model's log-probs."""
    cfg = config(tmp_path, *LORA)
    dpo = cfg.section("dpo")
    _, sft = tiny_sft
    path = str(Path(sft["uri"]) / "model")
    from alignflow.stages.common.models import load_tokenizer

    tokenizer = load_tokenizer(path)
    _, held, _ = load_pairs(dpo.data, tokenizer, dpo.batch.seed, "dpo.data")
    pairs = held[:16]
    reference = load_causal_lm(path, dpo.model).eval()
    policy = with_lora(load_causal_lm(path, dpo.model), dpo.lora).eval()
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:  # as after training: B starts at zero, so an untrained adapter changes nothing
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
        want = pair_logps(reference, pairs, tokenizer.pad_token_id, "cpu")
        on = pair_logps(policy, pairs, tokenizer.pad_token_id, "cpu")
        with adapter_off(SimpleNamespace(unwrap=lambda: policy)):
            off = pair_logps(policy, pairs, tokenizer.pad_token_id, "cpu")
    for key in ("chosen", "rejected"):
        torch.testing.assert_close(off[key], want[key], atol=1e-5, rtol=0)
        assert (on[key] - want[key]).abs().max() > 1e-2
