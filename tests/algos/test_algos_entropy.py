"""Entropy from logits and the entropy-bonus loss term."""

import math

import pytest
import torch

from algos.entropy import entropy_bonus_loss, entropy_from_logits
from algos.policy_loss import entropy_from_logits as reexported


def _py_entropy(logits):
    mx = max(logits)
    exps = [math.exp(z - mx) for z in logits]
    tot = sum(exps)
    return -sum((e / tot) * math.log(e / tot) for e in exps if e > 0)


def test_values_against_python():
    rows = [[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], [[-1.0, 5.0, 0.5], [10.0, -10.0, 0.0]]]
    out = entropy_from_logits(torch.tensor(rows, dtype=torch.float64))
    assert out.shape == (2, 2)
    for b in range(2):
        for t in range(2):
            assert out[b, t].item() == pytest.approx(_py_entropy(rows[b][t]), rel=1e-12)
    assert out[0, 1].item() == pytest.approx(math.log(3.0))
    assert reexported is entropy_from_logits


def test_large_and_minus_inf_logits_are_finite():
    logits = torch.tensor([[[1000.0, 0.0, -1000.0], [0.0, float("-inf"), 0.0]]],
                          requires_grad=True)
    out = entropy_from_logits(logits)
    assert torch.isfinite(out).all()
    assert out[0, 0].item() == pytest.approx(0.0, abs=1e-6)
    assert out[0, 1].item() == pytest.approx(math.log(2.0), rel=1e-6)
    out.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_entropy_bonus_loss():
    ent = torch.tensor([[1.0, 2.0, 1e6], [3.0, 1e6, 1e6]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = entropy_bonus_loss(ent, mask, entropy_coef=0.01)
    assert out.item() == pytest.approx(-0.01 * (1 + 2 + 3) / 3)
    out2 = entropy_bonus_loss(ent, mask, entropy_coef=0.01, agg="seq_mean_token_mean")
    assert out2.item() == pytest.approx(-0.01 * (1.5 + 3.0) / 2)


def _py_logprob(logits, target):
    mx = max(logits)
    return logits[target] - (mx + math.log(sum(math.exp(z - mx) for z in logits)))


def test_target_logprobs_and_entropy_against_python():
    from algos.entropy import target_logprobs_and_entropy

    rows = [[1.0, 2.0, 3.0, -4.0], [0.0, 0.0, 0.0, 0.0], [300.0, -300.0, 299.0, 0.5]]  # large: no overflow
    targets = [2, 0, 1]
    logprobs, entropy = target_logprobs_and_entropy(torch.tensor(rows, dtype=torch.float64),
                                                    torch.tensor(targets), with_entropy=True)
    for i, (row, y) in enumerate(zip(rows, targets)):
        assert logprobs[i].item() == pytest.approx(_py_logprob(row, y), rel=1e-12, abs=1e-12)
        assert entropy[i].item() == pytest.approx(_py_entropy(row), rel=1e-9, abs=1e-12)
    alone, none = target_logprobs_and_entropy(torch.tensor(rows, dtype=torch.float64), torch.tensor(targets))
    assert none is None and torch.equal(alone, logprobs)


def test_target_logprobs_and_entropy_gradients():
    """Both outputs' gradients pass gradcheck and equal autograd through log_softmax; an entropy
    left out of the loss changes nothing."""
    from algos.entropy import target_logprobs_and_entropy

    gen = torch.Generator().manual_seed(0)
    z = (3 * torch.randn(5, 9, generator=gen, dtype=torch.float64)).requires_grad_()
    y = torch.randint(0, 9, (5,), generator=gen)
    assert torch.autograd.gradcheck(lambda t: target_logprobs_and_entropy(t, y, with_entropy=True), (z,))
    w_lp, w_h = torch.randn(5, generator=gen, dtype=torch.float64), torch.randn(5, generator=gen, dtype=torch.float64)
    logprobs, entropy = target_logprobs_and_entropy(z, y, with_entropy=True)
    ours = torch.autograd.grad((w_lp * logprobs).sum() + (w_h * entropy).sum(), z)[0]
    logp = torch.log_softmax(z, dim=-1)
    theirs = torch.autograd.grad((w_lp * logp.gather(-1, y[:, None]).squeeze(-1)).sum()
                                 + (w_h * -(logp.exp() * logp).sum(-1)).sum(), z, retain_graph=True)[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    only_lp = torch.autograd.grad((w_lp * target_logprobs_and_entropy(z, y, with_entropy=True)[0]).sum(), z)[0]
    plain = torch.autograd.grad((w_lp * target_logprobs_and_entropy(z, y)[0]).sum(), z)[0]
    torch.testing.assert_close(only_lp, plain, rtol=0, atol=0)
    torch.testing.assert_close(plain, torch.autograd.grad((w_lp * logp.gather(-1, y[:, None]).squeeze(-1)).sum(), z)[0],
                               rtol=1e-10, atol=1e-12)
