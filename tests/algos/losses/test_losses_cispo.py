"""CISPO's loss against sums done by hand: values, gradients, the clipped weights, TIS, padding."""

import math

import pytest
import torch

from algos.losses.surrogates.cispo import cispo_policy_loss
from algos.losses.policy import ppo_policy_loss


def _t(rows, grad=False):
    return torch.tensor(rows, dtype=torch.float64, requires_grad=grad)


def test_value_and_gradient_are_the_clipped_weight_times_the_advantage():
    # log-ratios 0, log 8 (ratio 8: clipped to 6), log 0.5; the last token is padding.
    lp = _t([[-1.0, -2.0 + math.log(8), -0.5 + math.log(0.5), 7.0]], grad=True)
    old = _t([[-1.0, -2.0, -0.5, 0.0]])
    adv = _t([[1.0, 2.0, -1.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    out = cispo_policy_loss(lp, old, adv, mask)
    weights = [1.0, 6.0, 0.5]  # clip(rho, 0, 6)
    per_token = [-w * a for w, a in zip(weights, [1.0, 2.0, -1.0])]
    assert out.loss.item() == pytest.approx(sum(per_token) / 3)
    assert out.token_loss[0].tolist() == pytest.approx([*per_token, 0.0])
    assert out.clip_fraction.item() == pytest.approx(1 / 3)
    assert out.ratio_mean.item() == pytest.approx((1 + 8 + 0.5) / 3)
    out.loss.backward()
    # d l / d log pi = -w A / 3 (token mean): the clipped token keeps a gradient, unlike PPO's
    assert lp.grad[0].tolist() == pytest.approx([-1.0 / 3, -12.0 / 3, 0.5 / 3, 0.0])
    ppo_lp = lp.detach().clone().requires_grad_()
    ppo_policy_loss(ppo_lp, old, adv, mask, clip_low=0.2, clip_high=0.2).loss.backward()
    assert ppo_lp.grad[0, 1].item() == 0.0  # what CISPO keeps: PPO drops a token clipped on its side


def test_on_policy_it_is_ppos_gradient_and_tis_weights_each_token():
    torch.manual_seed(0)
    lp = torch.randn(2, 5, dtype=torch.float64)
    adv, mask = torch.randn(2, 5, dtype=torch.float64), torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    grads = []
    for loss in (cispo_policy_loss, ppo_policy_loss):
        x = lp.clone().requires_grad_()
        loss(x, lp, adv, mask).loss.backward()  # the first epoch: pi = pi_old, every ratio 1
        grads.append(x.grad)
    assert torch.allclose(grads[0], grads[1])
    rollout = lp - torch.tensor([[0.3, -0.2, 1.5, 0.0, 0.0], [0.0] * 5], dtype=torch.float64)
    out = cispo_policy_loss(lp.clone().requires_grad_(), lp, adv, mask, rollout_logprobs=rollout, tis_cap=2.0)
    tis = torch.exp(lp - rollout).clamp(max=2.0)  # min(exp(old - rollout), cap)
    expected = torch.where(mask.bool(), -adv * tis, torch.zeros_like(adv))
    assert torch.allclose(out.token_loss.detach(), expected)


def test_extreme_ratios_and_an_empty_batch_stay_finite_and_dual_clip_is_refused():
    lp = _t([[50.0, -50.0]], grad=True)
    out = cispo_policy_loss(lp, _t([[0.0, 0.0]]), _t([[1.0, -1.0]]), torch.tensor([[1, 1]]))
    assert math.isfinite(out.loss.item()) and out.loss.item() == pytest.approx((-6.0 + math.exp(-20)) / 2)
    out.loss.backward()  # past the log-ratio's clamp too, the token keeps its gradient -w A / 2
    assert lp.grad[0].tolist() == pytest.approx([-6.0 / 2, math.exp(-20) / 2])
    empty = cispo_policy_loss(_t([[1.0]]), _t([[0.0]]), _t([[1.0]]), torch.tensor([[0]]))
    assert empty.loss.item() == 0.0 and empty.tis_weight_mean.item() == 1.0
    with pytest.raises(ValueError, match="dual_clip"):
        cispo_policy_loss(_t([[1.0]]), _t([[0.0]]), _t([[1.0]]), torch.tensor([[1]]), dual_clip=3.0)
