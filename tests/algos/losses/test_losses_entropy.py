"""Entropy from logits and the entropy-bonus loss term."""

import math

import pytest
import torch

from algos.losses.entropy import entropy_bonus_loss, entropy_from_logits
from algos.losses.policy import entropy_from_logits as reexported


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


def test_high_entropy_tokens_keep_the_top_share_of_the_valid_ones():
    from algos import high_entropy_tokens

    h = torch.tensor([[0.1, 2.0, 0.5, 9.0], [1.5, 0.2, 3.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])  # 9.0 is padding: never kept
    # 7 valid tokens: 0.3 of them is floor(2.1) = 2 -> 3.0 and 2.0
    assert high_entropy_tokens(h, mask, 0.3).tolist() == [[False, True, False, False], [False, False, True, False]]
    # a share under one token still keeps one; a share of 1 keeps every valid token
    assert high_entropy_tokens(h, mask, 0.01).sum().item() == 1
    assert high_entropy_tokens(h, mask, 1.0).tolist() == mask.bool().tolist()
    with pytest.raises(ValueError, match="fraction"):
        high_entropy_tokens(h, mask, 0.0)
