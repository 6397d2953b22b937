"""Reward-model pairwise loss, DPO/IPO/cDPO, KTO, SimPO, ORPO and sequence log-probs."""

import math

import pytest
import torch

from algos.losses.dpo import DPO_LOSS_TYPES, dpo_loss
from algos.losses.preference import (
    kto_loss,
    log_odds,
    orpo_loss,
    pairwise_reward_loss,
    sequence_logprobs,
    simpo_loss,
)

G = 1e6


def _t(x, grad=False):
    return torch.tensor(x, dtype=torch.float64, requires_grad=grad)


def _neg_logsig(x):
    # -log sigmoid(x) = log(1 + exp(-x)), stable both ways
    return math.log1p(math.exp(-x)) if x > 0 else -x + math.log1p(math.exp(x))


def _sig(x):
    return 1.0 / (1.0 + math.exp(-x))


def test_sequence_logprobs_sum_and_average():
    lp = [[-1.0, -2.0, G], [-0.5, G, G], [G, G, G]]
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    assert sequence_logprobs(_t(lp), mask).tolist() == [-3.0, -0.5, 0.0]
    assert sequence_logprobs(_t(lp), mask, average=True).tolist() == [-1.5, -0.5, 0.0]


def test_pairwise_reward_loss_values_and_margin():
    c, r = [1.0, 0.2, -3.0], [0.5, 0.7, -3.0]
    out = pairwise_reward_loss(_t(c), _t(r))
    assert out.loss.item() == pytest.approx(sum(_neg_logsig(a - b) for a, b in zip(c, r)) / 3)
    assert out.accuracy.item() == pytest.approx(1 / 3)  # ties are not correct
    assert out.reward_margin.item() == pytest.approx(sum(a - b for a, b in zip(c, r)) / 3)
    assert out.chosen_rewards.item() == pytest.approx(sum(c) / 3)
    assert out.rejected_rewards.item() == pytest.approx(sum(r) / 3)
    m = [0.5, 1.0, 0.0]
    out_m = pairwise_reward_loss(_t(c), _t(r), margin=_t(m))
    exp = sum(_neg_logsig(a - b - mm) for a, b, mm in zip(c, r, m)) / 3
    assert out_m.loss.item() == pytest.approx(exp)
    assert out_m.accuracy.item() == pytest.approx(1 / 3)


def test_pairwise_extreme_finite_and_gradient():
    c = _t([60.0, -60.0], grad=True)
    out = pairwise_reward_loss(c, _t([-60.0, 60.0]))
    out.loss.backward()
    assert math.isfinite(out.loss.item()) and torch.isfinite(c.grad).all()
    assert out.loss.item() == pytest.approx(120.0 / 2, rel=1e-9)
    assert c.grad[1].item() < 0  # descent raises the wrongly ranked chosen score


PC, PR = [-10.0, -12.0, -5.0], [-11.0, -9.0, -5.5]
RC, RR = [-10.5, -12.5, -5.0], [-10.5, -10.0, -5.0]


def _h():
    return [(pc - rc) - (pr - rr) for pc, pr, rc, rr in zip(PC, PR, RC, RR)]


@pytest.mark.parametrize("loss_type,eps", [("sigmoid", 0.0), ("cdpo", 0.1), ("sigmoid", 0.2),
                                           ("ipo", 0.0)])
def test_dpo_variants(loss_type, eps):
    beta = 0.1
    out = dpo_loss(_t(PC), _t(PR), _t(RC), _t(RR), beta=beta, loss_type=loss_type,
                   label_smoothing=eps)
    hs = _h()
    if loss_type == "ipo":
        exp = sum((h - 1 / (2 * beta)) ** 2 for h in hs) / 3
    else:
        exp = sum((1 - eps) * _neg_logsig(beta * h) + eps * _neg_logsig(-beta * h) for h in hs) / 3
    assert out.loss.item() == pytest.approx(exp, rel=1e-12)
    cr = [beta * (a - b) for a, b in zip(PC, RC)]
    rr = [beta * (a - b) for a, b in zip(PR, RR)]
    assert out.chosen_rewards.item() == pytest.approx(sum(cr) / 3)
    assert out.rejected_rewards.item() == pytest.approx(sum(rr) / 3)
    assert out.reward_margin.item() == pytest.approx(sum(a - b for a, b in zip(cr, rr)) / 3)
    assert out.accuracy.item() == pytest.approx(sum(a > b for a, b in zip(cr, rr)) / 3)


