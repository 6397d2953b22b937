"""Bundled reward rules, usable as `reward.rule` (f(prompt, response, answer) -> float).

`alignflow.rewards:math_equal` checks a response's final mathematical answer against the reference
answer, exactly (alignflow/rewards/math.py); `math_correct` is the same check as an evaluation checker, and
`final_answer` what a majority vote compares (`evaluation.vote_on`).
"""

from alignflow.rewards.math import final_answer, math_correct, math_equal, parse_math

__all__ = ["final_answer", "math_correct", "math_equal", "parse_math"]
