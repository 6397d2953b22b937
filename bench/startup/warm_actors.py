"""Benchmark: engines started one after another, in new processes and in processes kept warm, side by side.

    .venv/bin/python bench/startup/warm_actors.py              # 2 rounds of 3 starts each
    .venv/bin/python bench/startup/warm_actors.py --runs 3 --starts 4

One local Ray (as a run starts it) and a tiny model. Each start is what an RL round's start asks for on the
CPU: a trainer rank (one step of SFT), a vLLM rollout engine (one generation) and a scorer (reference
log-probs), then their end. `cold` starts them outside `keep_warm()`: every start a new process. `warm`
inside it (engines/placement/warm.py): the first start makes the processes, the next ones take them.
Variants alternate, order reversed every other round. Printed: each run's seconds, the medians and their
ratio, and the pool's counts of a warm run.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def one_start(model: str, batch: dict, prompts: list[list[int]], pad_id: int) -> None:
    """A trainer rank, a rollout engine and a scorer started together, each used once, then ended."""
    import ray

    from alignflow.config import EngineConfig
    from engines.batches import shard
    from engines.placement import warm
    from engines.rl.experience import from_rollouts
    from engines.rl.scoring import start_scorer
    from engines.rollout.actors import RolloutEngines, start_rollout_actor
    from engines.rollout.base import Sampling
    from engines.train import objectives
    from engines.train.group import TrainerGroup
    from engines.train.spec import EngineSpec

    spec = EngineSpec.from_config(EngineConfig(learning_rate=1e-3, warmup_steps=0), model_path=model, kind="causal",
                                  total_steps=10, global_batch=8, dtype="float32", torch_threads=1, seed=0)
    engines = RolloutEngines([start_rollout_actor("vllm", model, num_cpus=1, torch_threads=1, dtype="float32",
                                                  seed=0, max_model_len=128)])
    scorer = start_scorer(model, None, dtype="float32", torch_threads=1)
    group = TrainerGroup(spec, 1)
    try:
        group.train_step(shard(batch, 1), objectives.causal_lm_objective, weigh=objectives.response_tokens)
        rollouts = engines.generate(prompts, Sampling(n=2, temperature=1.0, max_new_tokens=8))
        ray.get(scorer.ref_logprobs.remote(from_rollouts(rollouts, pad_id).tensors()))
    finally:
        group.shutdown()
        engines.shutdown()
        warm.end(scorer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2, help="rounds; each runs both variants")
    parser.add_argument("--starts", type=int, default=3, help="starts one after another in a run")
    args = parser.parse_args()

    import ray

    from alignflow.cluster import init_ray, ray_init_kwargs
    from alignflow.config import InfraConfig, SyntheticTaskConfig, TinyModelConfig
    from alignflow.data import synthetic
    from engines import models
    from engines.batches import render_prompt, sft_tensors
    from engines.placement.warm import keep_warm

    init_ray(**ray_init_kwargs(InfraConfig()))
    with tempfile.TemporaryDirectory(prefix="alignflow-warm-") as tmp:
        model = str(models.build_tiny_model(TinyModelConfig(), seed=0, out_dir=Path(tmp) / "tiny"))
        tokenizer = models.load_tokenizer(model)
        task = SyntheticTaskConfig(num_sft=8, num_preference=1, num_eval=1, num_rl_prompts=1)
        data = synthetic.generate(task, seed=0)
        batch = sft_tensors(tokenizer, data["sft"], 64, 16)[0]
        prompts = [render_prompt(tokenizer, [{"role": "user", "content": "Which digit is largest? 3 1 4"}])] * 2
        seconds: dict[str, list[float]] = {"cold": [], "warm": []}
        counts = None
        for run in range(args.runs):
            for variant in (("cold", "warm") if run % 2 == 0 else ("warm", "cold")):
                scope = keep_warm() if variant == "warm" else contextlib.nullcontext()
                start = time.perf_counter()
                with scope as pool:
                    for _ in range(args.starts):
                        one_start(model, batch, prompts, tokenizer.pad_token_id)
                seconds[variant].append(time.perf_counter() - start)
                counts = pool.counts if pool is not None else counts
                print(f"run {run + 1} {variant}: {seconds[variant][-1]:.1f} s for {args.starts} starts", flush=True)
    ray.shutdown()
    cold, warm = (statistics.median(seconds[v]) for v in ("cold", "warm"))
    print(f"\n{args.starts} starts of a trainer rank, a vLLM engine and a scorer, one after another")
    print(f"  cold (new processes): median {cold:.1f} s  {[round(s, 1) for s in seconds['cold']]}")
    runs = [round(s, 1) for s in seconds["warm"]]
    print(f"  warm (keep_warm):     median {warm:.1f} s  {runs}  ({warm / cold:.2f}x)")
    print(f"  a warm run's processes: {counts}")


if __name__ == "__main__":
    main()
