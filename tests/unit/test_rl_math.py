"""Advantage estimators, KL estimators and the RL losses: hand-computed values and invariances."""

import math
from pathlib import Path

import pytest
import torch

from alignflow.stages.rl.advantages import Estimator, action_order, advantages, baselined_scores, gae, token_rewards, whiten
from alignflow.stages.rl.experience import response_widths
from alignflow.stages.rl.kl import KLEstimator, adaptive_kl_coef, kl_per_token
from alignflow.stages.common.logprobs import entropy_from_logits
from alignflow.stages.rl.losses import policy_loss, truncated_is_weight, value_loss

t = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
rows = lambda *r: torch.tensor(r, dtype=torch.float64)  # noqa: E731


def test_group_baselines_by_hand():
    s = math.sqrt(0.5)  # unbiased std of (1, 0)
    torch.testing.assert_close(baselined_scores(Estimator.GROUP_NORM, t(1, 0, 0, 1), 2, eps=0.0), t(0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s))
    torch.testing.assert_close(baselined_scores(Estimator.RLOO, t(1, 2, 3), 3), t(-1.5, 0.0, 1.5))
    torch.testing.assert_close(baselined_scores(Estimator.DR_GRPO, t(1, 2, 3), 3), t(-1.0, 0.0, 1.0))
    torch.testing.assert_close(baselined_scores(Estimator.REINFORCE_BASELINE, t(1, 2, 3, 5, 5, 5), 3), t(-1, 0, 1, 0, 0, 0))
    torch.testing.assert_close(baselined_scores(Estimator.GROUP_NORM, t(5, 5), 2), t(0.0, 0.0))  # equal rewards: no signal, no NaN


@pytest.mark.parametrize("estimator, expected", [
    (Estimator.GROUP_NORM, [[0.5**0.5, 0.5**0.5, 0.0], [-(0.5**0.5)] * 3]),  # (s - mean) / std, std = √0.5, on every token
    (Estimator.DR_GRPO, [[0.5, 0.5, 0.0], [-0.5, -0.5, -0.5]]),
    (Estimator.RLOO, [[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]]),
])
def test_group_estimators_broadcast_the_baselined_score(estimator, expected):
    mask = rows([1, 1, 0], [1, 1, 1])
    adv, _ = advantages(estimator, t(1.0, 0.0), mask, n=2)
    torch.testing.assert_close(adv, rows(*expected), atol=1e-5, rtol=0)


def test_returns_with_discount_and_kl_in_the_reward():
    mask = rows([1, 1, 0])
    _, returns = advantages(Estimator.REINFORCE, t(2.0), mask, gamma=0.5)
    torch.testing.assert_close(returns, rows([1.0, 2.0, 0.0]))  # score on the last token, discounted back
    _, returns = advantages(Estimator.REINFORCE, t(2.0), mask, kl=rows([0.1, 0.2, 0.3]))
    torch.testing.assert_close(returns, rows([1.7, 1.8, 0.0]))  # r = (-0.1, 2 - 0.2), padding ignored


def test_reinforce_whitens_over_the_batch():
    mask = rows([1, 0], [1, 1])
    adv, returns = advantages(Estimator.REINFORCE, t(1.0, 3.0), mask)
    torch.testing.assert_close(returns, rows([1.0, 0.0], [3.0, 3.0]))
    std = math.sqrt(8 / 9)  # of (1, 3, 3)
    torch.testing.assert_close(adv, rows([(1 - 7 / 3) / std, 0.0], [(3 - 7 / 3) / std, (3 - 7 / 3) / std]), atol=1e-6, rtol=0)
    base, _ = advantages(Estimator.REINFORCE_BASELINE, t(1.0, 3.0, 2.0, 2.0), rows([1, 1], [1, 1], [1, 0], [1, 0]), n=2)
    assert base[2, 0] == base[3, 0] and base[0, 0] < 0 < base[1, 0]  # group mean first, then the batch


