"""`alignflow.rewards:math_equal`, the bundled math-answer rule: where it finds the final answer, what it
counts as equal, and that a policy's output is parsed, never run."""

from __future__ import annotations

import pytest

from alignflow.rewards import final_answer, math_equal, parse_math


@pytest.mark.parametrize("response, answer", [
    ("The answer is 42.", "42"),
    ("First 3 + 4 = 7, so 7", "7"),
    ("Thus \\boxed{\\frac{3}{4}}", "0.75"),
    ("Thus \\boxed{\\dfrac{6}{8}} and more text 5", "3/4"),
    ("The total is 1,000", "1000"),
    ("#### -3.50", "-7/2"),
    ("answer: 2\\sqrt{2}", "sqrt(8)"),
    ("Final answer: 50%", "1/2"),
    ("so x = (1+2)*3", "9"),
    ("3pi", "3*pi"),
    ("2^10", "1024"),
    ("The answer is 42 (forty-two).", "42"),  # what dangles after an answer is not part of it
    ("The answer is 12 - easy.", "12"),
    ("So x = 7 (approx).", "7"),
])
def test_equal_answers_in_any_written_form_score_one(response, answer):
    assert math_equal("q", response, answer) == 1.0


@pytest.mark.parametrize("response, answer", [
    ("The answer is 41.", "42"),
    ("The answer is 42, not 7", "7"),      # the first answer after the marker
    ("7 then finally 8", "7"),             # without a marker: the last one
    ("\\boxed{3/5} but 3/4 above", "3/4"),  # a boxed answer wins
    ("0.333", "1/3"),                       # exact, not rounded
    ("no number here", "3"),
    ("", "3"),
    ("The answer is 3", None),              # no reference answer
    ("The answer is 3", "not math"),        # an answer that does not parse
])
def test_different_or_missing_answers_score_zero(response, answer):
    assert math_equal("q", response, answer) == 0.0


def test_the_final_answer_is_found_where_it_is_stated():
    assert final_answer("We add: 2 + 2 = 4. The answer is 4.") == "4"
    assert final_answer("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert final_answer("It spins 3 times") == "3"  # 'pi' inside a word is no pi
    assert final_answer("nothing") is None


def test_a_policys_output_is_parsed_never_evaluated(tmp_path):
    marker = tmp_path / "ran"
    attack = f"__import__('pathlib').Path('{marker}').write_text('x')"
    assert math_equal("q", attack, "1") == 0.0 and parse_math(attack) is None
    assert not marker.exists()
    for huge in ("9^9^9", "((10^64)^64)^64", "1" * 500):
        assert parse_math(huge) is None, huge  # bounded work, not a hang
    assert parse_math("1/0") is None


def test_it_loads_as_a_reward_rule():
    from engines.rl.rewards import RuleReward, ScoredText

    rule = RuleReward("alignflow.rewards:math_equal")
    assert rule([ScoredText("q", "The answer is 12", "12"), ScoredText("q", "The answer is 13", "12")]) == [1.0, 0.0]
