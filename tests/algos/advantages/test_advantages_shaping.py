"""Reward clipping, truncation penalty and running normalisation; expected values by hand."""

import json
import math

import pytest
import torch

from algos.advantages.shaping import RunningMeanStd, clip_rewards, truncation_penalty


def test_clip_rewards_counts_what_it_changes():
    out, n = clip_rewards(torch.tensor([-3.0, 0.5, 2.0, -1.5, 1.5]), 1.5)
    assert out.tolist() == [-1.5, 0.5, 1.5, -1.5, 1.5]
    assert n == 2  # |r| == c is left as it is
    with pytest.raises(ValueError, match="clip must be > 0"):
        clip_rewards(torch.zeros(2), 0.0)
    with pytest.raises(ValueError, match="1-D"):
        clip_rewards(torch.zeros(2, 2), 1.0)


def test_truncation_penalty():
    finished = torch.tensor([True, False, True, False])
    assert truncation_penalty(finished, 0.5).tolist() == [0.0, -0.5, 0.0, -0.5]
    assert truncation_penalty(finished, 0.0).tolist() == [0.0] * 4
    with pytest.raises(ValueError, match=">= 0"):
        truncation_penalty(finished, -1.0)


def test_running_mean_std_merges_batches():
    s1 = RunningMeanStd().update(torch.tensor([1.0, 2.0, 3.0]))
    # 1, 2, 3: mean 2, population variance (1 + 0 + 1) / 3
    assert (s1.count, s1.mean, s1.var) == (3.0, pytest.approx(2.0), pytest.approx(2 / 3))
    s2 = s1.update(torch.tensor([4.0, 10.0]))
    # 1, 2, 3, 4, 10: mean 4, variance (9 + 4 + 1 + 0 + 36) / 5 = 10
    assert (s2.count, s2.mean, s2.var, s2.std) == (5.0, pytest.approx(4.0), pytest.approx(10.0),
                                                   pytest.approx(math.sqrt(10.0)))
    assert s1.count == 3.0  # immutable: update returns a new object
    x = torch.tensor([4.0, 14.0, -2.0])
    assert s2.normalize(x).tolist() == pytest.approx([0.0, 10 / math.sqrt(10 + 1e-8), -6 / math.sqrt(10 + 1e-8)])
    assert s2.update(torch.tensor([])) is s2


def test_running_mean_std_round_trips_through_json():
    s = RunningMeanStd().update(torch.tensor([0.1, 0.7, -0.3]))
    back = RunningMeanStd.from_dict(json.loads(json.dumps(s.to_dict())))
    assert back == s
    with pytest.raises(ValueError, match="unknown RunningMeanStd state keys"):
        RunningMeanStd.from_dict({"count": 1.0, "mean": 0.0, "m2": 0.0, "var": 1.0})


def test_rewards_at_turns_moves_each_turns_reward_to_its_end_and_keeps_the_row_sum():
    import algos

    # Row 0: two turns (tokens 0-1 sampled, 2-3 an observation, 4-5 sampled); the first turn earned 0.3 and
    # the episode's return 1.3 (0.3 + 1.0) sits at the last sampled token, as the sequence reward does.
    # Row 1: one turn, its reward already at its end: nothing moves. Row 2: nothing sampled: unchanged.
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.float32)
    token = torch.tensor([[-0.1, -0.1, 0.0, 0.0, -0.1, 1.2], [0.0, 0.0, 2.0, 0.0, 0.0, 0.0], [0.0] * 6])
    turns = torch.tensor([[0.0, 0.3, 0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 2.0, 0.0, 0.0, 0.0], [0.0] * 6])
    out = algos.rewards_at_turns(token, turns, mask)
    expected = torch.tensor([[-0.1, -0.1 + 0.3, 0.0, 0.0, -0.1, 1.2 - 0.3], [0.0, 0.0, 2.0, 0.0, 0.0, 0.0], [0.0] * 6])
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(out.sum(-1), token.sum(-1))
    with pytest.raises(ValueError, match="shapes differ"):
        algos.rewards_at_turns(token, turns[:, :3], mask)