def _family(loss_type: str, c: float, r: float, beta: float, eps: float) -> float:
    """Each loss of DPO's family per pair, from its paper's formula in plain Python."""
    sig, ls = _sig, _neg_logsig  # sigmoid, and -log sigmoid
    h = c - r
    return {"robust": ((1 - eps) * ls(beta * h) - eps * ls(-beta * h)) / (1 - 2 * eps),
            "hinge": max(0.0, 1 - beta * h),
            "nca_pair": ls(beta * c) + 0.5 * ls(-beta * c) + 0.5 * ls(-beta * r),
            "apo_zero": 1 - sig(beta * c) + sig(beta * r),
            "apo_down": sig(beta * c) + 1 - sig(beta * h),
            "sppo_hard": (c - 1 / (2 * beta)) ** 2 + (r + 1 / (2 * beta)) ** 2}[loss_type]


@pytest.mark.parametrize("loss_type,eps", [("robust", 0.1), ("robust", 0.3), ("hinge", 0.0), ("nca_pair", 0.0),
                                           ("apo_zero", 0.0), ("apo_down", 0.0), ("sppo_hard", 0.0)])
def test_the_rest_of_dpos_family_against_their_formulas(loss_type, eps):
    beta = 0.7
    out = dpo_loss(_t(PC), _t(PR), _t(RC), _t(RR), beta=beta, loss_type=loss_type, label_smoothing=eps)
    pairs = [(pc - rc, pr - rr) for pc, pr, rc, rr in zip(PC, PR, RC, RR)]
    assert out.loss.item() == pytest.approx(sum(_family(loss_type, c, r, beta, eps) for c, r in pairs) / 3, rel=1e-9)
    assert out.chosen_rewards.item() == pytest.approx(sum(beta * c for c, _ in pairs) / 3)
    assert out.rejected_rewards.item() == pytest.approx(sum(beta * r for _, r in pairs) / 3)
    assert out.accuracy.item() == pytest.approx(sum(c > r for c, r in pairs) / 3)


def test_the_hinge_is_flat_past_its_margin_and_apo_down_pushes_both_likelihoods_down():
    c = _t([5.0], grad=True)  # beta h = 0.5 * 5 > 1: past the margin
    out = dpo_loss(c, _t([0.0]), _t([0.0]), _t([0.0]), beta=0.5, loss_type="hinge")
    out.loss.backward()
    assert out.loss.item() == 0.0 and c.grad.item() == 0.0
    c, r = _t([0.0], grad=True), _t([0.0], grad=True)
    dpo_loss(c, r, _t([0.0]), _t([0.0]), beta=1.0, loss_type="apo_down").loss.backward()
    # d/dc [sig(c) + 1 - sig(c - r)] = 1/4 - 1/4 = 0 at c = r = 0; d/dr = +1/4: descent lowers r, keeps c
    assert c.grad.item() == pytest.approx(0.0) and r.grad.item() == pytest.approx(0.25)