def test_gae_by_hand():
    rewards, values, mask = rows([0.0, 1.0]), rows([0.5, 0.2]), rows([1, 1])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, rows([0.5, 0.8]))  # δ1 = 1 - 0.2; δ0 = 0.2 - 0.5; A0 = δ0 + A1
    torch.testing.assert_close(ret, rows([1.0, 1.0]))
    adv, _ = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, rows([0.9 * 0.2 - 0.5 + 0.45 * 0.8, 0.8]))
    adv, _ = gae(rows([0.0, 1.0, 9.0]), rows([0.5, 0.2, 7.0]), rows([1, 1, 0]), gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, rows([0.5, 0.8, 0.0]))  # padding neither gives nor gets value


def test_estimator_errors():
    with pytest.raises(ValueError, match="group_norm needs groups of n >= 2 samples per prompt; got n=1"):
        advantages(Estimator.GROUP_NORM, t(1.0, 2.0), rows([1], [1]), n=1)
    with pytest.raises(ValueError, match="gae needs the critic's values"):
        advantages(Estimator.GAE, t(1.0), rows([1]))
    assert Estimator.GAE.needs_critic and not Estimator.RLOO.needs_critic and Estimator.RLOO.is_group


def test_whiten_ignores_padding():
    out = whiten(rows([1.0, 100.0], [3.0, 100.0]), rows([1, 0], [1, 0]))
    torch.testing.assert_close(out, rows([-1.0, 0.0], [1.0, 0.0]), atol=1e-6, rtol=0)


def test_kl_estimators_by_hand():
    logp, ref = torch.log(t(0.5)), torch.log(t(0.25))  # log r = log(ref/π) = -log 2
    assert kl_per_token(logp, ref, KLEstimator.K1).item() == pytest.approx(math.log(2))
    assert kl_per_token(logp, ref, KLEstimator.K2).item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_per_token(logp, ref, KLEstimator.K3).item() == pytest.approx(0.5 - 1 + math.log(2))
    assert kl_per_token(t(0.0), t(-1e6), KLEstimator.K3).isfinite().all()  # clamped, no overflow
    for k in KLEstimator:
        assert kl_per_token(t(-1.3), t(-1.3), k).item() == 0.0


def test_adaptive_kl_coefficient():
    assert adaptive_kl_coef(0.1, 0.12, 0.1, horizon=10000, batch_size=64) == pytest.approx(0.1 * (1 + 0.2 * 64 / 10000))
    assert adaptive_kl_coef(0.1, 0.0, 0.1, horizon=100, batch_size=10) == pytest.approx(0.1 * (1 - 0.2 * 0.1))


def test_policy_loss_clipping_by_hand():
    one = rows([1])
    loss, m = policy_loss(torch.log(rows([1.5])), rows([0.0]), one, one)
    assert loss.item() == pytest.approx(-1.2) and m["clip_frac"].item() == 1.0  # ratio 1.5 clipped at 1.2
    loss, m = policy_loss(torch.log(rows([1.5])), rows([0.0]), one, one, clip_high=0.6)
    assert loss.item() == pytest.approx(-1.5) and m["clip_frac"].item() == 0.0  # clip-higher lets it through
    loss, _ = policy_loss(torch.log(rows([0.5])), rows([0.0]), -one, one)
    assert loss.item() == pytest.approx(0.8)  # negative advantage: ratio clipped at 0.8
    loss, _ = policy_loss(torch.log(rows([5.0])), rows([0.0]), -one, one)
    assert loss.item() == pytest.approx(5.0)
    loss, _ = policy_loss(torch.log(rows([5.0])), rows([0.0]), -one, one, dual_clip=3.0)
    assert loss.item() == pytest.approx(3.0)  # dual clip bounds it at c·|A|


def test_policy_loss_aggregation():
    per = rows([1.0, 3.0], [5.0, 9.0])  # -A with ratio 1: the per-token loss
    mask = rows([1, 1], [1, 0])
    token, _ = policy_loss(torch.zeros_like(per), torch.zeros_like(per), -per, mask, num_tokens=3)
    assert token.item() == pytest.approx((1 + 3 + 5) / 3)
    seq, _ = policy_loss(torch.zeros_like(per), torch.zeros_like(per), -per, mask, agg="sequence", num_sequences=2)
    assert seq.item() == pytest.approx((2 + 5) / 2)


