"""GMPO, SAPO, Clip-Cov, KL-Cov and the plain policy gradient (GPG's) against their papers' formulas, computed here
in plain Python."""

from __future__ import annotations

import math

import pytest
import torch

from algos import (clip_cov_policy_loss, gmpo_policy_loss, kl_cov_policy_loss, ppo_policy_loss, sapo_policy_loss,
                   token_covariance, vanilla_policy_loss)
from algos.masked import top_k_mask


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# ---- GMPO ------------------------------------------------------------------------------------


def test_gmpo_is_the_geometric_mean_of_the_pessimistic_token_ratios():
    """Row 0 (A = 1): log-ratios 0.1, 0.5, -0.2; clip in log space at 0.4 takes 0.5 down to 0.4 (the min).
    Row 1 (A = -1, two valid tokens): 0.6, -0.7; the max with the clip keeps 0.6 and lifts -0.7 to -0.4."""
    x = torch.tensor([[0.1, 0.5, -0.2], [0.6, -0.7, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3])
    new = x.clone().requires_grad_(True)
    out = gmpo_policy_loss(new, torch.zeros_like(x), adv, mask, clip_low=0.4, clip_high=0.4)
    # the paper's product form: |A| prod_t |min(r A, clip(r) A)|^(1/|y|) sgn(A)
    row0 = math.prod(min(math.exp(v), math.exp(max(-0.4, min(0.4, v)))) for v in (0.1, 0.5, -0.2)) ** (1 / 3)
    row1 = math.prod(max(math.exp(v), math.exp(max(-0.4, min(0.4, v)))) for v in (0.6, -0.7)) ** (1 / 2)
    assert out.loss.item() == pytest.approx(-(row0 - row1) / 2, rel=1e-6)
    out.loss.backward()
    # d/dx_t of -(1/G) A g / |y| on the tokens the clip left (row 0's second, row 1's second clipped: 0)
    expect = [[-row0 / 3 / 2, 0.0, -row0 / 3 / 2], [row1 / 2 / 2, 0.0, 0.0]]
    assert new.grad.flatten().tolist() == pytest.approx(sum(expect, []), rel=1e-5)
    assert out.clip_fraction.item() == pytest.approx(2 / 5)
    assert out.ratio_mean.item() == pytest.approx((3 * row0 + 2 * row1) / 5, rel=1e-6)


def test_gmpo_moves_less_than_the_arithmetic_mean_for_one_outlying_token():
    """One token at ratio e^3 among ones: GMPO without a clip reads e^(3/4); the arithmetic mean (1 + 1 + 1 +
    e^3) / 4 is far larger."""
    x = torch.tensor([[0.0, 0.0, 0.0, 3.0]])
    out = gmpo_policy_loss(x, torch.zeros_like(x), torch.ones_like(x), torch.ones_like(x), clip_low=10.0,
                           clip_high=10.0)
    assert -out.loss.item() == pytest.approx(math.exp(0.75), rel=1e-6)
    ppo = ppo_policy_loss(x, torch.zeros_like(x), torch.ones_like(x), torch.ones_like(x), clip_low=10.0,
                          clip_high=30.0)  # no clip either: the arithmetic mean of the ratios
    assert -ppo.loss.item() == pytest.approx((3 + math.exp(3)) / 4, rel=1e-6)
    assert -ppo.loss.item() > 2 * -out.loss.item()


def test_gmpo_refuses_a_dual_clip():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="dual_clip"):
        gmpo_policy_loss(x, x, x, torch.ones(1, 2), dual_clip=3.0)


# ---- SAPO ------------------------------------------------------------------------------------


@pytest.mark.parametrize("r,a", [(1.0, 1.0), (1.3, 1.0), (0.6, -2.0), (1.8, -1.0), (3.0, 1.0), (0.1, -1.0)])
def test_sapo_value_and_gradient_follow_the_soft_gate(r, a):
    tau = 1.0 if a > 0 else 1.05
    new = torch.tensor([[math.log(r)]], requires_grad=True)
    out = sapo_policy_loss(new, torch.zeros(1, 1), torch.tensor([[a]]), torch.ones(1, 1))
    s = _sigmoid(tau * (r - 1))
    assert out.loss.item() == pytest.approx(-s * 4 / tau * a, rel=1e-6)
    out.loss.backward()
    # d/dlog r of -(4/tau) sigmoid(tau (r - 1)) A = -4 s (1 - s) r A
    assert new.grad.item() == pytest.approx(-4 * s * (1 - s) * r * a, rel=1e-5)
    assert out.clip_fraction.item() == float(4 * s * (1 - s) < 0.5)


