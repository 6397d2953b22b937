"""Benchmark: multi-turn episodes against single-turn generation of as many tokens, on one vLLM engine.

    .venv/bin/python bench/step/agent_rollout.py              # the CPU default: 32 prompts x 2, 3 turns of 16 tokens

The engine runs in this process, as in a rollout actor (engines/rollout/actors.py). Every turn is exactly
`--turn-tokens` long (EOS ignored), so the three ways generate the same tokens:

  single    one response of turns x turn-tokens per sample (RolloutEngines' ordinary generation)
  episodes  `--turns` turns per episode in an environment that answers at once
  latency   the same, the environment sleeping `--latency-ms` in every step (a tool call, a sandbox)

They alternate, `--repeats` times; printed: each one's median seconds and generated tokens/s, episodes /
single (what turn-by-turn scheduling and the observations' extra prompt tokens cost), and latency /
episodes (what the environment's latency costs when episodes overlap: the issue's target is <= 1.25).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


class Answering:
    """Observes "ok" after each turn, after sleeping `delay_s`; done after `turns` turns."""

    def __init__(self, turns: int, delay_s: float):
        self.turns, self.delay_s, self.done = turns, delay_s, 0

    def reset(self, sample: dict) -> list[dict]:
        return sample["prompt"]

    def step(self, message: dict):
        time.sleep(self.delay_s)
        self.done += 1
        return [{"role": "tool", "content": "ok"}], 0.0, self.done == self.turns, {}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--turn-tokens", type=int, default=16)
    p.add_argument("--latency-ms", type=float, default=50.0)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    from alignflow.config import SyntheticTaskConfig, TinyModelConfig
    from alignflow.data import agent_task
    from engines import models
    from engines.batches import render_prompt
    from engines.rollout.engine_build import build_engine, prepare_engine_process
    from engines.rollout.base import Sampling
    from engines.rollout.episodes import EpisodeLimits, run_episodes

    threads = prepare_engine_process(2, None)
    path = models.build_tiny_model(TinyModelConfig(corpus="boxes", vocab_size=400), 0,
                                   Path(tempfile.mkdtemp(prefix="agent-bench-")), agent_task.tokenizer_corpus())
    engine = build_engine("vllm", str(path), max_model_len=128)
    tok = engine.tokenizer
    records = agent_task.generate(SyntheticTaskConfig(task="boxes", num_sft=1, num_preference=1,
                                                      num_rl_prompts=args.prompts, num_eval=1), 0)["prompts"]
    n, k, t = args.samples, args.turns, args.turn_tokens
    limits = EpisodeLimits(max_turns=k, max_tokens_per_turn=t, max_episode_tokens=100, max_model_len=128,
                           step_timeout_s=30.0, failure_reward=0.0)
    sampling = Sampling(n=n, temperature=1.0, max_new_tokens=k * t, ignore_eos=True)

    def single() -> int:
        rollouts = engine.generate([render_prompt(tok, r["prompt"]) for r in records], sampling)
        return sum(len(r.token_ids) for r in rollouts)

    def episodes(delay_s: float) -> int:
        rollouts = run_episodes(engine, tok, records, n, sampling, lambda: Answering(k, delay_s), limits,
                                lambda ids: tok.decode(ids, skip_special_tokens=True))
        assert all(r.episode["turns"] == k and not r.episode["failed"] for r in rollouts)
        return sum(sum(r.sampled) for r in rollouts)

    ways = {"single": single, "episodes": lambda: episodes(0.0), "latency": lambda: episodes(args.latency_ms / 1e3)}
    for way in ways.values():  # warm-up
        way()
    times: dict[str, list[float]] = {w: [] for w in ways}
    tokens: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, way in ways.items():
            start = time.perf_counter()
            tokens[name] = way()
            times[name].append(time.perf_counter() - start)
    med = {w: statistics.median(v) for w, v in times.items()}
    print(f"vLLM on {threads} CPU threads; {args.prompts} prompts x {n} samples; {k} turns x {t} tokens "
          f"({k * t} generated per sample), environment latency {args.latency_ms:g} ms per step; "
          f"median of {args.repeats}")
    for w in ways:
        print(f"  {w:9s} {med[w]:7.3f} s  {tokens[w]:6d} tokens  {tokens[w] / med[w]:8.1f} tokens/s")
    assert tokens["single"] == tokens["episodes"] == tokens["latency"], tokens
    print(f"episodes / single:   {med['episodes'] / med['single']:.2f}x the time")
    print(f"latency / episodes:  {med['latency'] / med['episodes']:.2f}x the time (target <= 1.25)")


if __name__ == "__main__":
    main()
