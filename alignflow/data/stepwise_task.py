"""The bundled task's step-labelled solutions, for a process reward model (`data.synthetic.num_process`).

A solution writes the running largest digit of its prompt, a step per digit,
each step followed by STEP_SEPARATOR. Half of them slip once, at a step past
the first (where the digit is larger they keep the old value, else they take
the digit), and carry on from the slip. A step is labelled right where it is
the largest digit so far, as PRM800K labels each step on its own: a slip that
a larger digit later covers is wrong only until then.

Kept apart from alignflow/data/synthetic.py, whose source is the default
checker's and rule reward's (their stages' keys follow it). Prompts are drawn
from the data stage's seed and never repeat one of the task's other splits.
"""

from __future__ import annotations

import random

from alignflow.config import SyntheticTaskConfig
from alignflow.config.data import STEP_SEPARATOR
from alignflow.data.synthetic import QUESTION, render_question
from alignflow.seeds import derive_seed


def _digits(record: dict) -> tuple[int, ...]:
    """The digits of a bundled-task prompt (its one user message: the question, then the digits)."""
    return tuple(int(d) for d in record["prompt"][-1]["content"].removeprefix(QUESTION).split())


def solutions(cfg: SyntheticTaskConfig, seed: int, splits: dict[str, list[dict]]) -> list[dict]:
    """`cfg.num_process` step-labelled solutions ({"prompt", "steps", "labels"}), on prompts none of `splits`
    (the task's other splits) holds."""
    taken = {_digits(r) for rows in splits.values() for r in rows}
    rng = random.Random(derive_seed(seed, "process"))
    out = []
    while len(out) < cfg.num_process:  # the config checks that enough distinct prompts exist
        digits = rng.sample(range(10), cfg.num_digits)
        if tuple(digits) not in taken:
            taken.add(tuple(digits))
            out.append(stepwise_solution(digits, rng))
    return out


def stepwise_solution(digits: list[int], rng: random.Random) -> dict:
    """One solution of `digits`, slipping or not by `rng` (see the module docstring)."""
    slip = rng.randrange(1, len(digits)) if rng.random() < 0.5 else -1
    value, steps, labels = None, [], []
    for k, d in enumerate(digits):
        right = d if value is None else max(value, d)
        value = (value if d > value else d) if k == slip else right
        steps.append(f"{value}{STEP_SEPARATOR}")
        labels.append(value == max(digits[: k + 1]))
    return {"prompt": [{"role": "user", "content": render_question(digits)}], "steps": steps, "labels": labels}
