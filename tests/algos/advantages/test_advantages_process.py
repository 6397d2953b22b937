"""Dense process rewards: DeepSeekMath's process-supervision advantage and step rewards in the returns, against
values worked out by hand in plain Python."""

import math

import pytest
import torch

import algos
from algos import StepRewards

EPS = 1e-6


def _steps(rewards: list[list[float]], ends: list[list[int]]) -> StepRewards:
    return StepRewards(torch.tensor(rewards), torch.tensor(ends, dtype=torch.float32))


# Two prompts, two samples each, four tokens. Group 0: row 0's steps end at t=1 (+1) and t=3 (-1), row 1 has one
# step ending at t=2 (+2) and a padding token at t=3. Group 1: row 2 has one step (0.0: a reward of 0 still counts
# as a step), row 3 one step (+3), at t=0 and t=1.
REWARDS = [[0.0, 1.0, 0.0, -1.0], [0.0, 0.0, 2.0, 9.0], [0.0, 0.0, 0.0, 0.0], [0.0, 3.0, 0.0, 0.0]]
ENDS = [[0, 1, 0, 1], [0, 0, 1, 0], [1, 0, 0, 0], [0, 1, 0, 0]]  # row 1's 9.0 is no step: ignored
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.float32)


def _close(got: torch.Tensor, want: list[list[float]]) -> None:
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-5, rtol=1e-5)


def _normalised(values: list[float], std_norm: bool) -> list[float]:
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return [(v - mean) / (std + EPS) if std_norm else v - mean for v in values]


@pytest.mark.parametrize("std_norm", [True, False])
def test_each_token_gets_the_normalised_rewards_of_the_steps_ending_at_it_or_after(std_norm):
    a, b, c = _normalised([1.0, -1.0, 2.0], std_norm)
    d, e = _normalised([0.0, 3.0], std_norm)
    want = [[a + b, a + b, b, b], [c, c, c, 0.0], [d, 0.0, 0.0, 0.0], [e, e, 0.0, 0.0]]
    got = algos.process_group_advantages(_steps(REWARDS, ENDS), MASK, 2, eps=EPS, std_norm=std_norm)
    _close(got, want)


def test_a_group_of_equal_step_rewards_or_of_one_step_gives_zero():
    rewards = [[0.5, 0.5], [0.0, 0.5], [0.0, 4.0], [0.0, 0.0]]
    ends = [[1, 1], [0, 1], [0, 1], [0, 0]]  # group 0: three equal rewards; group 1: a single step
    got = algos.process_group_advantages(_steps(rewards, ends), torch.ones(4, 2), 2, eps=EPS)
    assert got.abs().max().item() == 0.0


def test_a_batch_that_is_not_whole_groups_is_refused():
    with pytest.raises(ValueError, match="multiple of group_size 2"):
        algos.process_group_advantages(_steps([[1.0]] * 3, [[1]] * 3), torch.ones(3, 1), 2, eps=EPS)


def test_step_rewards_are_added_where_steps_end_only():
    token = torch.tensor([[0.0, 0.0, 0.0, 5.0]])
    out = algos.with_step_rewards(token, _steps([[7.0, 1.0, 2.0, 3.0]], [[0, 1, 0, 1]]))
    assert out.tolist() == [[0.0, 1.0, 0.0, 8.0]]
    assert algos.with_step_rewards(token, None) is token


def test_grpo_adds_the_process_advantage_to_its_outcome_one():
    """Outcome scores (1, 0 | 1, 1) at the last token, plus the dense steps above."""
    token = torch.zeros(4, 4)
    token[0, 3], token[1, 2], token[2, 3], token[3, 3] = 1.0, 0.0, 1.0, 1.0
    fn = algos.get_advantage_estimator("grpo")
    out = fn(token_rewards=token, action_mask=MASK, values=None, group_size=2, gamma=1.0, lam=1.0, eps=EPS,
             steps=_steps(REWARDS, ENDS))
    outcome = _normalised([1.0, 0.0], True)  # group 1's outcome scores are equal: 0
    a, b, c = _normalised([1.0, -1.0, 2.0], True)
    d, e = _normalised([0.0, 3.0], True)
    want = [[outcome[0] + a + b, outcome[0] + a + b, outcome[0] + b, outcome[0] + b],
            [outcome[1] + c, outcome[1] + c, outcome[1] + c, 0.0], [d, 0.0, 0.0, 0.0], [e, e, 0.0, 0.0]]
    _close(out.advantages, want)
    assert torch.equal(out.returns, out.advantages)


def test_gae_and_reinforce_take_the_step_rewards_in_their_returns():
    """gamma = lam = 1, values 0: GAE's advantage and REINFORCE++'s return are each token's reward-to-go."""
    token = torch.zeros(4, 4)
    token[:, 3] = 0.5
    token[1, 2], token[1, 3] = 0.5, 0.0  # row 1 ends at t=2
    steps = _steps(REWARDS, ENDS)
    to_go = []
    for row, ends, mask in zip(REWARDS, ENDS, MASK.tolist()):
        r = [(row[t] if ends[t] else 0.0) + (0.5 if t == sum(mask) - 1 else 0.0) for t in range(4)]
        to_go.append([sum(r[t:int(sum(mask))]) if mask[t] else 0.0 for t in range(4)])
    gae = algos.get_advantage_estimator("gae")(token_rewards=token, action_mask=MASK, values=torch.zeros(4, 4),
                                               group_size=2, gamma=1.0, lam=1.0, eps=EPS, steps=steps)
    _close(gae.advantages, to_go)
    rpp = algos.get_advantage_estimator("reinforce_pp")(token_rewards=token, action_mask=MASK, values=None,
                                                        group_size=2, gamma=1.0, lam=1.0, eps=EPS, steps=steps)
    _close(rpp.returns, to_go)


def test_per_token_credit_has_no_place_for_step_rewards():
    with pytest.raises(ValueError, match="per_token"):
        algos.get_advantage_estimator("per_token")(
            token_rewards=torch.zeros(4, 4), action_mask=MASK, values=None, group_size=2, gamma=1.0, lam=1.0,
            eps=EPS, steps=_steps(REWARDS, ENDS))


def test_steps_ending_on_one_token_count_as_the_steps_they_are():
    """Row 0: a step of 1 at t=0 and two of 1 each at t=2 (summed: 2, counted: 2); row 1: a step of 0 at t=0. As
    DeepSeekMath normalises each step: over {1, 1, 1, 0}, mean .75 and unbiased std .5."""
    steps = StepRewards(torch.tensor([[1.0, 0.0, 2.0], [0.0, 0.0, 0.0]]), torch.tensor([[1.0, 0.0, 2.0], [1.0, 0, 0]]))
    got = algos.process_group_advantages(steps, torch.ones(2, 3), 2, eps=0.0)
    per_step = [(v - 0.75) / 0.5 for v in (1.0, 1.0, 1.0, 0.0)]
    _close(got, [[sum(per_step[:3]), sum(per_step[1:3]), sum(per_step[1:3])], [per_step[3], 0.0, 0.0]])