def test_sapo_matches_ppo_on_policy_and_damps_off_policy_without_a_cliff():
    """At ratio 1 its gradient is PPO's; at 1.25 PPO's clip (0.2) has cut the gradient off, SAPO's is still most
    of it; far out (ratio 10) SAPO's has decayed too."""
    grads = {}
    for name, fn in (("sapo", sapo_policy_loss), ("ppo", ppo_policy_loss)):
        for r in (1.0, 1.25, 10.0):
            new = torch.tensor([[math.log(r)]], requires_grad=True)
            fn(new, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1)).loss.backward()
            grads[name, r] = -new.grad.item()
    assert grads["sapo", 1.0] == pytest.approx(1.0) and grads["ppo", 1.0] == pytest.approx(1.0)
    assert grads["ppo", 1.25] == 0.0 and grads["sapo", 1.25] > 0.9
    assert grads["sapo", 10.0] < 0.01


def test_sapo_refuses_a_temperature_of_zero():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="temperatures"):
        sapo_policy_loss(x, x, x, torch.ones(1, 2), tau_negative=0.0)


# ---- Clip-Cov / KL-Cov -----------------------------------------------------------------------


def test_token_covariance_is_centred_over_the_valid_tokens():
    lp = torch.tensor([[-1.0, -2.0, 7.0], [-3.0, 0.0, 0.0]])
    adv = torch.tensor([[2.0, 0.0, 5.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    valid = [(-1.0, 2.0), (-2.0, 0.0), (-3.0, 1.0), (0.0, 1.0)]
    mlp, madv = sum(v[0] for v in valid) / 4, sum(v[1] for v in valid) / 4
    cov = [(a - mlp) * (b - madv) for a, b in valid]
    assert token_covariance(lp, adv, mask).flatten().tolist() == pytest.approx([cov[0], cov[1], 0.0, cov[2], cov[3], 0.0])


def test_top_k_mask_keeps_k_or_every_eligible():
    scores = torch.tensor([[0.3, 0.9, 0.1], [0.8, 0.5, 0.7]])
    eligible = torch.tensor([[True, False, True], [True, True, True]])
    assert top_k_mask(scores, eligible, torch.tensor(2)).tolist() == [[False, False, False], [True, False, True]]
    few = torch.tensor([[False, False, True], [False, False, False]])
    assert top_k_mask(scores, few, torch.tensor(2)).tolist() == [[False, False, True], [False, False, False]]
    ties = torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.1, 0.5]])  # exactly k, the first in row-major order
    assert top_k_mask(ties, torch.ones(2, 3, dtype=torch.bool), torch.tensor(3)).tolist() == [
        [True, True, True], [False, False, False]]


def _cov_batch():
    """8 valid tokens; A = +-1 by row, log-probs spread so that covariances differ."""
    lp = torch.tensor([[-0.1, -0.2, -3.0, -4.0], [-0.3, -5.0, -6.0, -0.2]])
    adv = torch.tensor([[1.0] * 4, [-1.0] * 4])
    return lp, adv, torch.ones(2, 4)


def test_kl_cov_penalises_the_top_covariance_tokens_and_clips_nothing():
    lp, adv, mask = _cov_batch()
    old = lp - torch.tensor([[0.5, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, -0.1]])  # token (0, 0) at ratio e^0.5
    new = lp.clone().requires_grad_(True)
    out = kl_cov_policy_loss(new, old, adv, mask, fraction=0.25, kl_coef=2.0)  # k = floor(0.25 * 8) = 2
    m_lp, m_a = lp.mean().item(), 0.0
    cov = [[(lp[i, j].item() - m_lp) * (adv[i, j].item() - m_a) for j in range(4)] for i in range(2)]
    top = sorted(((cov[i][j], (i, j)) for i in range(2) for j in range(4)), reverse=True)[:2]
    x = (new - old).detach()
    expect = sum(-adv[i, j].item() * math.exp(x[i, j].item()) for i in range(2) for j in range(4))
    expect += sum(2.0 * abs(x[i, j].item()) for _, (i, j) in top)
    assert out.loss.item() == pytest.approx(expect / 8, rel=1e-6)
    assert out.cov_fraction.item() == pytest.approx(2 / 8) and out.clip_fraction.item() == 0.0
    out.loss.backward()  # no clip: the e^0.5 token keeps its full -A r gradient (plus its penalty, if picked)
    picked = {ij for _, ij in top}
    g00 = (-math.exp(0.5) + (2.0 if (0, 0) in picked else 0.0)) / 8
    assert new.grad[0, 0].item() == pytest.approx(g00, rel=1e-5)


