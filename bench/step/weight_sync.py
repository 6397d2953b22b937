"""Benchmark: one weight update (trainer -> rollout engine) against model size, and against another commit.

    .venv/bin/python bench/step/weight_sync.py                       # this tree alone
    .venv/bin/python bench/step/weight_sync.py --against 1d48f10     # vs the object-store path, alternating

Per model size (built once by this tree's tiny-model factory, vocabulary 2048,
fp32; from ~1M to ~128M parameters): a DeepSpeed trainer (one rank, ZeRO-0)
and a vLLM rollout engine on a local Ray, joined as a round joins them
(`RoundModels.sync`, whatever that is in the tree under test). One warm-up
update (this tree: it also makes the transport group), then `--updates`
timed ones. Each variant runs in its own process with its own Ray, the
variants alternating run by run. Printed per size, medians over runs: the
update time, model bytes per second, and the peak extra resident memory of
trainer, engine and driver during an update (VmHWM after the update less
VmRSS before it, the peak reset through /proc/PID/clear_refs), with each
variant's throughput as a ratio of the first's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rl_step import word_corpus  # bench/step/rl_step.py, beside this script
from trees import compared_trees  # bench/step/trees.py

SIZES = {  # label -> tiny-model shape (vocabulary 2048, untied)
    "1M": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512),
    "8M": dict(hidden_size=256, num_layers=6, num_heads=4, num_kv_heads=2, intermediate_size=1024),
    "33M": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=2048),
    "128M": dict(hidden_size=1024, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=4096),
}


def _pid_of(actor) -> int:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))


def _reset_peak(pid: int) -> int:
    """Reset the process's peak RSS to its current RSS; that RSS, in bytes."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _status(pid, "VmRSS")


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def worker(args) -> dict:
    """One run in this process: every model size, an update timed `updates` times after a warm-up."""
    import ray

    from alignflow.cluster import ray_init_kwargs
    from alignflow.config import GenerationConfig, InfraConfig
    from engines.rl.round_models import RoundModels
    from engines.rollout.actors import start_engines
    from engines.train.group import TrainerGroup
    from engines.train.spec import EngineSpec

    ray.init(**ray_init_kwargs(InfraConfig(ray_num_cpus=4)))
    results = {}
    try:
        for label, path in json.loads(args.models).items():
            spec = EngineSpec(model_path=path, kind="causal", learning_rate=1e-5, weight_decay=0.0, warmup_steps=0,
                              total_steps=10, zero_stage=0, global_batch=1, grad_clip=1.0, seed=0, torch_threads=1)
            group = TrainerGroup(spec, num_workers=1)
            engines = start_engines(GenerationConfig(), path, count=1, seeds=[0], dtype="float32", torch_threads=1,
                                    max_model_len=64)
            models = RoundModels(actor=group, engines=engines)
            try:
                models.sync()  # warm-up (this tree: the transport group is made here)
                pids = {"trainer": _pid_of(group.workers[0]), "engine": _pid_of(engines.actors[0]),
                        "driver": os.getpid()}
                times, extra = [], {k: [] for k in pids}
                for _ in range(args.updates):
                    before = {k: _reset_peak(p) for k, p in pids.items()}
                    t0 = time.perf_counter()
                    models.sync()
                    times.append(time.perf_counter() - t0)
                    for k, p in pids.items():
                        extra[k].append(_status(p, "VmHWM") - before[k])
                results[label] = {"update_s": statistics.median(times),
                                  "extra": {k: max(v) for k, v in extra.items()}}
            finally:
                group.shutdown()
                engines.shutdown()
    finally:
        ray.shutdown()
    return results


def build_models(labels: list[str]) -> tuple[dict[str, str], dict[str, int]]:
    """Each size's model directory, and its weight bytes (what an update carries)."""
    from alignflow.config import TinyModelConfig
    from engines import models

    corpus = word_corpus()
    paths, nbytes = {}, {}
    for label in labels:
        out = tempfile.mkdtemp(prefix=f"alignflow-sync-{label}-")
        path = models.build_tiny_model(TinyModelConfig(vocab_size=2048, max_position_embeddings=128, **SIZES[label]),
                                       seed=0, out_dir=out, corpus=corpus)
        paths[label] = str(path)
        nbytes[label] = sum(v.numel() * v.element_size() for v in models.load_policy(path).state_dict().values())
    return paths, nbytes


def run_variant(label: str, tree: Path, args, script: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(script), "--worker", "--updates", str(args.updates), "--models", args.models]
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        raise SystemExit(f"{label}: the run failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--updates", type=int, default=3, help="timed updates per size and run (after a warm-up)")
    parser.add_argument("--runs", type=int, default=2, help="runs per variant, alternating")
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--against", default=None, help="git revision to compare with (checked out in /tmp)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--models", help=argparse.SUPPRESS)  # built once, by this tree's factory
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return
    labels = args.sizes.split(",")
    unknown = [x for x in labels if x not in SIZES]
    if unknown:
        raise SystemExit(f"--sizes: unknown {unknown}; known: {', '.join(SIZES)}")
    paths, nbytes = build_models(labels)
    args.models = json.dumps(paths)
    with compared_trees(args.against) as trees:
        script = trees[-1][1] / "bench" / "step" / "weight_sync.py"
        results: dict[str, list[dict]] = {t: [] for t, _ in trees}
        for i in range(args.runs):
            for label, path in trees:
                results[label].append(run_variant(label, path, args, script))
                print(f"run {i + 1}/{args.runs} {label}: done", flush=True)
    print(f"\none weight update, trainer (ZeRO-0) -> one vLLM engine; medians of {args.runs} runs x "
          f"{args.updates} updates, variants alternating; extra = peak resident memory above the start, MB")
    print(f"{'size':>6} {'MB':>7}  {'variant':<14} {'update s':>9} {'MB/s':>8} {'ratio':>6} {'ms/MB':>6}"
          f" {'trainer':>8} {'engine':>8} {'driver':>8}")
    for size in labels:
        mb = nbytes[size] / 2**20
        base = None
        for label, _ in trees:
            runs = [r[size] for r in results[label]]
            t = statistics.median(r["update_s"] for r in runs)
            rate = mb / t
            base = base or rate
            extra = {k: statistics.median(r["extra"][k] for r in runs) / 2**20 for k in ("trainer", "engine", "driver")}
            print(f"{size:>6} {mb:7.1f}  {label[:14]:<14} {t:9.3f} {rate:8.0f} {rate / base:5.2f}x {1e3 * t / mb:6.2f}"
                  f" {extra['trainer']:8.0f} {extra['engine']:8.0f} {extra['driver']:8.0f}")


if __name__ == "__main__":
    main()
