"""Advantage-estimator registry and every registered estimator end to end."""

import dataclasses
import inspect
import math

import pytest
import torch

import algos.advantages.estimators as adv_mod
from algos.advantages.estimators import (
    ADVANTAGE_ESTIMATORS,
    AdvantageOutput,
    get_advantage_estimator,
    register_advantage_estimator,
)

G = 1e6
EXPECTED_NAMES = ["dr_grpo", "gae", "gpg", "grpo", "opo", "per_token", "reinforce_pp", "reinforce_pp_baseline", "rloo"]

# 2 prompts x group of 3; row 2 fully masked, row 4 has a hole; garbage in padding
REWARDS = [
    [0.0, -0.1, 1.0, G],
    [-0.2, 0.5, G, G],
    [G, G, G, G],
    [0.3, 0.3, 0.3, 2.0],
    [1.0, G, -0.5, G],
    [0.0, 0.1, G, G],
]
MASK = [
    [1, 1, 1, 0],
    [1, 1, 0, 0],
    [0, 0, 0, 0],
    [1, 1, 1, 1],
    [1, 0, 1, 0],
    [1, 1, 0, 0],
]
GS = 3


def _t(x):
    return torch.tensor(x, dtype=torch.float64)


def _scores():
    return [sum(r for r, m in zip(rr, mm) if m) for rr, mm in zip(REWARDS, MASK)]


def _call(name, **kw):
    args = dict(token_rewards=_t(REWARDS), action_mask=torch.tensor(MASK), values=None,
                group_size=GS, gamma=1.0, lam=1.0, eps=1e-6)
    args.update(kw)
    return get_advantage_estimator(name)(**args)


def _broadcast(seq):
    return [[seq[b] if MASK[b][t] else 0.0 for t in range(4)] for b in range(len(MASK))]


def _py_rtg(rewards, mask, gamma):
    out = []
    for r, m in zip(rewards, mask):
        row, running = [0.0] * len(r), 0.0
        for t in range(len(r) - 1, -1, -1):
            if m[t]:
                running = r[t] + gamma * running
                row[t] = running
        out.append(row)
    return out


def _py_whiten(x, mask, eps):
    vals = [v for xr, mr in zip(x, mask) for v, m in zip(xr, mr) if m]
    mu = sum(vals) / len(vals)
    var = sum((v - mu) ** 2 for v in vals) / len(vals)
    return [[(v - mu) / math.sqrt(var + eps) if m else 0.0 for v, m in zip(xr, mr)]
            for xr, mr in zip(x, mask)]


def _close(out, expected):
    assert out.tolist() == [pytest.approx(r, rel=1e-9, abs=1e-12) for r in expected]


def test_registry_names():
    assert sorted(ADVANTAGE_ESTIMATORS) == EXPECTED_NAMES


def test_unknown_name_lists_sorted_valid_names():
    for exc in (KeyError, ValueError):
        with pytest.raises(exc) as err:
            get_advantage_estimator("ppo2")
        assert "valid names: " + ", ".join(EXPECTED_NAMES) in str(err.value)


def test_register_custom_and_duplicate():
    @register_advantage_estimator("_test_zero")
    def _zero(*, token_rewards, action_mask, values, group_size, gamma, lam, eps):
        z = torch.zeros_like(token_rewards)
        return AdvantageOutput(z, z)

    try:
        assert get_advantage_estimator("_test_zero") is _zero
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator("_test_zero")(_zero)
    finally:
        adv_mod._REGISTRY.pop("_test_zero")
    assert "_test_zero" not in ADVANTAGE_ESTIMATORS


def test_all_estimators_share_one_keyword_only_signature():
    sigs = {name: inspect.signature(fn) for name, fn in ADVANTAGE_ESTIMATORS.items()}
    ref = sigs["grpo"]
    names = ["token_rewards", "action_mask", "values", "group_size", "gamma", "lam", "eps", "std_norm", "steps"]
    assert list(ref.parameters) == names
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in ref.parameters.values())
    assert ref.parameters["std_norm"].default is None  # optional: callers pass it only when set
    assert ref.parameters["steps"].default is None  # dense step rewards: only where a round has them
    for name, sig in sigs.items():
        assert list(sig.parameters) == names, name


def test_output_is_frozen():
    out = _call("grpo")
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.advantages = None


def _py_group_normalized(eps):
    s = _scores()
    expected = []
    for i in range(0, len(s), GS):
        grp = s[i:i + GS]
        mu = sum(grp) / GS
        std = math.sqrt(sum((x - mu) ** 2 for x in grp) / (GS - 1))
        expected += [(x - mu) / (std + eps) for x in grp]
    return expected


def _py_group_centered():
    s = _scores()
    expected = []
    for i in range(0, len(s), GS):
        grp = s[i:i + GS]
        expected += [x - sum(grp) / GS for x in grp]
    return expected


def test_grpo_values():
    eps = 1e-6
    out = _call("grpo", eps=eps)
    _close(out.advantages, _broadcast(_py_group_normalized(eps)))
    assert torch.equal(out.returns, out.advantages)


