"""Process-reward math (algos/losses/process.py) against values computed here by hand, in plain Python."""

import math

import pytest
import torch

from algos import first_error_steps, solution_scores, stepwise_reward_loss


def _bce(s: float, y: float) -> float:
    p = 1 / (1 + math.exp(-s))
    return -(y * math.log(p) + (1 - y) * math.log(1 - p))


def test_stepwise_loss_is_the_mean_binary_cross_entropy_over_steps():
    scores, labels = [2.0, -1.0, 0.5, -3.0, 0.0], [1.0, 0.0, 0.0, 1.0, 1.0]
    out = stepwise_reward_loss(torch.tensor(scores), torch.tensor(labels))
    want = sum(_bce(s, y) for s, y in zip(scores, labels)) / len(scores)
    assert float(out.loss) == pytest.approx(want, rel=1e-6)
    # right: 2.0/1 yes, -1.0/0 yes, 0.5/0 no, -3.0/1 no, 0.0/1 no (a zero score says "wrong")
    assert float(out.accuracy) == pytest.approx(2 / 5)
    assert float(out.positive_fraction) == pytest.approx(3 / 5)


def test_stepwise_loss_takes_soft_labels_and_its_gradient_is_sigmoid_minus_label():
    s = torch.tensor([0.3, -0.7], requires_grad=True)
    y = torch.tensor([0.25, 1.0])
    stepwise_reward_loss(s, y).loss.backward()
    want = [(1 / (1 + math.exp(-v)) - t) / 2 for v, t in ((0.3, 0.25), (-0.7, 1.0))]
    assert s.grad.tolist() == pytest.approx(want, rel=1e-6)


def test_stepwise_loss_refuses_no_steps_and_mismatched_shapes():
    with pytest.raises(ValueError, match="no labelled step"):
        stepwise_reward_loss(torch.zeros(0), torch.zeros(0))
    with pytest.raises(ValueError, match="one shape"):
        stepwise_reward_loss(torch.zeros(3), torch.zeros(2))


def test_solution_scores_min_last_and_mean_over_the_masked_steps():
    scores = torch.tensor([[1.0, -2.0, 3.0, 9.0], [0.5, 0.7, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
    # row 0: steps 1, -2, 3 (9 unmasked); row 1: steps 0.5 and 0.0 (0.7 unmasked); row 2: no step
    assert solution_scores(scores, mask, "min").tolist() == [-2.0, 0.0, 0.0]
    assert solution_scores(scores, mask, "last").tolist() == [3.0, 0.0, 0.0]
    assert solution_scores(scores, mask, "mean").tolist() == pytest.approx([2 / 3, 0.25, 0.0])
    with pytest.raises(ValueError, match="how must be one of"):
        solution_scores(scores, mask, "max")


def test_first_error_steps_counts_only_masked_steps():
    correct = torch.tensor([[True, False, True, False], [True, True, True, True], [False, True, False, True]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 1, 1, 1]])
    # row 0: step 1 is the first wrong; row 1: none wrong; row 2: position 0 is no step, so the first wrong
    # step is position 2, the second step of the row (ordinal 1)
    assert first_error_steps(correct, mask).tolist() == [1, -1, 1]
