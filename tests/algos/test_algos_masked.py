"""Masked reductions: values against plain-Python arithmetic, garbage padding."""

import math

import pytest
import torch

from algos.masked import (
    last_valid_index,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    place_at_last_token,
)

G = 1e6  # garbage in padded positions
X = [[1.0, 2.0, 4.0, G], [3.0, G, G, G], [G, G, G, G]]
M = [[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]


def _valid(xs, ms):
    return [x for xr, mr in zip(xs, ms) for x, m in zip(xr, mr) if m]


def _t(rows):
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32, torch.int64])
def test_masked_sum_and_mean_values(mask_dtype):
    x, m = _t(X), torch.tensor(M).to(mask_dtype)
    vals = _valid(X, M)
    assert masked_sum(x, m).item() == pytest.approx(sum(vals))
    assert masked_sum(x, m, dim=-1).tolist() == pytest.approx([7.0, 3.0, 0.0])
    assert masked_mean(x, m).item() == pytest.approx(sum(vals) / len(vals))
    assert masked_mean(x, m, dim=-1).tolist() == pytest.approx([7.0 / 3.0, 3.0, 0.0])


def test_masked_mean_all_masked_row_is_zero_not_nan():
    x = _t([[5.0, 6.0]])
    m = torch.zeros(1, 2)
    assert masked_mean(x, m).item() == 0.0
    assert masked_mean(x, m, dim=-1).tolist() == [0.0]


def test_inf_and_nan_garbage_do_not_leak():
    x = _t([[1.0, float("inf")], [float("nan"), 2.0]])
    m = torch.tensor([[1, 0], [0, 1]])
    assert masked_sum(x, m).item() == 3.0
    assert masked_mean(x, m, dim=-1).tolist() == [1.0, 2.0]
    assert masked_var(x, m).item() == pytest.approx(0.25)
    assert torch.isfinite(masked_whiten(x, m)).all()


def test_masked_var_population_and_unbiased():
    x, m = _t(X), torch.tensor(M)
    vals = _valid(X, M)
    mu = sum(vals) / len(vals)
    ss = sum((v - mu) ** 2 for v in vals)
    assert masked_var(x, m).item() == pytest.approx(ss / len(vals))
    assert masked_var(x, m, unbiased=True).item() == pytest.approx(ss / (len(vals) - 1))
    row0 = [1.0, 2.0, 4.0]
    mu0 = sum(row0) / 3
    ss0 = sum((v - mu0) ** 2 for v in row0)
    assert masked_var(x, m, dim=-1).tolist() == pytest.approx([ss0 / 3, 0.0, 0.0])
    # single valid entry / no entry with Bessel: defined as 0, never nan
    assert masked_var(x, m, dim=-1, unbiased=True).tolist() == pytest.approx([ss0 / 2, 0.0, 0.0])


def test_masked_whiten_exact_under_padding():
    eps = 1e-8
    x, m = _t(X), torch.tensor(M)
    vals = _valid(X, M)
    mu = sum(vals) / len(vals)
    var = sum((v - mu) ** 2 for v in vals) / len(vals)
    out = masked_whiten(x, m, eps=eps)
    out_noshift = masked_whiten(x, m, shift_mean=False, eps=eps)
    for i, (xr, mr) in enumerate(zip(X, M)):
        for j, (v, mk) in enumerate(zip(xr, mr)):
            exp = (v - mu) / math.sqrt(var + eps) if mk else 0.0
            assert out[i, j].item() == pytest.approx(exp)
            exp2 = exp + mu if mk else 0.0
            assert out_noshift[i, j].item() == pytest.approx(exp2)
    valid = out[m.bool()]
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-12)
    # changing the garbage changes nothing
    x2 = x.clone()
    x2[~m.bool()] = -123.0
    assert torch.equal(masked_whiten(x2, m, eps=eps), out)


def test_masked_whiten_gradient_ignores_padding():
    x = _t(X).requires_grad_(True)
    m = torch.tensor(M)
    (masked_whiten(x, m) * _t([[1.0, 2.0, 3.0, 4.0]] * 3)).sum().backward()
    assert torch.isfinite(x.grad).all()
    assert (x.grad[~m.bool()] == 0).all()


def test_last_valid_index_and_place_at_last_token():
    m = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    assert last_valid_index(m).tolist() == [1, 2, -1, 3]
    out = place_at_last_token(torch.tensor([1.0, 2.0, 3.0, 4.0]), m)
    expected = [[0, 1.0, 0, 0], [0, 0, 2.0, 0], [0, 0, 0, 0], [0, 0, 0, 4.0]]
    assert out.tolist() == expected
    with pytest.raises(ValueError):
        place_at_last_token(torch.ones(3), m)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="shape"):
        masked_sum(torch.ones(2, 3), torch.ones(2, 4))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_reductions_are_taken_in_float32(dtype):
    # 64 x 2048 halves: the fp16 sum (65536) and count overflow to inf; bf16 counts round past 256.
    x = torch.full((64, 2048), 0.5, dtype=dtype)
    mask = torch.ones(64, 2048)
    assert masked_sum(x, mask).item() == 65536.0
    assert masked_mean(x, mask).item() == 0.5
    assert masked_sum(torch.ones(1001, dtype=dtype), torch.ones(1001)).item() == 1001.0
    threes = torch.full((1001,), 3.0, dtype=dtype)
    assert masked_mean(threes, torch.ones(1001)).item() == 3.0
    assert masked_var(threes, torch.ones(1001)).item() == 0.0