def test_rpo_adds_the_chosen_responses_nll_and_smoothing_is_refused_where_unread():
    nll = [0.5, 1.5, 2.5]
    plain = dpo_loss(_t(PC), _t(PR), _t(RC), _t(RR), beta=0.1)
    rpo = dpo_loss(_t(PC), _t(PR), _t(RC), _t(RR), beta=0.1, rpo_alpha=0.3, chosen_nll=_t(nll))
    assert rpo.loss.item() == pytest.approx(plain.loss.item() + 0.3 * 1.5, rel=1e-12)
    with pytest.raises(ValueError, match="rpo_alpha must be >= 0 and, above 0, comes with chosen_nll"):
        dpo_loss(_t(PC), _t(PR), _t(RC), _t(RR), beta=0.1, rpo_alpha=0.3)
    with pytest.raises(ValueError, match="label_smoothing is not defined for loss_type 'hinge'"):
        dpo_loss(_t(PC), _t(PR), _t(RC), _t(RR), beta=0.1, loss_type="hinge", label_smoothing=0.1)


def test_dpo_hand_number_and_gradient_direction():
    pc = _t([-1.0], grad=True)
    out = dpo_loss(pc, _t([-2.0]), _t([-1.0]), _t([-1.0]), beta=0.5)
    # h = 0 - (-1) = 1 -> -log sigmoid(0.5)
    assert out.loss.item() == pytest.approx(math.log1p(math.exp(-0.5)))
    out.loss.backward()
    assert pc.grad.item() == pytest.approx(-0.5 * (1 - _sig(0.5)))


def test_simpo_values_metrics_and_gradient():
    ac, ar = [-0.5, -2.0, -1.0], [-1.5, -0.25, -1.0]
    c = _t(ac, grad=True)
    out = simpo_loss(c, _t(ar), beta=2.0, gamma=0.5)
    per_pair = [_neg_logsig(2.0 * x - 2.0 * y - 0.5) for x, y in zip(ac, ar)]
    assert out.loss.item() == pytest.approx(sum(per_pair) / 3)
    assert out.chosen_rewards.item() == pytest.approx(2.0 * sum(ac) / 3)
    assert out.reward_margin.item() == pytest.approx(2.0 * (sum(ac) - sum(ar)) / 3)
    assert out.accuracy.item() == pytest.approx(1 / 3)  # a tie is not a win
    out.loss.backward()  # d/da_c of -log sig(2 a_c - 2 a_r - 0.5), over 3 pairs
    expected = [-2.0 * (1 - _sig(2.0 * x - 2.0 * y - 0.5)) / 3 for x, y in zip(ac, ar)]
    assert c.grad.tolist() == pytest.approx(expected)
    with pytest.raises(ValueError, match="beta"):
        simpo_loss(c, _t(ar), beta=0.0, gamma=0.5)


def test_orpo_values_and_the_odds_at_certainty():
    ac, ar = [-0.2, -3.0], [-1.0, -0.1]

    def odds(a):
        p = math.exp(a)
        return math.log(p / (1 - p))

    per_pair = [-x + 0.1 * _neg_logsig(odds(x) - odds(y)) for x, y in zip(ac, ar)]
    c = _t(ac, grad=True)
    out = orpo_loss(c, _t(ar), lam=0.1)
    assert out.loss.item() == pytest.approx(sum(per_pair) / 2)
    assert out.accuracy.item() == pytest.approx(0.5) and out.chosen_rewards.item() == pytest.approx(0.1 * -1.6)
    out.loss.backward()
    assert all(g < 0 for g in c.grad.tolist())  # more likely chosen responses lower the loss
    assert log_odds(_t([-0.7])).item() == pytest.approx(odds(-0.7))
    certain = orpo_loss(_t([0.0], grad=True), _t([-1.0]), lam=1.0)  # p = 1: odds capped, loss finite
    assert math.isfinite(certain.loss.item()) and log_odds(_t([0.0])).item() == pytest.approx(odds(-1e-6))
    certain.loss.backward()
    with pytest.raises(ValueError, match="lam"):
        orpo_loss(c, _t(ar), lam=0.0)


