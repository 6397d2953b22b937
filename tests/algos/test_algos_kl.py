"""KL estimators, KL-penalised token rewards and KL controllers."""

import math

import pytest
import torch

from algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    kl_penalized_rewards,
    sequence_k1,
)

G = 1e6


def _k(kind, d):
    if kind == "k1":
        return d
    if kind == "k2":
        return d * d / 2.0
    return math.exp(-d) - 1.0 + d


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimate_values(kind):
    lp = [[-1.0, -0.5, -2.0, -0.1]]
    ref = [[-1.5, 0.5, -4.0, -0.1]]
    out = kl_estimate(torch.tensor(lp, dtype=torch.float64),
                      torch.tensor(ref, dtype=torch.float64), kind=kind)
    expected = [_k(kind, a - b) for a, b in zip(lp[0], ref[0])]
    assert out[0].tolist() == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_k3_nonnegative_and_zero_at_equal():
    d = torch.linspace(-5, 5, 21, dtype=torch.float64).unsqueeze(0)
    out = kl_estimate(d, torch.zeros_like(d), kind="k3")
    assert (out >= 0).all()
    assert out[0, 10].item() == 0.0


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_clamp_applies_to_log_ratio_and_keeps_extremes_finite(kind):
    lp = torch.tensor([[50.0, -50.0, -100.0, 0.3]])
    ref = torch.zeros_like(lp)
    out = kl_estimate(lp, ref, kind=kind, clamp=20.0)
    assert torch.isfinite(out).all()
    expected = [_k(kind, d) for d in (20.0, -20.0, -20.0, 0.3)]
    assert out[0].tolist() == pytest.approx(expected, rel=1e-5)
    # +-50 stays finite in float32 even without the clamp
    assert torch.isfinite(kl_estimate(lp[:, :2], ref[:, :2], kind=kind)).all()


def test_unknown_kind_lists_valid_kinds():
    with pytest.raises(ValueError) as err:
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), kind="k4")
    for name in ("k1", "k2", "k3"):
        assert name in str(err.value)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_penalized_rewards_values(kind):
    coef = 0.05
    seq = [1.0, -2.0, 3.0, 0.5]
    lp = [[-1.0, -2.0, -0.5, G], [-0.3, G, -0.7, G], [G, G, G, G], [-1.0, -1.0, -1.0, -1.0]]
    ref = [[-1.2, -1.0, -0.5, -G], [-0.4, -G, -0.2, -G], [-G, -G, -G, -G], [-2.0, -0.5, -1.0, -3.0]]
    mask = [[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    out = kl_penalized_rewards(
        torch.tensor(seq, dtype=torch.float64), torch.tensor(lp, dtype=torch.float64),
        torch.tensor(ref, dtype=torch.float64), torch.tensor(mask, dtype=torch.bool),
        kl_coef=coef, kind=kind,
    )
    for b in range(4):
        valid = [t for t in range(4) if mask[b][t]]
        for t in range(4):
            exp = 0.0
            if mask[b][t]:
                exp = -coef * _k(kind, lp[b][t] - ref[b][t])
                if t == valid[-1]:
                    exp += seq[b]
            assert out[b, t].item() == pytest.approx(exp, rel=1e-12, abs=1e-15), (b, t)
    assert out[2].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_kl_penalized_rewards_clamp_and_float_mask():
    lp = torch.tensor([[0.0, -60.0]])
    ref = torch.tensor([[0.0, 0.0]])
    out = kl_penalized_rewards(torch.tensor([1.0]), lp, ref, torch.tensor([[1.0, 1.0]]),
                               kl_coef=0.1, kind="k3", clamp=10.0)
    assert out[0, 0].item() == 0.0
    assert out[0, 1].item() == pytest.approx(1.0 - 0.1 * (math.exp(10.0) - 1.0 - 10.0), rel=1e-5)


def test_kl_penalized_rewards_bad_shapes():
    with pytest.raises(ValueError):
        kl_penalized_rewards(torch.ones(3), torch.zeros(2, 4), torch.zeros(2, 4),
                             torch.ones(2, 4), kl_coef=0.1)


def test_fixed_controller():
    c = FixedKLController(0.3)
    assert c.value == 0.3
    assert c.update(100.0, 512) == 0.3
    assert c.value == 0.3


def test_adaptive_controller_matches_hand_arithmetic():
    c = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    expected = 0.1
    # error clipped at +0.2
    c.update(12.0, 256)
    expected *= 1 + 0.2 * 256 / 10000
    assert c.value == pytest.approx(expected, rel=1e-12)
    # error clipped at -0.2 (3/6 - 1 = -0.5)
    c.update(torch.tensor(3.0), 256)
    expected *= 1 - 0.2 * 256 / 10000
    assert c.value == pytest.approx(expected, rel=1e-12)
    # unclipped error 6.6/6 - 1 = 0.1
    c.update(6.6, 100)
    expected *= 1 + 0.1 * 100 / 10000
    assert c.value == pytest.approx(expected, rel=1e-12)
    # at target: unchanged
    before = c.value
    c.update(6.0, 1000)
    assert c.value == pytest.approx(before, rel=1e-12)


def test_adaptive_controller_validates():
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target=0.0, horizon=10)
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target=1.0, horizon=0)


def test_sequence_k1_sums_the_masked_log_ratio_per_row():
    lp = [[-1.0, -0.5, -2.0, -0.1], [-0.2, -3.0, -1.0, -1.0]]
    ref = [[-1.5, 0.5, -4.0, -0.1], [-0.7, -1.0, -1.0, -9.0]]
    mask = [[1, 1, 1, 0], [1, 1, 0, 0]]
    expected = [sum(m * (a - b) for a, b, m in zip(*row)) for row in zip(lp, ref, mask)]
    out = sequence_k1(torch.tensor(lp, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64),
                      torch.tensor(mask, dtype=torch.float64))
    assert out.shape == (2,)
    assert out.tolist() == pytest.approx(expected, abs=1e-12)
    assert expected == pytest.approx([1.5, -1.5])  # 0.5 - 1.0 + 2.0 (the last token masked); 0.5 - 2.0
