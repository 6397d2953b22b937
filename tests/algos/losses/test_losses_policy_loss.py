"""PPO policy loss, loss aggregation and value loss."""

import math

import pytest
import torch

from algos.losses.aggregate import aggregate_weight
from algos.losses.policy import aggregate_loss, ppo_policy_loss, value_loss

G = 1e6


def _t(x, grad=False):
    return torch.tensor(x, dtype=torch.float64, requires_grad=grad)


def _py_token_loss(lp, old, a, cl, ch, dual=None):
    r = math.exp(max(-20.0, min(20.0, lp - old)))
    l = max(-a * r, -a * min(max(r, 1 - cl), 1 + ch))
    if dual is not None and a < 0:
        l = min(l, -dual * a)
    return l


LN15, LN05 = math.log(1.5), math.log(0.5)
# rows: mixed cases; padding holds garbage
LP = [[LN15, LN15, LN05, LN05], [0.1, -0.3, G, G], [G, G, G, G]]
OLD = [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, -G, -G], [-G, -G, -G, -G]]
ADV = [[1.0, -1.0, 1.0, -1.0], [2.0, -0.5, G, -G], [G, G, G, G]]
MASK = [[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]]


def _py_losses(cl, ch, dual=None):
    return [[_py_token_loss(LP[b][t], OLD[b][t], ADV[b][t], cl, ch, dual) if MASK[b][t] else 0.0
             for t in range(4)] for b in range(3)]


def test_hand_numbers_symmetric_clip():
    out = ppo_policy_loss(_t(LP), _t(OLD), _t(ADV), torch.tensor(MASK))
    row0 = out.token_loss[0].tolist()
    # (ratio, A): (1.5, +1) -> -1.2; (1.5, -1) -> 1.5; (.5, +1) -> -0.5; (.5, -1) -> 0.8
    assert row0 == pytest.approx([-1.2, 1.5, -0.5, 0.8], rel=1e-12)
    # clipped term active: (1.5, +1), (0.5, -1) and row 1 token 1 (ratio e^-0.3 < 0.8, A < 0)
    assert math.exp(-0.3) < 0.8
    assert out.clip_fraction.item() == pytest.approx(3 / 6)


def test_token_mean_value_clip_higher_and_metrics():
    cl, ch = 0.2, 0.28
    out = ppo_policy_loss(_t(LP), _t(OLD), _t(ADV), torch.tensor(MASK),
                          clip_low=cl, clip_high=ch)
    losses = _py_losses(cl, ch)
    valid = [losses[b][t] for b in range(3) for t in range(4) if MASK[b][t]]
    assert out.loss.item() == pytest.approx(sum(valid) / len(valid), rel=1e-12)
    assert out.token_loss.tolist() == [pytest.approx(r, rel=1e-12) for r in losses]
    assert out.token_loss[0, 0].item() == pytest.approx(-1.28)
    ratios = [math.exp(LP[b][t] - OLD[b][t]) for b in range(3) for t in range(4) if MASK[b][t]]
    kl = sum((r - 1) - math.log(r) for r in ratios) / len(ratios)
    assert out.approx_kl.item() == pytest.approx(kl, rel=1e-9)
    assert out.ratio_mean.item() == pytest.approx(sum(ratios) / len(ratios), rel=1e-12)
    assert out.tis_weight_mean.item() == 1.0
    assert not out.clip_fraction.requires_grad


def test_dual_clip():
    out = ppo_policy_loss(_t(LP), _t(OLD), _t(ADV), torch.tensor(MASK), dual_clip=1.3)
    assert out.token_loss[0, 1].item() == pytest.approx(1.3)  # 1.5 capped at 1.3 * 1
    expected = _py_losses(0.2, 0.2, 1.3)
    assert out.token_loss.tolist() == [pytest.approx(r, rel=1e-12) for r in expected]
    assert out.dual_clip_fraction.item() == pytest.approx(1 / 6)
    with pytest.raises(ValueError):
        ppo_policy_loss(_t(LP), _t(OLD), _t(ADV), torch.tensor(MASK), dual_clip=1.0)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