@pytest.mark.parametrize("agg", ["token", "sequence"])
def test_policy_loss_gradient_is_the_same_over_micro_batches(agg):
    torch.manual_seed(0)
    logits = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    old, adv = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 5, dtype=torch.float64)
    mask = (torch.rand(6, 5) > 0.3).to(torch.float64)
    mask[:, 0] = 1
    totals = {"num_tokens": float(mask.sum()), "num_sequences": 6.0}
    full, _ = policy_loss(logits, old, adv, mask, agg=agg, **totals)
    (g_full,) = torch.autograd.grad(full, logits)
    parts = sum(policy_loss(logits[k:k + 2], old[k:k + 2], adv[k:k + 2], mask[k:k + 2], agg=agg, **totals)[0] for k in (0, 2, 4))
    (g_parts,) = torch.autograd.grad(parts, logits)
    torch.testing.assert_close(parts, full)
    torch.testing.assert_close(g_parts, g_full)


def test_value_loss_by_hand():
    one = rows([1])
    loss, m = value_loss(rows([1.0]), rows([0.5]), rows([0.0]), one, clip=0.2)
    assert loss.item() == pytest.approx(0.5) and m["value_clip_frac"].item() == 1.0  # unclipped error is larger
    loss, _ = value_loss(rows([0.9]), rows([0.5]), rows([1.0]), one, clip=0.2)
    assert loss.item() == pytest.approx(0.5 * 0.3**2)  # clipped value 0.7 is further from the target
    loss, _ = value_loss(rows([0.9]), rows([0.5]), rows([1.0]), one, clip=None)
    assert loss.item() == pytest.approx(0.5 * 0.1**2)


def test_entropy_of_a_uniform_distribution():
    assert entropy_from_logits(torch.zeros(1, 1, 4)).item() == pytest.approx(math.log(4))


# --------------------------------------------------------------------------- multi-turn: environment tokens in the mask
# A trajectory [answer a1 a2][environment e e][answer a3] then padding: mask 1 1 0 0 1 0. The steps are
# a1, a2, a3 (advantages.py's docstring): one γ step and one value bootstrap across the environment's reply.

HOLES = rows([1, 1, 0, 0, 1, 0])


def test_action_order_compacts_and_restores():
    mask = rows([1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0])
    index = action_order(mask)
    assert index.tolist() == [[0, 1, 4, 2, 3, 5], [0, 1, 2, 3, 4, 5]]
    x = rows([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12])
    torch.testing.assert_close(torch.zeros_like(x).scatter(-1, index, x.gather(-1, index)), x)
    assert response_widths(mask).tolist() == [5, 1]  # last 1 + 1, not the number of 1s


def test_discounted_returns_skip_environment_tokens_by_hand():
    _, returns = advantages(Estimator.REINFORCE, t(1.0), HOLES, gamma=0.5)
    torch.testing.assert_close(returns, rows([0.25, 0.5, 0.0, 0.0, 1.0, 0.0]))  # score on a3; a2 is one step before it
    kl = rows([0.1, 0.2, 9.0, 9.0, 0.3, 9.0])  # the environment's and padding's entries are never read
    _, returns = advantages(Estimator.REINFORCE, t(1.0), HOLES, kl=kl)
    torch.testing.assert_close(returns, rows([0.4, 0.5, 0.0, 0.0, 0.7, 0.0]))  # r = (-0.1, -0.2, 1 - 0.3)


def test_gae_skips_environment_tokens_by_hand():
    values = rows([0.5, 0.2, 7.0, 7.0, 0.4, 7.0])
    adv, ret = advantages(Estimator.GAE, t(1.0), HOLES, gamma=1.0, lam=1.0, values=values)
    # δ(a3) = 1 - 0.4; δ(a2) = V(a3) - V(a2) = 0.2 (bootstraps across the reply); δ(a1) = 0.2 - 0.5
    torch.testing.assert_close(adv, rows([0.5, 0.8, 0.0, 0.0, 0.6, 0.0]))
    torch.testing.assert_close(ret, rows([1.0, 1.0, 0.0, 0.0, 1.0, 0.0]))
    adv, _ = advantages(Estimator.GAE, t(1.0), HOLES, gamma=0.9, lam=0.5, values=values)
    a2 = 0.9 * 0.4 - 0.2 + 0.45 * 0.6  # Schulman et al. 2016 Eq. 16 over the action tokens
    torch.testing.assert_close(adv, rows([0.9 * 0.2 - 0.5 + 0.45 * a2, a2, 0.0, 0.0, 0.6, 0.0]))


