"""A dense process reward's step ends in the policy's tokens (engines/rl/process.py): streamed against searched.

    python bench/step/step_ends.py --responses 256 --tokens 1024 --runs 2

Each response is random words from a small alphabet with a step separator ("\\n") after about one word in
twelve, cut to `--tokens` tokens of the tiny byte-level BPE (engines/models.py). The two ways alternate, `--runs`
times each, in this process, and must find the same tokens; it prints each run's seconds and the ratio of the
medians.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engines.models import build_tiny_tokenizer  # noqa: E402
from engines.rl import process  # noqa: E402
from engines.rollout.base import Rollout  # noqa: E402
from engines.steps import step_spans  # noqa: E402


def responses(tokenizer, n: int, tokens: int, seed: int = 0) -> list[Rollout]:
    rng = random.Random(seed)
    out = []
    for b in range(n):
        words: list[str] = []
        while len(" ".join(words)) < tokens * 3:
            word = "".join(rng.choice("abcdefghij0123456789") for _ in range(rng.randint(1, 6)))
            words.append(word + ("\n" if rng.random() < 0.08 else ""))
        ids = tokenizer(" ".join(words), add_special_tokens=False)["input_ids"][:tokens]
        out.append(Rollout(b, [1, 2, 3], ids, tokenizer.decode(ids), [0.0] * len(ids), True))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--responses", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    tokenizer = build_tiny_tokenizer(512)
    rollouts = responses(tokenizer, args.responses, args.tokens)
    marks = [[end for _, end in step_spans(r.text, "\n", r.finished)] for r in rollouts]
    ways = {"streamed": lambda: process.step_end_tokens(tokenizer, rollouts, "\n"),
            "searched": lambda: process._searched(tokenizer, rollouts, marks)}
    times: dict[str, list[float]] = {name: [] for name in ways}
    found = {}
    for _ in range(args.runs):
        for name, way in ways.items():
            start = time.perf_counter()
            found[name] = way()
            times[name].append(time.perf_counter() - start)
    if found["streamed"] != found["searched"]:
        raise SystemExit("the two ways found different step ends")
    print(f"{args.responses} responses of {args.tokens} tokens, {sum(map(len, marks))} steps")
    for name, runs in times.items():
        print(f"  {name}: {', '.join(f'{t:.3f} s' for t in runs)}")
    ratio = statistics.median(times["searched"]) / statistics.median(times["streamed"])
    print(f"  searched / streamed: {ratio:.1f}x")


if __name__ == "__main__":
    main()
