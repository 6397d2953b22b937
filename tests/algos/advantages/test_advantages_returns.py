"""GAE and discounted returns against hand arithmetic and plain-Python loops."""

import pytest
import torch

from algos.advantages.returns import compute_gae, discounted_returns

G = 1e6


def _py_gae(rewards, values, mask, gamma, lam):
    """Plain-Python GAE over the valid tokens of each row (terminal after the last)."""
    adv_out, ret_out = [], []
    for r, v, m in zip(rewards, values, mask):
        idx = [t for t in range(len(r)) if m[t]]
        adv = [0.0] * len(r)
        for pos in range(len(idx) - 1, -1, -1):
            t = idx[pos]
            nxt_v = v[idx[pos + 1]] if pos + 1 < len(idx) else 0.0
            nxt_a = adv[idx[pos + 1]] if pos + 1 < len(idx) else 0.0
            adv[t] = r[t] + gamma * nxt_v - v[t] + gamma * lam * nxt_a
        adv_out.append(adv)
        ret_out.append([adv[t] + v[t] if m[t] else 0.0 for t in range(len(r))])
    return adv_out, ret_out


def _t(x):
    return torch.tensor(x, dtype=torch.float64)


def test_gae_hand_computed():
    adv, ret = compute_gae(_t([[0.0, 0.0, 1.0]]), _t([[0.5, 0.6, 0.7]]),
                           torch.ones(1, 3), gamma=0.9, lam=0.8)
    # t2: 1 - 0.7 = 0.3 ; t1: 0.9*0.7 - 0.6 + 0.72*0.3 ; t0: 0.9*0.6 - 0.5 + 0.72*A1
    a2 = 0.3
    a1 = 0.03 + 0.72 * a2
    a0 = 0.04 + 0.72 * a1
    assert adv[0].tolist() == pytest.approx([a0, a1, a2], rel=1e-12)
    assert a0 == pytest.approx(0.21712)
    assert ret[0].tolist() == pytest.approx([a0 + 0.5, a1 + 0.6, a2 + 0.7], rel=1e-12)


def test_gae_lambda1_gamma1_is_monte_carlo_minus_value():
    r = [[0.1, -0.2, 0.3, 1.0]]
    v = [[0.4, 0.3, 0.2, 0.1]]
    adv, ret = compute_gae(_t(r), _t(v), torch.ones(1, 4), gamma=1.0, lam=1.0)
    mc = [sum(r[0][t:]) for t in range(4)]
    assert adv[0].tolist() == pytest.approx([mc[t] - v[0][t] for t in range(4)], rel=1e-12)
    assert ret[0].tolist() == pytest.approx(mc, rel=1e-12)


def test_gae_padding_garbage_holes_and_empty_rows():
    rewards = [[0.1, 0.2, 1.0, G, G], [0.0, G, 0.5, -1.0, G],
               [G, G, G, G, G], [1.0, 0.0, 0.0, 0.0, 2.0]]
    values = [[0.3, 0.1, -0.2, G, -G], [0.2, G, 0.4, 0.6, G],
              [G, G, G, G, G], [0.5, 0.4, 0.3, 0.2, 0.1]]
    mask = [[1, 1, 1, 0, 0], [1, 0, 1, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    gamma, lam = 0.95, 0.9
    adv, ret = compute_gae(_t(rewards), _t(values), torch.tensor(mask, dtype=torch.bool),
                           gamma=gamma, lam=lam)
    e_adv, e_ret = _py_gae(rewards, values, mask, gamma, lam)
    assert adv.tolist() == [pytest.approx(row, rel=1e-12, abs=1e-15) for row in e_adv]
    assert ret.tolist() == [pytest.approx(row, rel=1e-12, abs=1e-15) for row in e_ret]
    assert adv[2].tolist() == [0.0] * 5 and ret[2].tolist() == [0.0] * 5


def test_gae_outputs_are_detached():
    v = _t([[0.1, 0.2]]).requires_grad_(True)
    adv, ret = compute_gae(_t([[0.0, 1.0]]), v, torch.ones(1, 2), gamma=1.0, lam=1.0)
    assert not adv.requires_grad and not ret.requires_grad


def test_discounted_returns_hand_and_padding():
    r = [[1.0, 2.0, 3.0, G], [4.0, G, 5.0, G], [G, G, G, G]]
    m = [[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0]]
    out = discounted_returns(_t(r), torch.tensor(m), gamma=0.5)
    assert out[0].tolist() == pytest.approx([1 + 0.5 * 2 + 0.25 * 3, 2 + 0.5 * 3, 3.0, 0.0])
    # the masked hole is not a step
    assert out[1].tolist() == pytest.approx([4 + 0.5 * 5, 0.0, 5.0, 0.0])
    assert out[2].tolist() == [0.0] * 4


def test_shape_mismatch():
    with pytest.raises(ValueError):
        compute_gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), gamma=1.0, lam=1.0)