def test_group_estimator_broadcasts_to_action_tokens_only():
    adv, _ = advantages(Estimator.DR_GRPO, t(1.0, 0.0), rows([1, 0, 1], [1, 1, 0]), n=2)
    torch.testing.assert_close(adv, rows([0.5, 0.0, 0.5], [-0.5, -0.5, 0.0]))


@pytest.mark.parametrize("estimator", list(Estimator))
def test_holes_equal_the_trajectory_without_environment_tokens(estimator):
    """Invariance: every estimator gives the action tokens of a mask with holes what it gives the same
    rows with the environment's tokens cut out, and 0 to the environment's tokens."""
    g = torch.Generator().manual_seed(0)
    mask = rows([1, 1, 0, 0, 1, 1, 0], [1, 0, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0], [1, 0, 0, 1, 0, 0, 1])
    scores = torch.randn(4, generator=g, dtype=torch.float64)
    kl, values = (torch.randn(4, 7, generator=g, dtype=torch.float64) for _ in range(2))
    values = values if estimator.needs_critic else None
    adv, ret = advantages(estimator, scores, mask, n=2, gamma=0.9, lam=0.8, kl=kl, values=values)

    def cut(x):  # each row's action tokens, left-aligned, zero-padded
        return torch.stack([torch.cat([x[b][mask[b] > 0], x.new_zeros(7 - int(mask[b].sum()))]) for b in range(4)])

    ref_adv, ref_ret = advantages(estimator, scores, cut(mask), n=2, gamma=0.9, lam=0.8, kl=cut(kl),
                                  values=cut(values) if values is not None else None)
    torch.testing.assert_close(cut(adv), ref_adv)
    torch.testing.assert_close(cut(ret), ref_ret)
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


def test_approx_kl_is_k3_of_kl_old_to_new_by_hand():
    """Samples come from π_old, so k3 of KL(π_old || π) takes r = π / π_old: π = 0.5, π_old = 0.25 -> r = 2,
    (2 - 1) - ln 2 = 0.30685 (the ratio the wrong way round would give (0.5 - 1) - ln 0.5 = 0.19315)."""
    logp, old = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    _, m = policy_loss(logp, old, torch.ones(1, 1), torch.ones(1, 1))
    assert float(m["approx_kl"]) == pytest.approx(1 - math.log(2), abs=1e-6)


def test_policy_loss_ignores_huge_log_ratios_on_padding():
    """Padding may hold any log-probs: exp(1000) is inf, and inf x mask 0 was NaN. The loss equals the one
    without the padded column; a real token's log-ratio is clamped to ±20 before exp."""
    logp, old, adv = torch.tensor([[-1.0, 500.0]]), torch.tensor([[-1.2, -500.0]]), torch.tensor([[1.0, 0.0]])  # 0 on padding
    mask = torch.tensor([[1.0, 0.0]])
    loss, m = policy_loss(logp, old, adv, mask, num_tokens=1.0)
    alone, _ = policy_loss(logp[:, :1], old[:, :1], adv[:, :1], mask[:, :1], num_tokens=1.0)
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in m.values()) and float(loss) == pytest.approx(float(alone))
    big, _ = policy_loss(torch.tensor([[100.0]]), torch.tensor([[0.0]]), torch.tensor([[-1.0]]), torch.ones(1, 1))
    assert float(big) == pytest.approx(math.exp(20.0), rel=1e-5)  # -min(r·A, clip(r)·A) with r = e^20, A = -1


