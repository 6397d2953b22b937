"""DAPO dynamic-sampling filters (constant groups, group mean range) and soft overlong punishment."""

import pytest
import torch

from algos.advantages.dapo import dynamic_sampling_filter, group_mean_filter, overlong_penalty


def test_dynamic_sampling_filter_drops_constant_groups():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.0, 0.0, 1.0])
    keep, dropped = dynamic_sampling_filter(r, 3)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [False] * 3 + [True] * 3 + [False] * 3 + [True] * 3
    assert dropped == 2 and isinstance(dropped, int)


def test_dynamic_sampling_filter_group_of_one_and_atol():
    keep, dropped = dynamic_sampling_filter(torch.tensor([0.0, 1.0, 2.0]), 1)
    assert keep.tolist() == [False, False, False] and dropped == 3
    r = torch.tensor([1.0, 1.0 + 1e-9, 0.0, 1.0], dtype=torch.float64)
    assert dynamic_sampling_filter(r, 2)[0].tolist() == [True, True, True, True]
    keep, dropped = dynamic_sampling_filter(r, 2, atol=1e-6)
    assert keep.tolist() == [False, False, True, True] and dropped == 1


def test_dynamic_sampling_filter_validates():
    with pytest.raises(ValueError):
        dynamic_sampling_filter(torch.zeros(5), 2)
    with pytest.raises(ValueError):
        dynamic_sampling_filter(torch.zeros(4), 0)


def _py_penalty(length, max_len, buf, factor):
    start = max_len - buf
    if length <= start:
        return 0.0
    if length <= max_len:
        return (start - length) / buf * factor
    return -factor


@pytest.mark.parametrize("factor", [1.0, 2.5])
def test_overlong_penalty_values(factor):
    lengths = [0, 10, 16, 17, 18, 20, 21, 100]
    out = overlong_penalty(torch.tensor(lengths), max_len=20, buffer_len=4, penalty_factor=factor)
    assert out.dtype == torch.float32
    assert out.tolist() == pytest.approx([_py_penalty(n, 20, 4, factor) for n in lengths])
    # hand values: 17 -> -1/4, 18 -> -2/4, 20 -> -1 (continuous with the hard part)
    assert out[3].item() == pytest.approx(-0.25 * factor)
    assert out[5].item() == pytest.approx(-1.0 * factor)


def test_overlong_penalty_zero_buffer_and_validation():
    out = overlong_penalty(torch.tensor([5.0, 10.0, 11.0]), max_len=10, buffer_len=0)
    assert out.tolist() == [0.0, 0.0, -1.0]
    with pytest.raises(ValueError):
        overlong_penalty(torch.tensor([1]), max_len=10, buffer_len=11)


def test_group_mean_filter_keeps_groups_in_range():
    # group means (size 4): 0.5, 0.75, 0.0
    r = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    keep, dropped = group_mean_filter(r, 4, low=0.1, high=0.7)
    assert keep.tolist() == [True] * 4 + [False] * 8 and dropped == 2
    keep, dropped = group_mean_filter(r, 4, low=0.5, high=0.75)  # bounds inclusive
    assert keep.tolist() == [True] * 8 + [False] * 4 and dropped == 1
    keep, dropped = group_mean_filter(r, 4, low=0.0, high=1.0)
    assert keep.all() and dropped == 0


def test_group_mean_filter_validates():
    with pytest.raises(ValueError, match="low <= high"):
        group_mean_filter(torch.zeros(4), 2, low=0.9, high=0.1)
    with pytest.raises(ValueError, match="multiple"):
        group_mean_filter(torch.zeros(5), 2, low=0.0, high=1.0)
