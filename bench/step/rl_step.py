"""Benchmark: one GRPO step, phase by phase, against another commit or another allocator.

    .venv/bin/python bench/step/rl_step.py                          # this tree alone
    .venv/bin/python bench/step/rl_step.py --against HEAD~3          # this tree vs a commit, alternating
    .venv/bin/python bench/step/rl_step.py --against HEAD~1 --against-variant "$V" --variants "$V"  # both with V
    .venv/bin/python bench/step/rl_step.py --shape 30m --variants 'glibc_retain;glibc_retain+round.async_rollouts=true'
    .venv/bin/python bench/step/rl_step.py --variants 'glibc_retain;system;jemalloc;glibc_retain+round.async_rollouts=true'
    python3 bench/step/rl_step.py --config configs/gpu-small.yaml    # on a GPU: that config's model and round

The work (issue 14), unless --config: GRPO on a Qwen2-shape model built by
the tiny-model factory (hidden 256, 4 layers, 4 heads, 2 KV heads,
intermediate 1024, vocabulary 2048, tied embeddings, fp32); 32 prompts of
26 tokens, 8 samples each, 32 new tokens; k3 KL as a loss with coefficient
0.04; one epoch, the whole batch one minibatch; lr 1e-5; the rule reward.

Each variant (a source tree, an allocator) runs in its own process with its
own Ray, `--runs` times, the variants alternating run by run (this machine
is noisy: compare only numbers taken side by side). A run times `--steps`
steps after one warm-up step. Printed per variant, medians over runs: the
step time and its phases; system CPU time as a share of the runs' CPU time;
each phase's tokens/s (generated tokens for generation, prompt + response
for the rest) and GFLOP/s against the fp32 matmul peak this run measured;
and the ratio of each variant's step time to the first variant's.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from measure import cpu_times, forward_flops, matmul_peak_gflops, scored_work  # bench/step/measure.py, beside this script
from trees import compared_trees  # bench/step/trees.py

PHASES = ["generate", "score", "reference", "old_logprobs", "critic", "train", "sync"]
WORK = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=1024, vocab_size=2048,
            tie_word_embeddings=True, max_position_embeddings=128)
SHAPES = {"issue14": WORK,  # --shape: the model; the work stays the same
          "30m": {**WORK, "hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4,
                  "intermediate_size": 2048}}
PROMPTS, PROMPT_TOKENS, SAMPLES, NEW_TOKENS = 32, 26, 8, 32


def word_corpus(words: int = 60_000, seed: int = 0) -> list[str]:
    """Pseudo-words, enough distinct letter pairs for a byte-level BPE of 2048 tokens."""
    import random

    rng = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    weights = [len(letters) - i for i in range(len(letters))]
    return [" ".join("".join(rng.choices(letters, weights, k=rng.randint(2, 9))) for _ in range(12))
            for _ in range(words // 12)]


def worker(args) -> dict:
    """One run in this process: start a round, warm up, time `steps` steps; a JSON-able summary."""
    import ray
    import torch

    from alignflow.cluster import ray_init_kwargs
    from alignflow.config import InfraConfig, RoundConfig, SyntheticTaskConfig, load_config
    from alignflow.data import synthetic
    from engines import models
    from engines.rl.round import RLRound
    from engines.rl.round_models import RoundSetup

    peak = matmul_peak_gflops(2)
    ray.init(**ray_init_kwargs(infra_config(InfraConfig)))
    pipeline = load_config(args.config) if args.config else None
    dtype = pipeline.model.dtype if pipeline else "float32"
    path = args.model
    config = models.load_policy(path).config
    records = synthetic.generate(SyntheticTaskConfig(num_sft=1, num_preference=1, num_eval=1,
                                                     num_rl_prompts=PROMPTS), seed=0)["prompts"]
    gen = torch.Generator().manual_seed(0)
    first = len(models.load_tokenizer(path).all_special_ids)
    prompts = [(torch.randint(first, config.vocab_size, (PROMPT_TOKENS,), generator=gen).tolist(), r)
               for r in records]
    if pipeline:
        cfg = pipeline.rounds[0]
    else:
        cfg = RoundConfig.model_validate({
            "algorithm": "grpo", "prompts_per_step": PROMPTS, "reward": {"source": "rule"},
            "generation": {"num_samples": SAMPLES, "max_new_tokens": NEW_TOKENS, "temperature": 1.0},
            "kl": {"coef": 0.04, "estimator": "k3", "apply_as": "loss"},
            "ppo": {"epochs": 1, "minibatch_size": PROMPTS * SAMPLES},
            "actor": {"learning_rate": 1e-5}})
    merged = cfg.model_dump()
    for key, value in json.loads(os.environ.get("ALIGNFLOW_BENCH_ROUND", "{}")).items():  # round.A.B=VALUE parts
        *sections, last = key.split(".")
        functools.reduce(dict.__getitem__, sections, merged)[last] = value
    cfg = RoundConfig.model_validate({**merged, "steps": args.steps + 1})
    rl = RLRound(cfg, RoundSetup(policy_path=path, reference_path=path, reward_path=path, prompts=prompts,
                                 dtype=dtype, torch_threads=2, max_model_len=PROMPT_TOKENS + NEW_TOKENS + 8, seed=0))
    try:
        rl.step(0)  # warm-up: engine start, first kernels
        before, t0 = cpu_times(), time.perf_counter()
        steps = [rl.step(s) for s in range(1, args.steps + 1)]
        wall, after = time.perf_counter() - t0, cpu_times()
    finally:
        rl.shutdown()
        ray.shutdown()
    user, system = (sum(after[p][i] - before[p][i] for p in after if p in before) for i in (0, 1))
    phases = {p: statistics.median(s.metrics.get(f"time/{p}", 0.0) for s in steps) for p in PHASES}
    exp = steps[-1].experience
    tokens, response = float(exp.attention_mask.sum()), float(exp.action_mask.sum())
    lengths = exp.attention_mask.sum(-1).float()
    attended = float((lengths * (lengths + 1) / 2).sum())
    scored_tokens, scored_pairs = scored_work(exp.tensors())  # prompts once per group where shared
    fwd = forward_flops(config, scored_tokens, response, scored_pairs)
    flops = {"generate": forward_flops(config, tokens, response, attended), "reference": fwd,
             "old_logprobs": fwd, "critic": fwd, "train": 3 * fwd}
    return {"step": statistics.median(sum(s.metrics.get(f"time/{p}", 0.0) for p in PHASES) for s in steps),
            "phases": phases, "flops": flops, "peak_gflops": peak, "cpu_user_s": user, "cpu_system_s": system,
            "tokens": {p: response if p == "generate" else tokens for p in PHASES if p != "sync"},
            "wall_s": wall, "params_m": sum(p.numel() for p in models.load_policy(path).parameters()) / 1e6,
            "weight_mb": sum(p.numel() * p.element_size() for p in models.load_policy(path).parameters()) / 2**20,
            "vocab": config.vocab_size, "reward": statistics.mean(s.metrics["reward/mean"] for s in steps)}


def _allocators() -> tuple[str, ...]:
    """The values of `infra.allocator` (alignflow/cluster.py). Asked in the parent only: a worker may
    import a tree from before the setting existed."""
    from typing import get_args

    from alignflow.config import InfraConfig

    return get_args(InfraConfig.model_fields["allocator"].annotation)


def infra_config(InfraConfig):
    """The variant's InfraConfig: its allocator, where it names one (a tree from before
    `infra.allocator` existed runs glibc as it comes: 'system')."""
    allocator = os.environ.get("ALIGNFLOW_BENCH_ALLOCATOR")
    if allocator is None:
        return InfraConfig()
    if "allocator" not in InfraConfig.model_fields:
        if allocator != "system":
            raise SystemExit(f"this tree has no infra.allocator; run it as 'system', not {allocator!r}")
        return InfraConfig()
    return InfraConfig(allocator=allocator)


def variant_env(spec: str) -> dict[str, str]:
    """A variant: '+'-joined an allocator (infra.allocator), NAME=VALUE environment settings and
    round.KEY=VALUE round-config settings (VALUE as JSON; KEY dotted into sections, e.g.
    round.actor.placement.cpu_cores=[1]), e.g. jemalloc+round.async_rollouts=true."""
    env, round_cfg = {}, {}
    for part in filter(None, spec.split("+")):
        if part.startswith("round.") and "=" in part:
            k, v = part[len("round."):].split("=", 1)
            round_cfg[k] = json.loads(v)
        elif "=" in part:
            k, v = part.split("=", 1)
            env[k] = v
        elif part in _allocators():
            env["ALIGNFLOW_BENCH_ALLOCATOR"] = part
        else:
            raise SystemExit(f"--variants: {part!r} is not an allocator ({', '.join(_allocators())}), "
                             "a NAME=VALUE setting nor a round.KEY=VALUE setting")
    if round_cfg:
        env["ALIGNFLOW_BENCH_ROUND"] = json.dumps(round_cfg)
    return env


def build_model(config: str | None, shape: str = "issue14") -> str:
    """The benchmark's model, built once by this tree's tiny-model factory, for every variant."""
    from alignflow.config import TinyModelConfig, load_config
    from engines import models

    out = tempfile.mkdtemp(prefix="alignflow-bench-model-")
    if config:
        return str(models.build_tiny_model(load_config(config).model.tiny, seed=0, out_dir=out))
    return str(models.build_tiny_model(TinyModelConfig(**SHAPES[shape]), seed=0, out_dir=out, corpus=word_corpus()))


def model_named(name: str) -> str:
    """A model directory: `name` itself, or built for this run: gpu-small (configs/gpu-small.yaml's 0.48B) or
    one of SHAPES, from any working directory."""
    if Path(name).is_dir():
        return name
    if name == "gpu-small":
        return build_model(str(Path(__file__).resolve().parents[2] / "configs" / "gpu-small.yaml"))
    if name not in SHAPES:
        raise SystemExit(f"--model {name}: not a directory, and not gpu-small or one of {', '.join(SHAPES)}")
    return build_model(None, name)


def model_name(args) -> str:
    """`--model`, or the device's default: gpu-small on a GPU, issue 14's shape on the CPU."""
    return args.model or ("gpu-small" if args.device == "cuda" else "issue14")


def bench_policy(args):
    """(model, its name, dtype): `args.model` (a directory, or built: model_named) on `args.device`, bf16 on a
    GPU and fp32 on the CPU."""
    from engines.models import load_policy

    shape = model_name(args)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    return load_policy(model_named(shape), dtype).to(args.device), shape, dtype


def run_variant(label: str, tree: Path, spec: str, args, script: Path) -> dict:
    # The tree first; what the environment already adds stays after it (a staged GPU machine's site, .gpu/).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    for k in ("LD_PRELOAD", "MALLOC_CONF", *(k for k in os.environ if k.startswith("MALLOC_"))):
        env.pop(k, None)
    env.update(variant_env(spec))
    cmd = [sys.executable, str(script), "--worker", "--steps", str(args.steps), "--model", args.model]
    if args.config:
        cmd += ["--config", args.config]
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        raise SystemExit(f"{label}: the run failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def report(label: str, runs: list[dict], base: float | None, peak: float) -> float:
    step = statistics.median(r["step"] for r in runs)
    med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
    sys_share = med("cpu_system_s") / max(med("cpu_user_s") + med("cpu_system_s"), 1e-9)
    ratio = f"  ({step / base:.2f}x the first)" if base else ""
    print(f"\n{label}: step {step:.2f} s{ratio}; system CPU {100 * sys_share:.1f}% of CPU time")
    for p in PHASES:
        t = statistics.median(r["phases"][p] for r in runs)
        if t < 1e-4:
            continue
        flops = runs[0]["flops"].get(p)
        # A phase that only waits (asynchronous generation) did no work of its own to rate.
        rate = f"{flops / t / 1e9:7.1f} GFLOP/s ({100 * flops / t / 1e9 / peak:4.1f}% of peak)" if flops and t > 0.01 else ""
        n = runs[0].get("tokens", {}).get(p)  # generated tokens for generate, prompt + response for the rest
        print(f"  {p:<13}{t:7.3f} s  " + (f"{n / t:9.0f} tokens/s  {rate}" if n and t > 0.01 else rate))
    sync = statistics.median(r["phases"]["sync"] for r in runs)
    if sync > 0 and "weight_mb" in runs[0]:
        print(f"  weight update {1e3 * sync:.0f} ms: {100 * sync / step:.1f}% of the step, "
              f"{runs[0]['weight_mb'] / sync:.0f} MB/s ({runs[0]['weight_mb']:.1f} MB)")
    print("  runs: " + ", ".join(f"{r['step']:.2f}" for r in runs) + " s")
    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run (after one warm-up step)")
    parser.add_argument("--runs", type=int, default=3, help="runs per variant, alternating")
    parser.add_argument("--against", default=None, help="git revision to compare with (checked out in /tmp)")
    parser.add_argument("--against-variant", default="", help="the one variant (as in --variants) it runs")
    parser.add_argument("--variants", default="glibc_retain", help="';'-separated; each '+'-joined an allocator "
                        "(infra.allocator) and NAME=VALUE settings, e.g. jemalloc+round.async_rollouts=true")
    parser.add_argument("--config", default=None, help="pipeline config: its model and first round")
    parser.add_argument("--shape", default="issue14", choices=sorted(SHAPES), help="the model (without --config): "
                        "issue 14's 4.5M-parameter one, or 30M (hidden 512, 8 layers)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)  # built once, by this tree's factory
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return
    specs = args.variants.split(";")
    for spec in [*specs, args.against_variant]:
        variant_env(spec)  # fails before any run on an unknown one
    args.model = build_model(args.config, args.shape)  # a temporary directory: removed with the trees
    with contextlib.ExitStack() as done:
        done.callback(shutil.rmtree, args.model, ignore_errors=True)
        trees = done.enter_context(compared_trees(args.against))
        script = trees[-1][1] / "bench" / "step" / "rl_step.py"  # this bench's worker, whichever tree it imports
        # A commit compared against runs as it was (its own defaults, or --against-variant); this tree every variant.
        variants = [(f"{t} [{v}]" if v else t, path, v) for t, path in trees
                    for v in (specs if path == trees[-1][1] else [args.against_variant])]
        results: dict[str, list[dict]] = {v[0]: [] for v in variants}
        for i in range(args.runs):
            for label, path, spec in variants:
                results[label].append(run_variant(label, path, spec, args, script))
                print(f"run {i + 1}/{args.runs} {label}: {results[label][-1]['step']:.2f} s", flush=True)
    work = "config " + args.config if args.config else (
        f"GRPO, {PROMPTS} prompts x {SAMPLES} samples x {NEW_TOKENS} new tokens")
    print(f"\n{work}; medians of {args.runs} runs of {args.steps} steps, variants alternating")
    first = results[variants[0][0]][0]
    peak = max(r["peak_gflops"] for runs in results.values() for r in runs)  # the best seen in any run
    print(f"model {first['params_m']:.2f}M parameters, vocabulary {first['vocab']}; fp32 matmul peak {peak:.0f} "
          "GFLOP/s (2 threads, best of all runs)")
    base = None
    for label, *_ in variants:
        step = report(label, results[label], base, peak)
        base = base or step


if __name__ == "__main__":
    main()
