"""The bundled agent task's data: "what code is in box k?" (alignflow/agents/boxes.py).

Every record hides `boxes` (box number -> two-digit code) that only the environment reads. Splits:
- sft: traces as rows of the ordinary prompt/response form, one per assistant turn, each with the
  environment's `tools`. With probability `sft_correct_fraction` a trace opens the asked box and answers
  its code (two rows: the call; then, after the tool's result, the answer); otherwise it shows the habit
  of answering a guess without the tool (one row).
- prompts, eval: {"prompt", "answer", "boxes"}; eval prompts never occur among the training ones.
- preference, eval_preference: the call over the guess (for configs that train a reward model on it).
Everything derives from the data stage's seed.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

from alignflow.agents.boxes import OPEN_BOX
from alignflow.config import SyntheticTaskConfig
from alignflow.seeds import derive_seed

BOXES_PER_SAMPLE = 3


def question(box: int) -> str:
    return f"What is the code in box {box}?"


def call_text(box: int) -> str:
    return "<tool_call>" + json.dumps({"name": "open_box", "arguments": {"box": box}}) + "</tool_call>"


def _sample(rng: random.Random) -> tuple[int, dict[str, int]]:
    numbers = rng.sample(range(10, 100), BOXES_PER_SAMPLE)
    return numbers[0], {str(n): rng.randrange(10, 100) for n in numbers}


def _record(box: int, boxes: dict[str, int]) -> dict:
    return {"prompt": [{"role": "user", "content": question(box)}], "answer": str(boxes[str(box)]), "boxes": boxes}


def _trace(box: int, boxes: dict[str, int], correct: bool, rng: random.Random) -> list[dict]:
    user = [{"role": "user", "content": question(box)}]
    if not correct:
        return [{"prompt": user, "response": str(rng.randrange(10, 100)), "tools": [OPEN_BOX]}]
    call = call_text(box)
    after = user + [{"role": "assistant", "content": call}, {"role": "tool", "content": str(boxes[str(box)])}]
    return [{"prompt": user, "response": call, "tools": [OPEN_BOX]},
            {"prompt": after, "response": str(boxes[str(box)]), "tools": [OPEN_BOX]}]


def generate(cfg: SyntheticTaskConfig, seed: int) -> dict[str, list[dict]]:
    """All splits; eval first, so the training sizes never change the held-out set."""
    rng = random.Random(derive_seed(seed, "boxes"))
    seen: set[tuple[int, tuple]] = set()

    def draw() -> tuple[int, dict[str, int]]:
        while True:
            box, boxes = _sample(rng)
            key = (box, tuple(sorted(boxes.items())))
            if key not in seen:
                seen.add(key)
                return box, boxes

    evals = [draw() for _ in range(cfg.num_eval)]
    splits: dict[str, list[dict]] = {"eval": [_record(*e) for e in evals],
                                     "eval_preference": [_pair(*e, rng) for e in evals],
                                     "sft": [], "preference": [], "prompts": []}
    for _ in range(cfg.num_sft):
        box, boxes = draw()
        splits["sft"].extend(_trace(box, boxes, rng.random() < cfg.sft_correct_fraction, rng))
    splits["preference"] = [_pair(*draw(), rng) for _ in range(cfg.num_preference)]
    splits["prompts"] = [_record(*draw()) for _ in range(cfg.num_rl_prompts)]
    return splits


def _pair(box: int, boxes: dict[str, int], rng: random.Random) -> dict:
    return {"prompt": [{"role": "user", "content": question(box)}], "chosen": call_text(box),
            "rejected": str(rng.randrange(10, 100)), "tools": [OPEN_BOX]}  # the prompt as the policy sees it


def tokenizer_corpus(seed: int = 0, n: int = 2000) -> Iterator[str]:
    """Text to train the tiny tokenizer on for this task: questions, calls, results, answers."""
    rng = random.Random(seed)
    for _ in range(n):
        box, boxes = _sample(rng)
        yield f"tools: open_box(box) {question(box)} {call_text(box)} {boxes[str(box)]}"
