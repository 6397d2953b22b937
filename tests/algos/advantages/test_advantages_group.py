"""Group baselines (GRPO, Dr. GRPO, RLOO, OPO, GPG) against plain-Python arithmetic."""

import math

import pytest
import torch

from algos.advantages.group import (
    constant_groups,
    group_centered_advantages,
    group_mean,
    group_normalized_advantages,
    leave_one_out_advantages,
)

SCORES = [1.0, 2.0, 4.0, 7.0, 0.1, 0.1, 0.1, 0.1, 0.0, 1.0, 0.0, 0.0]
GS = 4


def _groups(xs, g):
    return [xs[i:i + g] for i in range(0, len(xs), g)]


def _py_grpo(xs, g, eps):
    out = []
    for grp in _groups(xs, g):
        if len(set(grp)) == 1:
            out += [0.0] * g
            continue
        mu = sum(grp) / g
        std = math.sqrt(sum((x - mu) ** 2 for x in grp) / (g - 1))
        out += [(x - mu) / (std + eps) for x in grp]
    return out


def test_grpo_unbiased_std_values():
    eps = 1e-6
    out = group_normalized_advantages(torch.tensor(SCORES, dtype=torch.float64), GS, eps=eps)
    assert out.tolist() == pytest.approx(_py_grpo(SCORES, GS, eps), rel=1e-12, abs=1e-15)
    # constant group of 0.1s: exactly zero although 0.1 is not representable
    assert out[4:8].tolist() == [0.0] * 4


def test_grpo_float32_constant_group_exactly_zero():
    out = group_normalized_advantages(torch.full((6,), 0.1), 3, eps=1e-6)
    assert out.tolist() == [0.0] * 6


def test_group_size_one_gives_zero():
    s = torch.tensor([3.0, -1.0, 0.5])
    for out in (group_normalized_advantages(s, 1, eps=1e-6),
                group_centered_advantages(s, 1), leave_one_out_advantages(s, 1)):
        assert out.tolist() == [0.0, 0.0, 0.0]


def test_dr_grpo_values():
    out = group_centered_advantages(torch.tensor(SCORES, dtype=torch.float64), GS)
    expected = []
    for grp in _groups(SCORES, GS):
        mu = sum(grp) / GS
        expected += [0.0 if len(set(grp)) == 1 else x - mu for x in grp]
    assert out.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_rloo_values():
    out = leave_one_out_advantages(torch.tensor(SCORES, dtype=torch.float64), GS)
    expected = []
    for grp in _groups(SCORES, GS):
        for i, x in enumerate(grp):
            others = [y for j, y in enumerate(grp) if j != i]
            expected.append(x - sum(others) / len(others))
    assert out.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    # hand check: group [1, 2, 4, 7]: 1 - (2+4+7)/3
    assert out[0].item() == pytest.approx(1.0 - 13.0 / 3.0)


def test_group_mean_and_constant_groups():
    s = torch.tensor(SCORES, dtype=torch.float64)
    assert group_mean(s, GS).tolist() == pytest.approx(
        [3.5] * 4 + [0.1] * 4 + [0.25] * 4)
    assert constant_groups(s, GS).tolist() == [False] * 4 + [True] * 4 + [False] * 4


def test_bad_group_size():
    with pytest.raises(ValueError, match="multiple"):
        group_mean(torch.zeros(5), 2)
    with pytest.raises(ValueError):
        group_mean(torch.zeros(4), 0)
    with pytest.raises(ValueError):
        group_mean(torch.zeros(2, 2), 2)


