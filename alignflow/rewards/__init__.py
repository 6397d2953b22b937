"""Bundled reward rules, usable as `reward.rule` (f(prompt, response, answer) -> float).

`alignflow.rewards:math_equal` checks a response's final mathematical answer against the reference
answer, exactly (alignflow/rewards/math.py).
"""

from alignflow.rewards.math import final_answer, math_equal, parse_math

__all__ = ["final_answer", "math_equal", "parse_math"]
