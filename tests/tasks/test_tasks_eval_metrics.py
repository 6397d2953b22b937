"""The evaluation stages' pass@k, majority-vote and score-gap metrics (tasks/stages/eval_metrics.py), by hand."""

import pytest

from alignflow.errors import ConfigError
from tasks.stages.eval_metrics import answer_votes, margin_metrics, pass_at_ks, sample_metrics

# 3 prompts x 3 samples, interleaved as engines may return them
PROMPTS = [0, 1, 2, 0, 1, 2, 0, 1, 2]
TEXTS = ["4", "1", "7", " 4", "2", "7", "5", "3", "7 "]
CORRECT = [True, False, False, True, False, False, False, True, False]
# prompt 0: "4", " 4", "5" -> c = 2, vote "4" (twice): correct
# prompt 1: "1", "2", "3" -> c = 1, a three-way tie: "1" first, wrong
# prompt 2: "7" x 3      -> c = 0, vote "7": wrong


def test_sample_metrics_pass_at_k_and_majority_by_hand():
    metrics = sample_metrics(PROMPTS, TEXTS, CORRECT, num_prompts=3, num_samples=3)
    # pass@1 = mean(2/3, 1/3, 0) = 1/3
    # pass@2 = mean(1 (n-c=1<2), 1 - C(2,2)/C(3,2) = 2/3, 0) = 5/9
    # pass@3 = mean(1, 1, 0) = 2/3
    assert metrics == pytest.approx({"eval/pass_at_1": 1 / 3, "eval/pass_at_2": 5 / 9, "eval/pass_at_3": 2 / 3,
                                     "eval/majority_accuracy": 1 / 3})
    assert metrics["eval/pass_at_1"] == pytest.approx(sum(CORRECT) / len(CORRECT))  # = eval/accuracy
    curve = [metrics[f"eval/pass_at_{k}"] for k in pass_at_ks(metrics)]
    assert pass_at_ks(metrics) == [1, 2, 3] and curve == sorted(curve)  # non-decreasing in k


def test_sample_metrics_with_one_sample_per_prompt():
    metrics = sample_metrics([0, 1], ["a", "b"], [True, False], num_prompts=2, num_samples=1)
    assert metrics == {"eval/pass_at_1": 0.5, "eval/majority_accuracy": 0.5}


@pytest.mark.parametrize("prompts,num_prompts", [
    ([0, 0, 1], 2),        # prompt 1 has one sample of two
    ([0, 0, 1, 1], 3),     # prompt 2 never sampled
    ([0, 0, 1, 5], 2),     # a sample of a prompt that was not asked
])
def test_sample_metrics_refuses_uneven_samples(prompts, num_prompts):
    with pytest.raises(ValueError):
        sample_metrics(prompts, ["x"] * len(prompts), [True] * len(prompts), num_prompts=num_prompts, num_samples=2)


def test_margin_metrics_names_counts_and_accuracies():
    chosen, rejected = [2.0, 0.1, 0.0, 1.2], [1.0, 0.0, 0.3, 0.0]
    # gaps: 1.0 right, 0.1 right, 0.3 wrong, 1.2 right
    metrics = margin_metrics(chosen, rejected, [0.0, 0.5, 1.0, 2.0])
    assert metrics == pytest.approx({
        "eval/rm_count_margin_0_0.5": 2.0, "eval/rm_accuracy_margin_0_0.5": 0.5,
        "eval/rm_count_margin_0.5_1": 0.0,  # empty: a count, no accuracy
        "eval/rm_count_margin_1_2": 2.0, "eval/rm_accuracy_margin_1_2": 1.0,
        "eval/rm_count_margin_2_inf": 0.0,
    })


def test_votes_are_the_vote_on_functions_answers_and_anything_but_a_str_is_refused_naming_it():
    assert answer_votes(None, ["a", "b"], "-") == ["a", "b"]
    assert answer_votes(lambda t: t.split()[-1] if t else None, ["x 4", ""], "m:f") == ["4", None]
    # a float answer failed inside the vote ("'float' object has no attribute 'split'"), no field named
    with pytest.raises(ConfigError, match=r"evaluation.vote_on \(m:f\) returned float 4.0 for the response 'x 4'"):
        answer_votes(lambda t: 4.0, ["x 4"], "m:f")