def test_dpo_extreme_and_errors():
    out = dpo_loss(_t([0.0]), _t([-100.0]), _t([-100.0]), _t([0.0]), beta=1.0)
    assert math.isfinite(out.loss.item())
    out = dpo_loss(_t([-100.0]), _t([0.0]), _t([0.0]), _t([-100.0]), beta=1.0)
    assert out.loss.item() == pytest.approx(200.0)
    with pytest.raises(ValueError) as err:
        dpo_loss(_t([0.0]), _t([0.0]), _t([0.0]), _t([0.0]), beta=0.1, loss_type="slic")
    for name in sorted(DPO_LOSS_TYPES):
        assert name in str(err.value)
    with pytest.raises(ValueError):
        dpo_loss(_t([0.0]), _t([0.0]), _t([0.0]), _t([0.0]), beta=0.1, loss_type="ipo",
                 label_smoothing=0.1)
    with pytest.raises(ValueError):
        dpo_loss(_t([0.0]), _t([0.0]), _t([0.0]), _t([0.0]), beta=0.0)


def _py_kto(pol, ref, des, kl, beta, wd, wu):
    z0 = max(kl, 0.0)
    losses = []
    for p, r0, d in zip(pol, ref, des):
        r = p - r0
        losses.append(wd * (1 - _sig(beta * (r - z0))) if d else wu * (1 - _sig(beta * (z0 - r))))
    return sum(losses) / len(losses)


@pytest.mark.parametrize("des", [[True, False, True, False], [True] * 4, [False] * 4])
@pytest.mark.parametrize("kl", [0.3, -0.4])
def test_kto_values(des, kl):
    pol, ref = [-5.0, -6.0, -3.0, -8.0], [-5.5, -5.0, -3.0, -9.0]
    beta, wd, wu = 0.2, 1.0, 1.33
    kl_t = _t(kl, grad=True)
    pol_t = _t(pol, grad=True)
    out = kto_loss(pol_t, _t(ref), torch.tensor(des), kl_t, beta=beta,
                   desirable_weight=wd, undesirable_weight=wu)
    assert out.loss.item() == pytest.approx(_py_kto(pol, ref, des, kl, beta, wd, wu), rel=1e-12)
    assert out.kl.item() == pytest.approx(max(kl, 0.0))
    assert out.n_desirable == sum(des) and out.n_undesirable == 4 - sum(des)
    rews = [beta * (p - r) for p, r in zip(pol, ref)]
    d_r = [x for x, d in zip(rews, des) if d]
    u_r = [x for x, d in zip(rews, des) if not d]
    exp_c = sum(d_r) / len(d_r) if d_r else 0.0
    exp_u = sum(u_r) / len(u_r) if u_r else 0.0
    assert out.chosen_rewards.item() == pytest.approx(exp_c)
    assert out.rejected_rewards.item() == pytest.approx(exp_u)
    assert out.reward_margin.item() == pytest.approx(exp_c - exp_u)
    z0 = max(kl, 0.0)
    acc = sum(((p - r) > z0) if d else ((p - r) < z0) for p, r, d in zip(pol, ref, des)) / 4
    assert out.accuracy.item() == pytest.approx(acc)
    out.loss.backward()
    assert kl_t.grad is None  # reference point is detached
    assert torch.isfinite(pol_t.grad).all()


def test_kto_extreme_finite():
    out = kto_loss(_t([50.0, -50.0]), _t([-50.0, 50.0]), torch.tensor([False, True]),
                   _t(0.0), beta=1.0)
    assert out.loss.item() == pytest.approx(1.0, rel=1e-9)


def test_best_worst_pairs_skip_and_count_tied_groups():
    from algos.losses.preference import best_worst_pairs

    rewards = torch.tensor([0.1, 0.9, 0.5,   # best row 1, worst row 0
                            1.0, 1.0, 1.0,   # tied: no pair
                            0.0, -2.0, 3.0,  # best row 8, worst row 7
                            2.0, 2.0, 1.0])  # best row 9 (first of the tie), worst row 11
    chosen, rejected, skipped = best_worst_pairs(rewards, 3)
    assert chosen.tolist() == [1, 8, 9] and rejected.tolist() == [0, 7, 11] and skipped == 1
    with pytest.raises(ValueError, match="multiple of group_size=5"):
        best_worst_pairs(rewards, 5)
