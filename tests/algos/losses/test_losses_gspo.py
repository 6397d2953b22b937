"""GSPO: sequence-level ratios, clipped per sequence; expected values by hand (math, not the code)."""

import math

import pytest
import torch

from algos.losses.surrogates.gspo import gspo_policy_loss

G = 1e6


def _t(x, grad=False):
    return torch.tensor(x, dtype=torch.float64, requires_grad=grad)


# row 0: 3 tokens, log-ratios 0.3, -0.1, 0.1 -> mean 0.1; row 1: 2 tokens, 0, 2e-4 -> mean 1e-4; padding garbage
OLD = [[0.0, 0.0, 0.0, -G], [-1.0, -2.0, G, G]]
LP = [[0.3, -0.1, 0.1, G], [-1.0, -2.0 + 2e-4, -G, G]]
ADV = [[1.0, 1.0, 1.0, G], [-2.0, -2.0, G, -G]]
MASK = [[1, 1, 1, 0], [1, 1, 0, 0]]
S0, S1 = math.exp(0.1), math.exp(1e-4)


def test_sequence_ratio_clipped_per_sequence():
    lp = _t(LP, grad=True)
    out = gspo_policy_loss(lp, _t(OLD), _t(ADV), torch.tensor(MASK), clip_low=3e-4, clip_high=4e-4)
    # row 0: s = e^0.1 > 1 + 4e-4 with A = +1: clipped, l = -(1 + 4e-4) on each token
    # row 1: s = e^1e-4 inside [1 - 3e-4, 1 + 4e-4], A = -2: l = 2 s on each token
    l0, l1 = -(1 + 4e-4), 2 * S1
    assert out.token_loss.tolist() == [pytest.approx([l0, l0, l0, 0.0], rel=1e-12),
                                       pytest.approx([l1, l1, 0.0, 0.0], rel=1e-12)]
    assert out.loss.item() == pytest.approx((l0 + l1) / 2, rel=1e-12)  # seq_mean_token_mean
    assert out.clip_fraction.item() == pytest.approx(3 / 5)
    assert out.ratio_mean.item() == pytest.approx((3 * S0 + 2 * S1) / 5, rel=1e-12)
    token_log_ratios = [0.3, -0.1, 0.1, 0.0, 2e-4]
    kl = sum(math.expm1(x) - x for x in token_log_ratios) / 5
    assert out.approx_kl.item() == pytest.approx(kl, rel=1e-6)
    out.loss.backward()
    # clipped row: no gradient; row 1: d/d lp_t of (1/2)(1/2) sum_t 2 s1 = s1 / 2 (GSPO-token gradient
    # s_i * grad log pi_t, as the sequence form d s1 / d lp_t = s1 / |y|)
    assert lp.grad.tolist() == [pytest.approx([0.0] * 4, abs=1e-15),
                                pytest.approx([S1 / 2, S1 / 2, 0.0, 0.0], rel=1e-12)]


def test_equals_the_sequence_objective_in_value_and_gradient():
    """With seq_mean_token_mean, wide clip: -1/G sum_i s_i A_i, s_i = exp(mean_t (lp - old))."""
    lp = _t(LP, grad=True)
    out = gspo_policy_loss(lp, _t(OLD), _t(ADV), torch.tensor(MASK), clip_low=0.5, clip_high=0.5)
    assert out.loss.item() == pytest.approx(-(S0 * 1.0 + S1 * -2.0) / 2, rel=1e-12)
    assert out.clip_fraction.item() == 0.0
    out.loss.backward()
    # d/d lp_{i,t} = -A_i s_i / |y_i| / G
    assert lp.grad[0].tolist() == pytest.approx([-S0 / 3 / 2] * 3 + [0.0], rel=1e-12)
    assert lp.grad[1].tolist() == pytest.approx([2 * S1 / 2 / 2] * 2 + [0.0, 0.0], rel=1e-12)


def test_token_mean_weighs_rows_by_length():
    out = gspo_policy_loss(_t(LP), _t(OLD), _t(ADV), torch.tensor(MASK), clip_low=0.5, clip_high=0.5,
                           agg="token_mean")
    assert out.loss.item() == pytest.approx((3 * -S0 + 2 * 2 * S1) / 5, rel=1e-12)


def test_rollout_weights_apply_per_token():
    # old - rollout = ln 3 on row 0 token 1 (ratio 3 > cap 2): masked; elsewhere 0 (weight 1)
    roll = [[0.0, -math.log(3.0), 0.0, 0.0], [-1.0, -2.0, 0.0, 0.0]]
    out = gspo_policy_loss(_t(LP), _t(OLD), _t(ADV), torch.tensor(MASK), clip_low=0.5, clip_high=0.5,
                           rollout_logprobs=_t(roll), tis_cap=2.0, tis_mode="mask")
    assert out.token_loss[0].tolist() == pytest.approx([-S0, 0.0, -S0, 0.0], rel=1e-12)
    assert out.tis_masked_fraction.item() == pytest.approx(1 / 5)
    assert out.loss.item() == pytest.approx(((-2 * S0) / 3 + 2 * S1) / 2, rel=1e-12)


def test_fully_masked_row_and_extreme_ratios_stay_finite():
    lp = _t([[50.0, 50.0], [0.0, 0.0]], grad=True)
    out = gspo_policy_loss(lp, torch.zeros(2, 2, dtype=torch.float64), _t([[1.0, 1.0], [1.0, 1.0]]),
                           torch.tensor([[1, 1], [0, 0]]))
    out.loss.backward()
    for v in (out.loss, out.approx_kl, out.clip_fraction, out.ratio_mean):
        assert torch.isfinite(v).all()
    assert torch.isfinite(lp.grad).all()
    assert out.loss.item() == pytest.approx(-(1 + 4e-4))  # the only row, clipped at 1 + clip_high


def test_a_bf16_sequence_ratio_is_clipped_as_in_float32():
    # A sequence log-ratio of 0.002 (ratio 1.002) lies past GSPO's clip_high 4e-4: with a positive advantage the
    # clipped term wins and the gradient is 0. In bf16, exp(x) near 1 steps by 0.4 % and reads 1.0: unclipped.
    for dtype in (torch.float32, torch.bfloat16):
        lp = torch.full((1, 4), -1.0 + 0.002, dtype=dtype, requires_grad=True)
        out = gspo_policy_loss(lp, torch.full((1, 4), -1.0, dtype=dtype), torch.ones(1, 4), torch.ones(1, 4),
                               agg="seq_mean_token_mean")
        out.loss.backward()
        assert out.clip_fraction.item() == 1.0, dtype
        assert lp.grad.abs().sum().item() == 0.0, dtype