def test_aggregations(agg):
    loss = [[1.0, 2.0, 3.0, G], [4.0, G, G, G], [G, G, G, G]]
    mask = [[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]
    out = aggregate_loss(_t(loss), torch.tensor(mask), agg=agg)
    if agg == "token_mean":
        exp = (1 + 2 + 3 + 4) / 4
    elif agg == "seq_mean_token_mean":
        exp = (2.0 + 4.0) / 2  # rows without tokens are skipped
    elif agg == "seq_mean_token_sum":
        exp = (6.0 + 4.0) / 2  # each row's sum, rows without tokens skipped
    else:
        exp = ((1 + 2 + 3) / 4 + 4 / 4 + 0.0) / 3  # constant T = 4, mean over all rows
    assert out.item() == pytest.approx(exp)
    const = aggregate_loss(_t(loss), torch.tensor(mask), agg=agg, loss_scale_constant=2.0)
    if agg == "seq_mean_token_sum_norm":
        assert const.item() == pytest.approx((6 / 2 + 4 / 2) / 3)
    else:
        assert const.item() == pytest.approx(exp)
    assert aggregate_loss(_t(loss), torch.zeros(3, 4), agg=agg).item() == 0.0


def test_aggregate_unknown_lists_names():
    for fn in (lambda: aggregate_loss(torch.zeros(1, 1), torch.ones(1, 1), agg="sum"),
               lambda: aggregate_weight(torch.ones(1, 1), agg="sum")):
        with pytest.raises(ValueError) as err:
            fn()
        for name in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
            assert name in str(err.value)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
def test_parts_weighted_by_aggregate_weight_give_the_whole_batch_loss(agg):
    # Rows of 3, 1, 0, 4, 2 valid tokens cut into parts [0:2], [2:3] (no token), [3:5].
    g = torch.Generator().manual_seed(0)
    loss = torch.rand(5, 4, generator=g, dtype=torch.float64)
    lengths = [3, 1, 0, 4, 2]
    mask = torch.tensor([[1] * n + [0] * (4 - n) for n in lengths])
    parts = [slice(0, 2), slice(2, 3), slice(3, 5)]
    weights = [aggregate_weight(mask[p], agg=agg).item() for p in parts]
    assert weights == {"token_mean": [4, 0, 6], "seq_mean_token_mean": [2, 0, 2], "seq_mean_token_sum": [2, 0, 2],
                       "seq_mean_token_sum_norm": [2, 1, 2]}[agg]
    combined = sum(w / sum(weights) * aggregate_loss(loss[p], mask[p], agg=agg).item()
                   for w, p in zip(weights, parts))
    # The whole batch's value, from the definitions (not from aggregate_loss).
    rows = [sum(loss[b, :n].tolist()) for b, n in enumerate(lengths)]
    whole = {"token_mean": sum(rows) / sum(lengths),
             "seq_mean_token_mean": sum(r / n for r, n in zip(rows, lengths) if n) / 4,
             "seq_mean_token_sum": sum(rows) / 4,
             "seq_mean_token_sum_norm": sum(rows) / 4 / 5}[agg]
    assert combined == pytest.approx(whole, rel=1e-12)
    # Rows as weights miss the token mean: the parts hold 2 and 2 rows but 4 and 6 tokens.
    by_rows = sum(len(lengths[p]) / 5 * aggregate_loss(loss[p], mask[p], agg=agg).item() for p in parts)
    if agg == "token_mean":
        assert abs(by_rows - whole) > 1e-3
    # A float mask weighs its tokens as aggregate_loss does.
    assert aggregate_weight(torch.tensor([[0.5, 1.0, 0.0]]), agg="token_mean").item() == 1.5


def _grad(lp_minus_old, adv, **kw):
    lp = _t([[lp_minus_old, G]], grad=True)
    out = ppo_policy_loss(lp, _t([[0.0, -G]]), _t([[adv, G]]), torch.tensor([[1, 0]]), **kw)
    out.loss.backward()
    assert lp.grad[0, 1].item() == 0.0  # padding gets no gradient
    return lp.grad[0, 0].item()


def test_gradient_signs_and_clipping():
    # descent (-grad) increases logprob for A > 0 and decreases it for A < 0
    assert _grad(0.0, 1.0) < 0
    assert _grad(0.0, -1.0) > 0
    assert _grad(0.0, 1.0) == pytest.approx(-1.0)  # d(-r A)/dlp = -r A at r = 1
    # outside the range in the advantage's direction: no gradient
    assert _grad(LN15, 1.0) == 0.0
    assert _grad(LN05, -1.0) == 0.0
    assert _grad(math.log(1.25), 1.0, clip_high=0.28) == pytest.approx(-1.25)
    # outside the range against the advantage's direction: unclipped gradient
    assert _grad(LN05, 1.0) == pytest.approx(-0.5)
    assert _grad(LN15, -1.0) == pytest.approx(1.5)
    # dual clip removes it for large ratios with A < 0
    assert _grad(LN15, -1.0, dual_clip=1.3) == 0.0


@pytest.mark.parametrize("diff", [50.0, -50.0])
@pytest.mark.parametrize("adv", [1.0, -1.0])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_extreme_ratios_finite(diff, adv, agg):
    lp = torch.tensor([[diff, 0.0]], requires_grad=True)
    out = ppo_policy_loss(lp, torch.zeros(1, 2), torch.tensor([[adv, adv]]),
                          torch.ones(1, 2), agg=agg)
    out.loss.backward()
    for v in (out.loss, out.approx_kl, out.clip_fraction, out.ratio_mean):
        assert torch.isfinite(v).all()
    assert torch.isfinite(lp.grad).all()


def test_truncated_importance_sampling():
    lp = _t([[0.0, 0.0, 0.0, G]], grad=True)
    old = _t([[0.0, 0.0, 0.0, G]])
    roll = _t([[0.0, -math.log(3.0), math.log(4.0), -G]])  # old - roll = 0, ln3, -ln4
    adv = _t([[1.0, 1.0, 1.0, G]])
    mask = torch.tensor([[1, 1, 1, 0]])
    out = ppo_policy_loss(lp, old, adv, mask, rollout_logprobs=roll, tis_cap=2.0)
    w = [1.0, 2.0, 0.25]  # min(exp(old - roll), 2)
    assert out.token_loss[0, :3].tolist() == pytest.approx([-x for x in w])
    assert out.loss.item() == pytest.approx(-sum(w) / 3)
    assert out.tis_weight_mean.item() == pytest.approx(sum(w) / 3)
    out.loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([-x / 3 for x in w] + [0.0])
    with pytest.raises(ValueError, match="tis_cap"):
        ppo_policy_loss(lp, old, adv, mask, rollout_logprobs=roll)


def test_value_loss_clipped_and_unclipped():
    v = [[1.0, 0.0, 2.0, G], [0.5, G, G, G]]
    old = [[0.8, 0.5, 2.0, -G], [0.0, -G, -G, -G]]
    ret = [[0.0, 1.0, 2.5, G], [1.0, G, G, G]]
    mask = [[1, 1, 1, 0], [1, 0, 0, 0]]
    eps = 0.2
    per, n_clip = [], 0
    for b in range(2):
        for t in range(4):
            if mask[b][t]:
                vc = min(max(v[b][t], old[b][t] - eps), old[b][t] + eps)
                unclipped, clipped = (v[b][t] - ret[b][t]) ** 2, (vc - ret[b][t]) ** 2
                per.append(0.5 * max(unclipped, clipped))
                n_clip += clipped > unclipped
    vt = _t(v, grad=True)
    out = value_loss(vt, _t(old), _t(ret), torch.tensor(mask), clip_eps=eps)
    assert out.loss.item() == pytest.approx(sum(per) / len(per))
    assert n_clip == 1  # only row 1: v=0.5 -> clipped 0.2, further from R=1
    assert out.clip_fraction.item() == pytest.approx(n_clip / len(per))
    out.loss.backward()
    assert vt.grad[0, 3].item() == 0.0 and torch.isfinite(vt.grad).all()
    plain = value_loss(_t(v), _t(old), _t(ret), torch.tensor(mask), clip_eps=None)
    sq = [0.5 * (v[b][t] - ret[b][t]) ** 2 for b in range(2) for t in range(4) if mask[b][t]]
    assert plain.loss.item() == pytest.approx(sum(sq) / len(sq))
    assert plain.clip_fraction.item() == 0.0


def test_an_fp16_ratio_past_exps_range_keeps_a_finite_loss_and_gradient():
    # A log-ratio of 12 is inside the ±20 clamp, but exp(12) = 162755 overflows fp16 (max 65504): the ratio is
    # taken in float32. With A < 0 and dual clip 3 the loss is -3 A and the gradient 0, as in float32.
    lp = torch.tensor([[2.0, 0.0]], dtype=torch.float16, requires_grad=True)
    old = torch.tensor([[-10.0, 0.0]], dtype=torch.float16)
    out = ppo_policy_loss(lp, old, torch.tensor([[-1.0, 0.0]]), torch.tensor([[1.0, 0.0]]), dual_clip=3.0)
    out.loss.backward()
    assert out.loss.item() == 3.0
    assert torch.isfinite(lp.grad).all() and lp.grad.abs().sum().item() == 0.0
