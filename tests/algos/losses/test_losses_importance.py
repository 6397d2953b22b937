"""Rollout importance weights: truncation (TIS, with a floor) and masking (IcePop), per token or per response; by
hand."""

import math

import pytest
import torch

from algos.losses.importance import rollout_importance_weights
from algos.losses.policy import ppo_policy_loss

G = 1e6
# old - rollout = 0, ln 3, -ln 4, ln 1.5: ratios 1, 3, 0.25, 1.5; last column padding
OLD = [[0.0, 0.0, 0.0, 0.0, G]]
ROLL = [[0.0, -math.log(3.0), math.log(4.0), -math.log(1.5), -G]]
MASK = torch.tensor([[1, 1, 1, 1, 0]])


def _t(x, grad=False):
    return torch.tensor(x, dtype=torch.float64, requires_grad=grad)


@pytest.mark.parametrize("mode,low,weights,masked", [
    ("truncate", None, [1.0, 2.0, 0.25, 1.5], [False] * 4),
    ("truncate", 0.5, [1.0, 2.0, 0.5, 1.5], [False] * 4),
    ("mask", 0.5, [1.0, 0.0, 0.0, 1.5], [False, True, True, False]),
    ("mask", None, [1.0, 0.0, 0.25, 1.5], [False, True, False, False]),
])
def test_weights_by_mode(mode, low, weights, masked):
    w, m = rollout_importance_weights(_t(OLD), _t(ROLL), MASK, cap=2.0, low=low, mode=mode)
    assert w[0, :4].tolist() == pytest.approx(weights, rel=1e-12)
    assert w[0, 4].item() == 1.0  # padding
    assert m[0].tolist() == masked + [False]


# Two responses: row 0 as above (ratios 1, 3, 0.25, 1.5: product 1.125, geometric mean 1.125^(1/4)), row 1 of two
# tokens with ratios 2 and 2 (product 4, geometric mean 2), then padding.
OLD2 = [[0.0, 0.0, 0.0, 0.0, G], [0.0, 0.0, G, G, G]]
ROLL2 = [ROLL[0], [-math.log(2.0), -math.log(2.0), -G, -G, -G]]
MASK2 = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])


@pytest.mark.parametrize("level,mode,cap,row0,row1", [
    ("sequence", "truncate", 2.0, 1.125, 2.0),
    ("sequence", "mask", 2.0, 1.125, 0.0),  # row 1's product 4 is past the cap: the response dropped whole
    ("geometric", "truncate", 1.5, 1.125 ** 0.25, 1.5),
    ("geometric", "mask", 1.5, 1.125 ** 0.25, 0.0),
    ("geometric", "mask", 2.0, 1.125 ** 0.25, 2.0),
])
def test_one_ratio_per_response_at_the_sequence_levels(level, mode, cap, row0, row1):
    w, m = rollout_importance_weights(_t(OLD2), _t(ROLL2), MASK2, cap=cap, mode=mode, level=level)
    assert w[0, :4].tolist() == pytest.approx([row0] * 4, rel=1e-12)
    assert w[1, :2].tolist() == pytest.approx([row1] * 2, rel=1e-12)
    assert w[0, 4].item() == 1.0 and w[1, 2:].tolist() == [1.0] * 3  # padding
    assert m[1].tolist() == [row1 == 0.0] * 2 + [False] * 3 and not m[0].any()


@pytest.mark.parametrize("level,mode,row0", [
    ("token", "truncate", [1.0, 2.0, 0.25, 1.5]),
    ("token", "mask", [1.0, 0.0, 0.25, 1.5]),
    ("geometric", "truncate", [1.125 ** 0.25] * 4),
])
def test_a_veto_drops_a_response_with_one_token_below_it_whole(level, mode, row0):
    """Row 1's ratios 2, 2 become 2, 0.01 (old - rollout = ln 0.01): below the veto of 0.05 the whole row is 0 and
    counted as masked; row 0's lowest ratio, 0.25, is above it and its weights are the level's own."""
    roll = [ROLL2[0], [-math.log(2.0), -math.log(0.01), -G, -G, -G]]
    w, m = rollout_importance_weights(_t(OLD2), _t(roll), MASK2, cap=2.0, mode=mode, level=level, veto=0.05)
    assert w[0, :4].tolist() == pytest.approx(row0, rel=1e-12)
    assert w[1].tolist() == [0.0, 0.0, 1.0, 1.0, 1.0]  # padding keeps 1
    assert m[1].tolist() == [True, True, False, False, False]
    kept, _ = rollout_importance_weights(_t(OLD2), _t(roll), MASK2, cap=2.0, mode=mode, level=level, veto=0.005)
    assert kept[1, 0].item() > 0
    out = ppo_policy_loss(_t(OLD2), _t(OLD2), _t([[1.0] * 5, [1.0] * 5]), MASK2, rollout_logprobs=_t(roll),
                          tis_cap=2.0, tis_mode=mode, tis_level=level, tis_veto=0.05)
    assert out.tis_masked_fraction.item() == pytest.approx((2 + (mode == "mask" and level == "token")) / 6)
    with pytest.raises(ValueError, match=r"tis_veto must lie in \(0, 1\)"):
        rollout_importance_weights(_t(OLD2), _t(roll), MASK2, cap=2.0, veto=1.0)


