"""The reward head read with the last layer computed only at the read positions (stages/common/last_layer.py)
gives the full forward's scores and gradients."""

import pytest
import torch

from alignflow.stages.common import last_layer
from alignflow.stages.common.last_layer import decoder_body, head_at, shortcut_applies
from alignflow.stages.common.pairs import collate_pairs, load_pairs, token_scores

ROWS = [{"prompt": "12+34", "chosen": "46", "rejected": "4600"}, {"prompt": "rev abcd", "chosen": "dcba", "rejected": "x"},
        {"prompt": "reverse the letters of abcdefghijklmnop", "chosen": "ponmlkjihgfedcba", "rejected": "abcdefghijklmnop"},
        {"prompt": "3*3", "chosen": "9", "rejected": "6"}]


@pytest.fixture()
def batch(tmp_path, tokenizer):
    import json

    from alignflow.config.base import PreferenceDataConfig

    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    pairs, _, _ = load_pairs(PreferenceDataConfig(path=str(path), eval_fraction=0.0), tokenizer, 0)
    b = collate_pairs(pairs, tokenizer.pad_token_id)
    assert b.input_ids.shape[0] > 1 or len(pairs) > 1
    return b, torch.cat([b.chosen_end, b.rejected_end])


def reward_model(path, pad_id, **config):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained(path, num_labels=1, **config)
    model = AutoModelForSequenceClassification.from_pretrained(path, config=cfg)
    model.config.pad_token_id = pad_id
    torch.nn.init.normal_(model.score.weight, std=0.5)  # a trained head's scale: scores well away from 0
    return model.train()


def scores_and_grads(model, fn):
    model.zero_grad()
    scores = fn()
    (scores * torch.linspace(-1, 1, scores.numel())).sum().backward()
    return scores.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_last_layer_at_the_read_positions_gives_the_full_forwards_scores_and_gradients(batch, tiny_model_path, tokenizer):
    (b, at), model = batch, reward_model(tiny_model_path, tokenizer.pad_token_id)
    assert shortcut_applies(decoder_body(model))
    args = (b.input_ids, b.attention_mask, b.position_ids)
    full, full_grads = scores_and_grads(model, lambda: token_scores(model, model.score, *args).flatten()[at])
    fast, fast_grads = scores_and_grads(model, lambda: head_at(model, model.score, *args, at))
    assert full.std() > 0.1  # distinct scores, so a wrong position would show
    torch.testing.assert_close(fast, full, atol=1e-5, rtol=0)
    assert fast_grads.keys() == full_grads.keys()
    for name, grad in full_grads.items():
        torch.testing.assert_close(fast_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    body = decoder_body(model)  # the passed-through last layer and norm are the class's own again
    assert "forward" not in vars(body.layers[-1]) and "forward" not in vars(body.norm)


def test_a_failed_forward_leaves_the_model_whole(batch, tiny_model_path, tokenizer, monkeypatch):
    (b, at), model = batch, reward_model(tiny_model_path, tokenizer.pad_token_id)
    body = decoder_body(model)
    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(body.layers[0], "forward", broken)
    with pytest.raises(RuntimeError, match="out of memory"):
        head_at(model, model.score, b.input_ids, b.attention_mask, b.position_ids, at)
    assert "forward" not in vars(body.layers[-1]) and "forward" not in vars(body.norm)


def test_lora_models_take_the_shortcut_and_other_layers_the_full_forward(batch, tiny_model_path, tokenizer, monkeypatch):
    from alignflow.config.base import LoraConfig
    from alignflow.stages.common.models import with_lora

    b, at = batch
    args = (b.input_ids, b.attention_mask, b.position_ids)
    lora = with_lora(reward_model(tiny_model_path, tokenizer.pad_token_id), LoraConfig(rank=4, alpha=8), reward=True)
    assert shortcut_applies(decoder_body(lora))
    torch.testing.assert_close(head_at(lora, lora.score, *args, at), token_scores(lora, lora.score, *args).flatten()[at],
                               atol=1e-5, rtol=0)
    model = reward_model(tiny_model_path, tokenizer.pad_token_id)
    monkeypatch.setattr(last_layer, "LLAMA_STYLE_LAYERS", set())  # an architecture it does not know
    assert not shortcut_applies(decoder_body(model))
    torch.testing.assert_close(head_at(model, model.score, *args, at), token_scores(model, model.score, *args).flatten()[at])
    dropout = reward_model(tiny_model_path, tokenizer.pad_token_id, attention_dropout=0.1)
    monkeypatch.undo()
    assert not shortcut_applies(decoder_body(dropout))  # training-time attention dropout is the full forward's to draw


def test_log_probs_with_the_last_mlp_at_the_read_positions_match_the_full_logits(batch, tiny_model_path):
    from transformers import AutoModelForCausalLM

    from alignflow.stages.common.logprobs import logprobs_at

    b, _ = batch
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).train()
    inputs = {"input_ids": b.input_ids, "attention_mask": b.attention_mask, "position_ids": b.position_ids}
    rows, width = b.input_ids.shape
    at = b.source + torch.arange(rows)[:, None] * width
    keep = (b.chosen_mask + b.rejected_mask).sum(0).ne(0).view(rows, width)
    assert 0 < keep.float().mean() < 0.8  # some positions are not read

    def full():
        logits = model(**inputs).logits.flatten(0, 1)[at.flatten()].log_softmax(-1)
        return logits.gather(-1, b.input_ids.flatten()[:, None])[:, 0].view(rows, width) * keep

    want, want_grads = scores_and_grads(model, lambda: full().flatten())
    got, got_grads = scores_and_grads(model, lambda: logprobs_at(model, inputs, at, b.input_ids, keep=keep)[0].flatten())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    body = decoder_body(model)
    assert "forward" not in vars(body.layers[-1]) and "forward" not in vars(body.norm)
