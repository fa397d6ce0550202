"""The old-log-prob pass when the guard calls it back: the rows a first micro-batch scored at the old weights keep
those log-probs, and the pass scores only the others (`ActorWorker._rescore`). The premise, checked here on the tiny
model: a micro-batch's log-probs equal the full pass's at its rows, and the pass over a subset of rows equals the
full pass there."""

from __future__ import annotations

import pytest
import torch

from alignflow.stages.common.generation import Rollout
from alignflow.stages.rl.experience import Experience, response_logprobs
from alignflow.stages.rl.workers import per_row, stochastic_forward


class OneProcess:
    """What `per_row` uses of a `Strategy`, for one process (nothing to reduce)."""

    world_size, rank, device = 1, 0, "cpu"

    def __init__(self, model: torch.nn.Module):
        self.engine = model

    def all_reduce_tensor(self, t: torch.Tensor) -> torch.Tensor:
        return t


@pytest.fixture(scope="module")
def model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation="sdpa").eval()


def experience() -> Experience:
    a, b, c = [3, 4, 5, 6, 7], [8, 9], [21]
    rows = [Rollout(p, [10 + k, 11 + k, 12 + k][: 1 + k % 3], [-0.1] * (1 + k % 3), "stop") for k, p in enumerate([a, b, a, c, b, a, b, c])]
    return Experience.from_rollouts(rows, pad_id=0)


def test_a_subset_pass_and_a_micro_batch_give_the_full_pass_values(model):
    exp, strategy = experience(), OneProcess(model)
    forward = lambda sub: response_logprobs(model, sub, 0.7)[0]  # noqa: E731
    full = per_row(strategy, 3, exp, forward)
    first, rest = [5, 0, 2], [1, 3, 4, 6, 7]  # a first micro-batch (two rows share a prompt) and the other rows
    some = per_row(strategy, 3, exp, forward, rest)
    torch.testing.assert_close(some[rest], full[rest], atol=1e-6, rtol=0)
    assert some[first].abs().sum() == 0
    sub = exp.micro_batch(first)
    trained = torch.zeros_like(full)
    trained[first, : sub.mask.shape[1]] = forward(sub)  # as the training forward scores the first micro-batch
    torch.testing.assert_close(trained * exp.mask + some, full, atol=1e-6, rtol=0)
    assert per_row(strategy, 3, exp, forward, []).abs().sum() == 0  # every row scored already: no forward at all


def test_dropout_makes_the_training_forward_stochastic(model):
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))
    assert stochastic_forward(net.train()) and not stochastic_forward(net.eval())
    assert not stochastic_forward(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0)).train())
    assert not stochastic_forward(model.train()) and model.config.attention_dropout == 0
    model.config.attention_dropout = 0.1
    try:
        assert stochastic_forward(model) and not stochastic_forward(model.eval())
    finally:
        model.config.attention_dropout = 0.0
        model.eval()
