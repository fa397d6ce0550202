"""Hand-computed values and edge cases for the RM, DPO/cDPO/IPO and KTO losses."""

import math

import pytest
import torch

from alignflow.stages.common.logprobs import sequence_logprobs
from alignflow.stages.dpo.losses import preference_loss
from alignflow.stages.kto.losses import kto_loss, kto_reference_point
from alignflow.stages.rm.losses import pairwise_loss

t = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
softplus = lambda x: math.log1p(math.exp(x))  # noqa: E731  -log σ(-x)


def test_sequence_logprobs_sum_response_tokens_only():
    logps = t(-1.0, -2.0, -3.0).unsqueeze(0)
    assert sequence_logprobs(logps, torch.tensor([[0, 0, 1, 1]])).item() == -5.0
    assert sequence_logprobs(logps, torch.zeros(1, 4)).item() == 0.0  # a mask that selects nothing


def test_pairwise_sigmoid_and_logexp_by_hand():
    loss, m = pairwise_loss(t(2.0, 0.0), t(0.0, 0.0))
    expected = (softplus(-2.0) + math.log(2)) / 2  # -log σ(2), -log σ(0)
    assert loss.item() == pytest.approx(expected)
    assert pairwise_loss(t(2.0, 0.0), t(0.0, 0.0), "logexp")[0].item() == pytest.approx(expected)
    assert m["accuracy"].item() == 0.5 and m["margin"].item() == 1.0 and m["reward_chosen"].item() == 1.0
    with_margin, _ = pairwise_loss(t(2.0, 0.0), t(0.0, 0.0), margin=t(1.0, 0.0))
    assert with_margin.item() == pytest.approx((softplus(-1.0) + math.log(2)) / 2)


def test_pairwise_large_rewards_do_not_overflow():
    assert pairwise_loss(t(1000.0), t(-1000.0))[0].item() == 0.0
    assert pairwise_loss(t(-1000.0), t(1000.0))[0].item() == pytest.approx(2000.0)
    assert pairwise_loss(t(-1000.0), t(1000.0), "logexp")[0].item() == pytest.approx(2000.0)
    with pytest.raises(ValueError, match="sigmoid or logexp"):
        pairwise_loss(t(1.0), t(0.0), "hinge")


def test_dpo_cdpo_ipo_by_hand():
    args = (t(-1.0), t(-3.0), t(-2.0), t(-2.0))  # z = (-1 + 3) - 0 = 2
    dpo, m = preference_loss(*args, beta=0.5)
    assert dpo.item() == pytest.approx(softplus(-1.0))  # -log σ(0.5 * 2)
    cdpo, _ = preference_loss(*args, beta=0.5, label_smoothing=0.1)
    assert cdpo.item() == pytest.approx(0.9 * softplus(-1.0) + 0.1 * softplus(1.0))
    ipo, _ = preference_loss(*args, beta=0.5, kind="ipo")
    assert ipo.item() == pytest.approx((2 - 1 / (2 * 0.5)) ** 2)
    assert m["rewards/chosen"].item() == 0.5 and m["rewards/rejected"].item() == -0.5
    assert m["rewards/accuracy"].item() == 1.0 and m["rewards/margin"].item() == 1.0
    rpo, m = preference_loss(*args, beta=0.5, chosen_nll=t(0.25), nll_weight=2.0)
    assert rpo.item() == pytest.approx(softplus(-1.0) + 0.5) and m["nll"].item() == 0.25


def test_dpo_equal_logprobs_and_extremes():
    same = (t(-2.0), t(-2.0), t(-2.0), t(-2.0))
    assert preference_loss(*same, beta=0.1)[0].item() == pytest.approx(math.log(2))
    assert preference_loss(*same, beta=0.1, kind="ipo")[0].item() == pytest.approx(25.0)  # (1/(2*0.1))^2
    huge = preference_loss(t(0.0), t(-1e4), t(0.0), t(0.0), beta=1.0)[0]
    assert huge.item() == 0.0 and torch.isfinite(preference_loss(t(-1e4), t(0.0), t(0.0), t(0.0), beta=1.0)[0])


def test_kto_by_hand():
    policy, ref = t(-1.0, -2.0), t(-1.5, -1.5)  # r = (0.5, -0.5)
    mism_policy, mism_ref = t(-3.0, -3.0), t(-3.4, -3.2)  # KL estimate 0.3
    kl = kto_reference_point(mism_policy, mism_ref)
    loss, m = kto_loss(policy, ref, torch.tensor([True, False]), kl, beta=1.0, desirable_weight=1.0, undesirable_weight=2.0)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expected = ((1 - sig(0.5 - 0.3)) + 2 * (1 - sig(0.3 + 0.5))) / 2
    assert loss.item() == pytest.approx(expected)
    assert m["kl"].item() == pytest.approx(0.3)
    assert m["rewards/desirable"].item() == 0.5 and m["rewards/undesirable"].item() == -0.5
    assert m["rewards/margin"].item() == 1.0


def test_kto_reference_point_is_clamped_and_carries_no_gradient():
    mism_policy = t(-5.0, -5.0).requires_grad_()
    policy = t(-1.0, -1.0).requires_grad_()
    kl = kto_reference_point(mism_policy, t(-1.0, -1.0))
    loss, m = kto_loss(policy, t(-1.0, -1.0), torch.tensor([True, True]), kl, beta=0.1)
    assert m["kl"].item() == 0.0  # a negative estimate is clamped to 0
    loss.backward()
    assert mism_policy.grad is None and policy.grad is not None
    only_good, m = kto_loss(t(0.0), t(0.0), torch.tensor([True]), kto_reference_point(t(0.0), t(0.0)), beta=0.1)
    assert m["rewards/undesirable"].item() == 0.0 and only_good.item() == pytest.approx(0.5)