def test_opo_baseline_is_the_length_weighted_group_mean():
    """Two groups of three: lengths 1, 2, 5 and 4, 4, 0 (a row of no token weighs nothing)."""
    from algos import get_advantage_estimator, length_weighted_advantages

    scores = torch.tensor([1.0, 0.0, 2.0, 3.0, 1.0, 7.0])
    lengths = torch.tensor([1, 2, 5, 4, 4, 0])
    b0 = (1 * 1.0 + 2 * 0.0 + 5 * 2.0) / 8
    b1 = (4 * 3.0 + 4 * 1.0 + 0 * 7.0) / 8
    expect = [1.0 - b0, 0.0 - b0, 2.0 - b0, 3.0 - b1, 1.0 - b1, 7.0 - b1]
    assert length_weighted_advantages(scores, lengths, 3).tolist() == pytest.approx(expect)
    # constant groups give 0; a group of no tokens at all takes the plain mean
    assert length_weighted_advantages(torch.tensor([2.0, 2.0, 5.0, 1.0]), torch.tensor([3, 1, 0, 0]), 2).tolist() \
        == pytest.approx([0.0, 0.0, 2.0, -2.0])
    # the estimator: the row's token count is its length, the advantage on every valid token
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    rewards = torch.tensor([[4.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    out = get_advantage_estimator("opo")(token_rewards=rewards, action_mask=mask, values=None, group_size=2,
                                         gamma=1.0, lam=1.0, eps=1e-6)
    b = (1 * 4.0 + 3 * 1.0) / 4
    assert out.advantages.flatten().tolist() == pytest.approx([4.0 - b, 0, 0, 1.0 - b, 1.0 - b, 1.0 - b])
    with pytest.raises(ValueError, match="no group std"):
        get_advantage_estimator("opo")(token_rewards=rewards, action_mask=mask, values=None, group_size=2,
                                       gamma=1.0, lam=1.0, eps=1e-6, std_norm=True)


def _gpg(scores, mask, std_norm=None, group_size=2):
    from algos import get_advantage_estimator

    rewards = torch.zeros(mask.shape)
    last = mask.sum(1) - 1
    for i, s in enumerate(scores):  # the sequence reward at each row's last valid token
        rewards[i, max(int(last[i]), 0)] = s
    options = {} if std_norm is None else {"std_norm": std_norm}
    return get_advantage_estimator("gpg")(token_rewards=rewards * mask, action_mask=mask, values=None,
                                          group_size=group_size, gamma=1.0, lam=1.0, eps=1e-6, **options)


def test_gpg_scales_the_centred_advantage_by_all_rows_over_those_with_a_gradient():
    """Three groups of two, 0/1 rewards: (1, 0), (1, 1) all right, (0, 1). B = 6, M = 2 (the all-right group),
    alpha = 6 / 4; each row's advantage is alpha (r - group mean), on every valid token, 0 at padding."""
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0]])
    scores = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    out = _gpg(scores, mask)
    alpha = 6 / 4
    expect = [alpha * 0.5, alpha * -0.5, 0.0, 0.0, alpha * -0.5, alpha * 0.5]
    for row in range(6):
        valid = [out.advantages[row, t].item() for t in range(3) if mask[row, t]]
        assert valid == pytest.approx([expect[row]] * len(valid))
        assert all(out.advantages[row, t].item() == 0 for t in range(3) if not mask[row, t])
    assert torch.equal(out.returns, out.advantages)
    # std_norm: GRPO's std division before the scale (std of (1, 0) with Bessel: sqrt(0.5))
    normed = _gpg(scores, mask, std_norm=True)
    assert normed.advantages[0, 0].item() == pytest.approx(alpha * 0.5 / (math.sqrt(0.5) + 1e-6), rel=1e-6)


def test_gpg_alpha_is_one_where_every_row_or_none_carries_a_gradient():
    mask = torch.ones(4, 2, dtype=torch.long)
    every = _gpg([1.0, 0.0, 0.0, 1.0], mask)
    assert every.advantages[:, 0].tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5])
    none = _gpg([1.0, 1.0, 0.0, 0.0], mask)
    assert none.advantages.abs().sum().item() == 0
    from algos import gradient_row_scale  # a row with no valid token counts on neither side (no loss mean has it)

    adv = torch.tensor([[1.0, 0.0], [5.0, 0.0], [0.0, 0.0], [0.0, 2.0]])
    assert gradient_row_scale(adv, torch.tensor([[1, 0], [0, 0], [1, 1], [1, 1]])).item() == pytest.approx(3 / 2)
