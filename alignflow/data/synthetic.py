"""The bundled synthetic task: "which digit is largest?".

A prompt lists `num_digits` distinct digits; the checkable answer is the
largest. The task is built so that RLHF is measurable on a CPU in minutes:

- SFT demonstrations answer correctly with probability
  `sft_correct_fraction`; otherwise they show a bad habit, answering the
  first digit that is *not* the largest. An SFT model therefore learns a
  mixture, and sampling from it is often wrong.
- Preference pairs always prefer the correct answer; the rejected answer is
  the habit, another digit of the prompt, or a digit that is not in the
  prompt at all (larger than the true maximum where one exists), a third of
  the time each. Without the last kind a reward model learns "bigger digits
  are better" and RL exploits it by answering 9 everywhere.
- RL prompts and held-out evaluation prompts carry the answer for checking;
  evaluation prompts never occur among the training prompts.

Everything derives from the data stage's seed: the same config gives the same data.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from alignflow.config import SyntheticTaskConfig
from alignflow.seeds import derive_seed

QUESTION = "Which digit is largest?"


def render_question(digits: list[int]) -> str:
    return f"{QUESTION} {' '.join(map(str, digits))}"


def check_answer(response: str, answer: str | None) -> bool:
    """The task metric: the response, stripped, is exactly the answer (never right for a row without one)."""
    return answer is not None and response.strip() == answer.strip()


def _habit(digits: list[int]) -> int:
    """The bad habit: the first digit that is not the largest."""
    top = max(digits)
    return next(d for d in digits if d != top)


def _messages(digits: list[int]) -> list[dict[str, str]]:
    return [{"role": "user", "content": render_question(digits)}]


class _Sampler:
    """Draws distinct-digit prompts, never repeating one across splits."""

    def __init__(self, seed: int, num_digits: int):
        self.rng = random.Random(seed)
        self.num_digits = num_digits
        self.seen: set[tuple[int, ...]] = set()

    def draw(self) -> list[int]:
        for _ in range(10_000):
            digits = self.rng.sample(range(10), self.num_digits)
            if tuple(digits) not in self.seen:
                self.seen.add(tuple(digits))
                return digits
        raise ValueError(f"ran out of distinct prompts with {self.num_digits} digits")


def generate(cfg: SyntheticTaskConfig, seed: int) -> dict[str, list[dict]]:
    """All splits of the task: sft, preference, prompts, eval, eval_preference.

    Eval prompts are drawn first, so changing the training split sizes never
    changes the held-out set. `seed` is the data stage's seed.
    """
    sampler = _Sampler(derive_seed(seed, "prompts"), cfg.num_digits)
    rng = random.Random(derive_seed(seed, "answers"))
    eval_digits = [sampler.draw() for _ in range(cfg.num_eval)]
    splits: dict[str, list[dict]] = {
        "eval": [{"prompt": _messages(d), "answer": str(max(d))} for d in eval_digits],
        "eval_preference": [_pair(d, rng) for d in eval_digits],
        "sft": [],
        "preference": [],
        "prompts": [],
    }
    for _ in range(cfg.num_sft):
        d = sampler.draw()
        correct = rng.random() < cfg.sft_correct_fraction
        splits["sft"].append({"prompt": _messages(d), "response": str(max(d) if correct else _habit(d))})
    for _ in range(cfg.num_preference):
        splits["preference"].append(_pair(sampler.draw(), rng))
    for _ in range(cfg.num_rl_prompts):
        d = sampler.draw()
        splits["prompts"].append({"prompt": _messages(d), "answer": str(max(d))})
    return splits


def _pair(digits: list[int], rng: random.Random) -> dict:
    top = max(digits)
    kind = rng.randrange(3)
    absent = [d for d in range(10) if d not in digits]
    if kind == 0:
        wrong = _habit(digits)
    elif kind == 1 or not absent:
        wrong = rng.choice([d for d in digits if d != top])
    else:
        wrong = rng.choice([d for d in absent if d > top] or absent)
    return {"prompt": _messages(digits), "chosen": str(top), "rejected": str(wrong)}


def tokenizer_corpus(seed: int = 0, n: int = 2000, num_digits: int = 5) -> Iterator[str]:
    """Text to train the tiny tokenizer on: task questions and answers."""
    rng = random.Random(seed)
    for _ in range(n):
        digits = rng.sample(range(10), num_digits)
        yield render_question(digits)
        yield str(rng.randrange(10))


def rule_reward(prompt: str, response: str, answer: str | None) -> float:
    """A rule-based reward for RL rounds: 1.0 for a correct answer, else 0.0."""
    return 1.0 if answer is not None and check_answer(response, answer) else 0.0
