"""`logprobs_at`: the chunked LM head on a model's last hidden state gives what the model's own logits give,
values and gradients, for the shapes each stage uses (SFT's packed rows, pairs' sourced positions, RL's tempered
responses with entropy); models whose logits are more than a plain head take the full path."""

from __future__ import annotations

import pytest
import torch

from alignflow.stages.common import logprobs
from alignflow.stages.common.data import TokenBatch
from alignflow.stages.common.logprobs import entropy_from_logits, forward_logprobs, logprobs_at, plain_head, token_logprobs


def llama(vocab: int = 300):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=True, attn_implementation="sdpa")
    return LlamaForCausalLM(config).double()


def full_logits(monkeypatch):
    monkeypatch.setattr(logprobs, "plain_head", lambda model: None)


FP32 = {"atol": 1e-5, "rtol": 1e-5}  # log-probs come out in fp32, from a model in fp64 here


def grads(model, value: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    value.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def packed_batch(vocab: int) -> TokenBatch:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, 12), generator=gen)
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]])  # two samples a row
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 1]]).double()
    return TokenBatch(ids, pos, mask, None, int(ids.numel()))


def test_forward_logprobs_chunked_equals_the_models_logits_on_packed_rows(monkeypatch):
    model, batch = llama(), packed_batch(300)
    assert plain_head(model) is not None
    weights = torch.randn(2, 11)
    chunked = forward_logprobs(model, batch)
    got = grads(model, (chunked * weights).sum())
    full_logits(monkeypatch)
    full = forward_logprobs(model, batch)
    want = grads(model, (full * weights).sum())
    keep = batch.loss_mask[:, 1:].bool()
    by_hand = token_logprobs(model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits, batch.input_ids)
    torch.testing.assert_close(chunked[keep], by_hand[keep], **FP32)
    assert chunked[~keep].eq(0).all() and full[~keep].eq(0).all()  # positions outside the loss mask are not computed
    torch.testing.assert_close(chunked, full, **FP32)
    assert got.keys() == want.keys() and "model.embed_tokens.weight" in got  # the tied head's gradient reaches the embedding
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name, **FP32)


def test_tempered_logprobs_and_entropy_at_sourced_positions(monkeypatch):
    model = llama()
    gen = torch.Generator().manual_seed(2)
    inputs = {"input_ids": torch.randint(0, 300, (3, 9), generator=gen), "attention_mask": torch.ones(3, 9, dtype=torch.long)}
    source = torch.randint(0, 27, (3, 4), generator=gen)  # any flat positions, in any order, repeated
    targets = torch.randint(0, 300, (3, 4), generator=gen)
    keep = torch.rand(3, 4, generator=gen) > 0.3
    coef = torch.randn(2, 3, 4, generator=gen)

    def run():
        logp, ent = logprobs_at(model, inputs, source, targets, keep=keep, temperature=0.7, with_entropy=True)
        return logp, ent, grads(model, (coef[0] * logp + coef[1] * ent).sum())

    logp, ent, got = run()
    full_logits(monkeypatch)
    logp_full, ent_full, want = run()
    logits = model(**inputs, use_cache=False).logits.flatten(0, 1)[source] / 0.7
    by_hand = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(logp[keep], by_hand[keep].float(), **FP32)
    torch.testing.assert_close(ent[keep], entropy_from_logits(logits)[keep], **FP32)
    torch.testing.assert_close(logp, logp_full, **FP32)
    torch.testing.assert_close(ent, ent_full, **FP32)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name, **FP32)


def test_models_whose_logits_are_more_than_a_plain_head_take_the_full_path():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=32)).double().eval()  # no dropout
    assert plain_head(model) is None  # not on the list of plain heads
    wrapped = llama()
    wrapped.lm_head = torch.nn.Sequential(wrapped.lm_head)  # as a LoRA or modules_to_save wrapper would
    assert plain_head(wrapped) is None
    ids = torch.randint(0, 50, (2, 7))
    batch = TokenBatch(ids, torch.arange(7).repeat(2, 1), torch.ones(2, 7, dtype=torch.float64), None, 14)
    torch.testing.assert_close(forward_logprobs(model, batch), token_logprobs(model(input_ids=ids, use_cache=False).logits, ids), **FP32)


@pytest.mark.parametrize("vocab", [300, 5000])
def test_the_head_runs_on_kept_positions_only(monkeypatch, vocab):
    """The head's matmul sees only the kept rows: counted through the weight's uses in F.linear."""
    model, batch = llama(vocab), packed_batch(vocab)
    seen = []
    real = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda x, w, b=None: (seen.append(x.shape[0]) if w.shape[0] == vocab else None) or real(x, w, b))
    forward_logprobs(model, batch)
    assert sum(seen) == int(batch.loss_mask[:, 1:].sum())


def test_the_models_own_forward_runs_with_the_head_passing_the_hidden_state_through():
    """A DeepSpeed engine hangs its backward prologue on its forward's output: the forward must run, not the body alone."""
    model, batch = llama(), packed_batch(300)
    calls = []
    model.register_forward_hook(lambda module, args, output: calls.append(output.logits.shape))
    forward_logprobs(model, batch)
    assert calls == [(2, 12, 32)]  # the hidden size: the head let the last hidden state through
    assert "forward" not in vars(model.lm_head)  # and is itself again
    model.register_forward_hook(lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        forward_logprobs(model, batch)
    assert "forward" not in vars(model.lm_head) and model.lm_head(torch.zeros(1, 32, dtype=torch.float64)).shape == (1, 300)