def test_clip_cov_cuts_k_random_tokens_in_the_bounds_and_never_a_clipped_one():
    lp, adv, mask = _cov_batch()
    cov = token_covariance(lp, adv, mask)
    bounds = (0.5, 5.0)
    old = lp.clone()
    old[0, 1] -= 1.0  # ratio e: PPO clips it (A > 0); it is in the bounds otherwise
    assert bounds[0] < cov[0, 1] < bounds[1]
    eligible = {(i, j) for i in range(2) for j in range(4) if bounds[0] < cov[i, j] < bounds[1]} - {(0, 1)}
    assert len(eligible) >= 3
    cuts = []
    for seed in range(6):
        new = lp.clone().requires_grad_(True)
        draw = torch.Generator().manual_seed(seed)
        out = clip_cov_policy_loss(new, old, adv, mask, fraction=0.25, bounds=bounds, generator=draw)  # k = 2
        out.loss.backward()
        full = ppo_policy_loss(lp, old, adv, mask)
        zero = {(i, j) for i in range(2) for j in range(4) if new.grad[i, j] == 0} - {(0, 1)}  # (0, 1): PPO's clip
        assert len(zero) == 2 and zero <= eligible
        # the loss is PPO's, less the two cut tokens' terms, over the same 8 tokens
        cut_terms = sum(-adv[i, j].item() for i, j in zero)  # ratio 1 there
        assert out.loss.item() == pytest.approx(full.loss.item() - cut_terms / 8, abs=1e-6)
        assert out.cov_fraction.item() == pytest.approx(2 / 8)
        again = clip_cov_policy_loss(lp, old, adv, mask, fraction=0.25, bounds=bounds,
                                     generator=torch.Generator().manual_seed(seed))
        assert again.loss.item() == out.loss.item()  # the generator's state decides the draw
        cuts.append(frozenset(zero))
    assert len(set(cuts)) > 1  # and different seeds draw differently


@pytest.mark.parametrize("fn,kwargs", [(clip_cov_policy_loss, dict(bounds=(2.0, 1.0))),
                                       (kl_cov_policy_loss, dict(fraction=0.0))])
def test_covariance_controls_refuse_bad_settings(fn, kwargs):
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError):
        fn(x, x, x, torch.ones(1, 2), **kwargs)


# ---- the plain policy gradient (GPG's loss) ---------------------------------------------------------


def test_vanilla_gradient_is_reinforce_whatever_the_ratio():
    """log pi - log pi_old of 0.1, 0.5, -0.2 (A = 2) and 0.6, -0.7 (A = -1): the loss is -mean A (token mean
    over the 5 valid tokens), its gradient -A / 5 on each token's log-prob, with no ratio and no clip in it."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.1, -4.0]])
    shift = torch.tensor([[0.1, 0.5, -0.2], [0.6, -0.7, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([[2.0] * 3, [-1.0] * 3])
    new = (old + shift).requires_grad_(True)
    out = vanilla_policy_loss(new, old, adv, mask)
    assert out.loss.item() == pytest.approx(-(3 * 2.0 - 2 * 1.0) / 5, rel=1e-6)
    out.loss.backward()
    assert new.grad.flatten().tolist() == pytest.approx([-2 / 5] * 3 + [1 / 5, 1 / 5, 0.0], rel=1e-6)
    assert out.clip_fraction.item() == 0.0
    ratios = [math.exp(x) for x in (0.1, 0.5, -0.2, 0.6, -0.7)]
    assert out.ratio_mean.item() == pytest.approx(sum(ratios) / 5, rel=1e-6)
    # PPO's clipped surrogate at the same point moves differently: its gradient is r A where unclipped
    ppo_new = (old + shift).requires_grad_(True)
    ppo_policy_loss(ppo_new, old, adv, mask).loss.backward()
    assert ppo_new.grad[0, 0].item() == pytest.approx(-2 * math.exp(0.1) / 5, rel=1e-6)


def test_vanilla_with_rollout_logprobs_weighs_each_token_by_its_truncated_ratio():
    """TIS: each token's term times min(pi_old / pi_rollout, cap) = min(e^d, 2) for d = 0.2, 1.0 (capped), -0.5."""
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    rollout = old - torch.tensor([[0.2, 1.0, -0.5]])
    adv, mask = torch.ones(1, 3), torch.ones(1, 3)
    new = old.clone().requires_grad_(True)
    out = vanilla_policy_loss(new, old, adv, mask, rollout_logprobs=rollout, tis_cap=2.0)
    weights = [math.exp(0.2), 2.0, math.exp(-0.5)]
    assert out.loss.item() == pytest.approx(-sum(weights) / 3, rel=1e-6)
    out.loss.backward()
    assert new.grad.flatten().tolist() == pytest.approx([-w / 3 for w in weights], rel=1e-6)
