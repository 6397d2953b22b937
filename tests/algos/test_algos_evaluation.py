"""pass@k, majority vote and reward-model accuracy by score gap, against hand-computed values."""

import math

import pytest
import torch

from algos import (MarginBin, accuracy_by_margin_bin, majority_vote_accuracy, normalize_response, pass_at_k,
                   pass_at_k_curve)

# ---- pass@k -------------------------------------------------------------------------


@pytest.mark.parametrize("n,c,k,expected", [
    (5, 2, 2, 1 - 3 / 10),      # 1 - C(3,2)/C(5,2)
    (5, 2, 1, 2 / 5),           # pass@1 = c/n
    (5, 2, 3, 1 - 1 / 10),      # 1 - C(3,3)/C(5,3)
    (5, 2, 4, 1.0),             # n - c = 3 < 4: every 4 samples hold a correct one
    (4, 0, 2, 0.0),
    (4, 4, 1, 1.0),
    (10, 3, 5, 1 - 21 / 252),   # 1 - C(7,5)/C(10,5)
    (1, 1, 1, 1.0),
])
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_stable_for_many_samples():
    # C(1000, 500) overflows a float; 1 - C(990, 10)/C(1000, 10) = 1 - prod_{i=991}^{1000} (1 - 10/i) in closed form:
    expected = 1 - math.comb(990, 10) / math.comb(1000, 10)
    assert pass_at_k(1000, 10, 10) == pytest.approx(expected, rel=1e-12)
    assert 0.0 <= pass_at_k(1000, 1, 500) <= 1.0 and pass_at_k(1000, 1, 500) == pytest.approx(0.5, abs=1e-12)


@pytest.mark.parametrize("n,c,k", [(0, 0, 1), (3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_pass_at_k_curve_means_over_prompts_for_every_k():
    # n = 4; prompts with 0, 1 and 3 correct samples.
    # k=1: (0 + 1/4 + 3/4) / 3 = 1/3
    # k=2: (0 + [1 - C(3,2)/C(4,2)] + 1) / 3 = (0 + 1/2 + 1) / 3 = 1/2
    # k=3: (0 + [1 - C(3,3)/C(4,3)] + 1) / 3 = (0 + 3/4 + 1) / 3 = 7/12
    # k=4: (0 + 1 + 1) / 3 = 2/3
    curve = pass_at_k_curve([0, 1, 3], 4)
    assert curve == pytest.approx([1 / 3, 1 / 2, 7 / 12, 2 / 3], abs=1e-12)
    assert pass_at_k_curve(torch.tensor([0, 1, 3]), 4) == pytest.approx(curve, abs=1e-12)
    with pytest.raises(ValueError):
        pass_at_k_curve([], 4)
    with pytest.raises(ValueError):
        pass_at_k_curve([5], 4)


# ---- majority vote -------------------------------------------------------------------


def test_majority_vote_counts_normalised_responses():
    responses = [["5", " 5 ", "3", "4"],      # "5" twice: wins, correct
                 ["1", "2", "2", "1 "],        # "1" and "2" twice each: "1" seen first, wrong
                 ["7 8", "7  8", "9", "9"],    # "7 8" twice (whitespace collapsed) vs "9" twice: "7 8" first, correct
                 ["x"]]                        # one response, wrong
    correct = [[True, True, False, False],
               [False, True, True, False],
               [True, True, False, False],
               [False]]
    assert majority_vote_accuracy(responses, correct) == pytest.approx(2 / 4)


def test_majority_vote_uses_the_first_member_of_the_winning_value():
    # " a" and "a" normalise alike; the checker accepted only the second: the vote takes the first's flag
    assert majority_vote_accuracy([[" a", "a", "b"]], [[False, True, True]]) == 0.0
    assert normalize_response("  7 \n 8\t") == "7 8"


def test_majority_vote_rejects_mismatched_groups():
    with pytest.raises(ValueError):
        majority_vote_accuracy([["a", "b"]], [[True]])
    with pytest.raises(ValueError):
        majority_vote_accuracy([["a"]], [[True], [False]])
    with pytest.raises(ValueError):
        majority_vote_accuracy([[]], [[]])


# ---- reward-model accuracy by score gap ---------------------------------------------


def test_accuracy_by_margin_bin_hand_values():
    chosen = [1.0, 0.0, 2.0, 3.0, 0.0, 5.0]
    rejected = [0.8, 0.3, 1.4, 1.5, 3.0, 5.0]
    # differences: 0.2 (right), -0.3 (wrong), 0.6 (right), 1.5 (right), -3.0 (wrong), 0.0 (tie: wrong)
    bins = accuracy_by_margin_bin(chosen, rejected, [0.0, 0.5, 1.0, 2.0])
    assert [(b.lo, b.hi, b.count) for b in bins] == [(0.0, 0.5, 3), (0.5, 1.0, 1), (1.0, 2.0, 1), (2.0, math.inf, 1)]
    assert [b.accuracy for b in bins] == pytest.approx([1 / 3, 1.0, 1.0, 0.0])
    assert sum(b.count for b in bins) == len(chosen)  # every pair in exactly one bin


def test_accuracy_by_margin_bin_edges_and_empty_bins():
    bins = accuracy_by_margin_bin(torch.tensor([1.0, 2.0]), torch.tensor([0.5, 2.5]), [0.0, 0.5, 10.0])
    assert bins[0] == MarginBin(0.0, 0.5, 0, bins[0].accuracy) and math.isnan(bins[0].accuracy)
    assert (bins[1].count, bins[1].accuracy) == (2, 0.5)  # a gap equal to an edge goes to the bin it opens
    assert (bins[2].count, bins[2].hi) == (0, math.inf)
    last = accuracy_by_margin_bin([math.inf], [0.0], [0.0, 1.0])[-1]
    assert (last.count, last.accuracy) == (1, 1.0)


@pytest.mark.parametrize("edges", [[], [0.5, 1.0], [0.0, 1.0, 1.0], [0.0, 2.0, 1.0], [0.0, math.inf]])
def test_accuracy_by_margin_bin_rejects_bad_edges(edges):
    with pytest.raises(ValueError):
        accuracy_by_margin_bin([1.0], [0.0], edges)


def test_accuracy_by_margin_bin_rejects_unbinnable_scores():
    with pytest.raises(ValueError):
        accuracy_by_margin_bin([1.0, 2.0], [0.0], [0.0])
    with pytest.raises(ValueError):
        accuracy_by_margin_bin([float("nan")], [0.0], [0.0])


def test_majority_vote_over_final_answers_with_abstentions():
    """Self-consistency votes on final answers: reasoning that differs in every sample must not split the
    vote (evaluation.vote_on gives the answers). A sample stating no answer (None) does not vote; a prompt
    where none votes is a miss."""
    from alignflow.rewards import final_answer

    sampled = [["so x = 3", "thus 3", "I get 7", "it is 7", "answer: 7"], ["a 3", "b 7", "c 7"], ["hmm", "no idea"]]
    correct = [[False, False, True, True, True], [False, True, True], [False, False]]
    assert majority_vote_accuracy(sampled, correct) == 0.0  # whole texts: every sample its own vote, the first wins
    answers = [[final_answer(t) for t in texts] for texts in sampled]
    assert answers == [["3", "3", "7", "7", "7"], ["3", "7", "7"], [None, None]]
    assert majority_vote_accuracy(answers, correct) == pytest.approx(2 / 3)  # 7 and 7 win; the third abstains
    assert majority_vote_accuracy([[None, "5", None]], [[True, False, True]]) == 0.0  # only "5" voted