def test_dr_grpo_values():
    _close(_call("dr_grpo").advantages, _broadcast(_py_group_centered()))


def test_group_std_norm_switch():
    """std_norm switches the group std division either way; None keeps each estimator's own."""
    _close(_call("grpo", std_norm=False).advantages, _broadcast(_py_group_centered()))
    _close(_call("grpo", std_norm=True).advantages, _broadcast(_py_group_normalized(1e-6)))
    _close(_call("dr_grpo", std_norm=True).advantages, _broadcast(_py_group_normalized(1e-6)))
    _close(_call("dr_grpo", std_norm=False).advantages, _broadcast(_py_group_centered()))


@pytest.mark.parametrize("name", ["gae", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
@pytest.mark.parametrize("std_norm", [True, False])
def test_estimators_without_a_group_std_reject_the_switch(name, std_norm):
    values = _t([[0.0] * 4] * 6)
    with pytest.raises(ValueError, match=f"{name}' has no group std normalisation"):
        _call(name, values=values, std_norm=std_norm)


def test_rloo_values():
    s = _scores()
    expected = []
    for i in range(0, len(s), GS):
        grp = s[i:i + GS]
        expected += [x - (sum(grp) - x) / (GS - 1) for x in grp]
    _close(_call("rloo").advantages, _broadcast(expected))


def test_gae_via_registry_and_requires_values():
    values = [[0.1 * (b + t) if MASK[b][t] else G for t in range(4)] for b in range(6)]
    with pytest.raises(ValueError, match="values"):
        _call("gae")
    out = _call("gae", values=_t(values), gamma=0.9, lam=0.95)
    # hand check for row 1: r=[-0.2, 0.5], v=[0.1, 0.2], terminal after t=1
    a1 = 0.5 - 0.2
    a0 = -0.2 + 0.9 * 0.2 - 0.1 + 0.9 * 0.95 * a1
    assert out.advantages[1].tolist() == pytest.approx([a0, a1, 0.0, 0.0], rel=1e-12)
    valid = torch.tensor(MASK).bool()
    assert torch.allclose(out.returns[valid], (out.advantages + _t(values))[valid])
    assert (out.returns[~valid] == 0).all() and (out.advantages[~valid] == 0).all()


def test_reinforce_pp_values():
    gamma, eps = 0.9, 1e-8
    g = _py_rtg(REWARDS, MASK, gamma)
    out = _call("reinforce_pp", gamma=gamma, eps=eps)
    _close(out.returns, g)
    _close(out.advantages, _py_whiten(g, MASK, eps))


def test_reinforce_pp_baseline_values():
    gamma, eps = 0.95, 1e-8
    s = _scores()
    shifted = [list(r) for r in REWARDS]
    for b in range(6):
        grp = s[(b // GS) * GS:(b // GS + 1) * GS]
        centered = s[b] - sum(grp) / GS
        valid = [t for t in range(4) if MASK[b][t]]
        if valid:
            shifted[b][valid[-1]] += centered - s[b]
    g = _py_rtg(shifted, MASK, gamma)
    out = _call("reinforce_pp_baseline", gamma=gamma, eps=eps)
    _close(out.returns, g)
    _close(out.advantages, _py_whiten(g, MASK, eps))
    # with gamma = 1 each row's return at its first token is s_i - mean_G(s)
    out1 = _call("reinforce_pp_baseline", gamma=1.0, eps=eps)
    assert out1.returns[0, 0].item() == pytest.approx(s[0] - sum(s[:3]) / 3)


@pytest.mark.parametrize("name", EXPECTED_NAMES)
@pytest.mark.parametrize("group_size", [1, 3])
def test_every_estimator_finite_with_masked_row(name, group_size):
    values = _t([[0.5] * 4] * 6)
    out = _call(name, group_size=group_size, values=values, gamma=0.99, lam=0.95)
    assert out.advantages.shape == (6, 4) and out.returns.shape == (6, 4)
    assert torch.isfinite(out.advantages).all() and torch.isfinite(out.returns).all()
    pad = ~torch.tensor(MASK).bool()
    assert (out.advantages[pad] == 0).all() and (out.returns[pad] == 0).all()
    assert out.advantages[2].tolist() == [0.0] * 4


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_group_estimators_zero_for_group_size_one_and_equal_rewards(name):
    out = _call(name, group_size=1)
    assert (out.advantages == 0).all()
    rewards = torch.zeros(4, 3)
    rewards[:, -1] = 0.7  # identical scores within each group
    out = get_advantage_estimator(name)(
        token_rewards=rewards, action_mask=torch.ones(4, 3), values=None, group_size=2,
        gamma=1.0, lam=1.0, eps=1e-6)
    assert (out.advantages == 0).all()


@pytest.mark.parametrize("name", EXPECTED_NAMES)
def test_every_estimator_all_masked_batch(name):
    out = get_advantage_estimator(name)(
        token_rewards=torch.full((2, 3), G), action_mask=torch.zeros(2, 3),
        values=torch.full((2, 3), G), group_size=2, gamma=1.0, lam=1.0, eps=1e-6)
    assert (out.advantages == 0).all() and (out.returns == 0).all()