def test_truncated_importance_weight_has_a_floor_and_a_cap_by_hand():
    old, engine = torch.log(torch.tensor([[0.1, 1.0, 5.0, 3.0]])), torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert truncated_is_weight(old, engine, mask, cap=2.0, floor=0.5)[0].tolist() == pytest.approx([0.5, 1.0, 2.0, 1.0])
    assert truncated_is_weight(old, engine, mask, cap=2.0)[0].tolist() == pytest.approx([0.1, 1.0, 2.0, 1.0])


def test_shaped_rewards_are_clipped_to_the_range_by_hand():
    """r_t = -kl_t, plus the score 3 on the last token: [-0.5, -4, 3] clipped to [-1, 2] -> [-0.5, -1, 2]; padding 0."""
    scores, mask = torch.tensor([3.0]), torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    kl = torch.tensor([[0.5, 4.0, 0.0, 9.0]])
    assert token_rewards(scores, mask, kl, clip=(-1.0, 2.0)).tolist() == [[-0.5, -1.0, 2.0, 0.0]]
    assert token_rewards(scores, mask, kl).tolist() == [[-0.5, -4.0, 3.0, 0.0]]
    adv, returns = advantages(Estimator.REINFORCE, scores, mask, kl=kl, reward_clip=(-1.0, 2.0))
    assert returns.tolist() == [[0.5, 1.0, 2.0, 0.0]]  # γ = 1: sums of the clipped rewards from each token on


def test_reward_clip_and_importance_floor_are_checked_at_load():
    from alignflow.config import ConfigError, load_config

    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny-grpo.yaml"
    with pytest.raises(ConfigError, match="kl.reward_clip bounds the reward the KL is placed in"):
        load_config(tiny, ["rl.kl.reward_clip=[-1, 1]"])
    with pytest.raises(ConfigError, match="low < high"):
        load_config(tiny, ["rl.kl.placement=reward", "rl.kl.reward_clip=[1, -1]"])
    with pytest.raises(ConfigError, match="importance_floor=0.5 needs an importance_cap above it"):
        load_config(tiny, ["rl.generation.importance_floor=0.5"])
    ok = load_config(tiny, ["rl.kl.placement=reward", "rl.kl.reward_clip=[-1, 1]", "rl.generation.importance_cap=2",
                            "rl.generation.importance_floor=0.5"]).section("rl")
    assert ok.kl.reward_clip == (-1.0, 1.0) and ok.generation.importance_floor == 0.5


def test_dropped_samples_are_left_out_of_their_groups_baseline_by_hand():
    scores = torch.tensor([1.0, 0.0, 5.0, 2.0, 7.0, 3.0])  # two groups of 3; 5.0 and both of 7.0 / 3.0 dropped
    present = torch.tensor([True, True, False, True, False, False])
    norm = baselined_scores(Estimator.GROUP_NORM, scores, 3, present=present)
    assert torch.allclose(norm, torch.tensor([0.5 / 0.5 ** 0.5, -0.5 / 0.5 ** 0.5, 0.0, 0.0, 0.0, 0.0]), atol=1e-5)
    assert baselined_scores(Estimator.RLOO, scores, 3, present=present).tolist() == [1.0, -1.0, 0.0, 0.0, 0.0, 0.0]
    assert baselined_scores(Estimator.DR_GRPO, scores, 3, present=present).tolist() == [0.5, -0.5, 0.0, 0.0, 0.0, 0.0]
    assert baselined_scores(Estimator.REINFORCE, scores, 3, present=present).tolist() == [1.0, 0.0, 0.0, 2.0, 0.0, 0.0]


@pytest.mark.parametrize("estimator", [Estimator.GROUP_NORM, Estimator.RLOO, Estimator.DR_GRPO, Estimator.REINFORCE_BASELINE])
def test_every_sample_present_is_the_plain_baseline(estimator):
    scores = torch.randn(12, generator=torch.Generator().manual_seed(0))
    plain = baselined_scores(estimator, scores, 4)
    assert torch.allclose(baselined_scores(estimator, scores, 4, present=torch.ones(12, dtype=torch.bool)), plain, atol=1e-6)