@pytest.mark.parametrize("name", ["ppo_policy_loss", "gspo_policy_loss", "cispo_policy_loss", "gmpo_policy_loss",
                                  "sapo_policy_loss", "vanilla_policy_loss", "clip_cov_policy_loss",
                                  "kl_cov_policy_loss"])
def test_the_sequence_level_reaches_the_loss_through_every_surrogate(name):
    """On policy (ratio 1) with A = 1 every surrogate's token loss is -1 (SAPO's gate -4/tau sigmoid(0) = -2 for
    tau 1), times each response's sequence weight: 1.125 on row 0's four tokens, min(4, 2) on row 1's two."""
    import algos

    lp, adv = _t(OLD2, grad=True), _t([[1.0] * 4 + [G], [1.0] * 2 + [G] * 3])
    fn = getattr(algos, name)
    out = fn(lp, _t(OLD2), adv, MASK2, rollout_logprobs=_t(ROLL2), tis_cap=2.0, tis_level="sequence")
    token = [out.token_loss[0, t].item() for t in range(4)] + [out.token_loss[1, t].item() for t in range(2)]
    value = -2.0 if name == "sapo_policy_loss" else -1.0
    assert token == pytest.approx([value * 1.125] * 4 + [value * 2.0] * 2, rel=1e-9)


def test_mask_mode_in_the_policy_loss():
    lp = _t(OLD, grad=True)  # ratio 1 against old, A = 1: token loss = -w
    adv = _t([[1.0, 1.0, 1.0, 1.0, G]])
    out = ppo_policy_loss(lp, _t(OLD), adv, MASK, rollout_logprobs=_t(ROLL), tis_cap=2.0, tis_low=0.5,
                          tis_mode="mask")
    w = [1.0, 0.0, 0.0, 1.5]
    assert out.token_loss[0, :4].tolist() == pytest.approx([-x for x in w])
    assert out.loss.item() == pytest.approx(-sum(w) / 4)  # masked tokens stay in the denominator
    assert out.tis_masked_fraction.item() == pytest.approx(2 / 4)
    assert out.tis_weight_mean.item() == pytest.approx(sum(w) / 4)
    out.loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([-x / 4 for x in w] + [0.0])


def test_truncate_mode_masks_nothing_and_matches_the_old_default():
    out = ppo_policy_loss(_t(OLD), _t(OLD), _t([[1.0] * 4 + [G]]), MASK, rollout_logprobs=_t(ROLL), tis_cap=2.0)
    assert out.tis_masked_fraction.item() == 0.0
    assert out.loss.item() == pytest.approx(-(1.0 + 2.0 + 0.25 + 1.5) / 4)


def test_validation():
    with pytest.raises(ValueError, match="unknown TIS mode 'drop'"):
        rollout_importance_weights(_t(OLD), _t(ROLL), MASK, cap=2.0, mode="drop")
    with pytest.raises(ValueError, match="tis_low must satisfy"):
        rollout_importance_weights(_t(OLD), _t(ROLL), MASK, cap=2.0, low=2.0)
    with pytest.raises(ValueError, match="unknown TIS level 'row'"):
        rollout_importance_weights(_t(OLD), _t(ROLL), MASK, cap=2.0, level="row")
    with pytest.raises(ValueError, match="tis_cap must be > 0"):
        rollout_importance_weights(_t(OLD), _t(ROLL), MASK, cap=0.0)
