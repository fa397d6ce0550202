"""Prefix sharing in the RL roles' micro-batches: rows with the same prompt run as one row (`SharedRows`), and every
per-token output equals what the padded rows give."""

from __future__ import annotations

import pytest
import torch

from alignflow.stages.common.generation import Rollout
from alignflow.stages.rl.experience import Experience, SharedRows, response_logprobs, response_values


def rollouts() -> list[Rollout]:
    a, b = [3, 4, 5, 6, 7], [8, 9]
    out = [Rollout(a, [10, 11, 12], [-0.1, -0.2, -0.3], "stop"), Rollout(b, [13], [-0.5], "stop"),
           Rollout(a, [14], [-0.4], "stop"), Rollout(b, [15, 16, 17, 18], [-0.6] * 4, "length"),
           Rollout(a, [19, 20], [-0.7, -0.8], "stop"), Rollout([21], [22, 23], [-0.9, -1.0], "stop")]
    # a multi-turn trajectory: environment tokens (mask 0) between the answers
    out.append(Rollout(b, [24, 25, 26, 27], [-0.1, 0.0, 0.0, -0.2], "stop", action_mask=[1, 0, 0, 1]))
    return out


@pytest.fixture(scope="module")
def model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation="sdpa").eval()


def test_rows_sharing_a_prompt_run_once_and_give_the_padded_rows_outputs(model):
    exp = Experience.from_rollouts(rollouts(), pad_id=0)
    index = [4, 1, 6, 0, 5, 3, 2]  # any order: outputs come back in the order asked for
    shared, padded = exp.micro_batch(index), exp.rows(index)
    # each prompt once: a (5) + 3 + 1 + 2 = 11, b (2) + 1 + 4 + 4 = 11, [21] (1) + 2 = 3 tokens: 25 tokens packed
    # into rows of at most 16 (1.5x the widest group), [a, [21]] and [b]; the padded rows hold 39 real tokens
    assert isinstance(shared, SharedRows) and shared.input_ids.shape == (2, 14)
    assert int(padded.attention_mask.sum()) == 39 and padded.input_ids.shape == (7, 8)
    with torch.no_grad():
        logp_s, ent_s = response_logprobs(model, shared, temperature=0.7, with_entropy=True)
        logp_p, ent_p = response_logprobs(model, padded, temperature=0.7, with_entropy=True)
    m = padded.mask
    assert torch.equal(shared.mask, m) and torch.equal(shared.targets, padded.targets)
    assert torch.allclose(logp_s * m, logp_p * m, atol=1e-5) and torch.allclose(ent_s * m, ent_p * m, atol=1e-5)
    assert (logp_p * m).abs().sum() > 1  # not trivially zero


def test_values_of_shared_rows_equal_the_padded_rows(model):
    exp = Experience.from_rollouts(rollouts(), pad_id=0)
    head = torch.nn.Linear(model.config.hidden_size, 1)
    scorer = model.model  # a hidden-state model and a head: how the critic scores every position
    captured = {}

    class Critic(torch.nn.Module):
        def forward(self, **kw):
            h = scorer(**kw).last_hidden_state
            captured["h"] = h
            return type("Out", (), {"logits": head(h)})()

    critic = Critic()
    index = list(range(len(exp)))
    with torch.no_grad():
        v_s = response_values(critic, head, exp.micro_batch(index))
        v_p = response_values(critic, head, exp.rows(index))
    m = exp.rows(index).mask
    assert torch.allclose(v_s * m, v_p * m, atol=1e-5) and (v_p * m).abs().sum() > 0


def test_rows_with_distinct_prompts_stay_padded_rows():
    exp = Experience.from_rollouts(rollouts(), pad_id=0)
    assert isinstance(exp.micro_batch([0, 1, 5]), Experience)
