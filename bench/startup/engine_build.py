"""Benchmark: building and closing a vLLM engine in a process that already has one's libraries, as the
run's evaluation host does for every evaluation (engines/rollout/host.py), variants side by side.

    .venv/bin/python bench/startup/engine_build.py                   # the tiny model, 2 processes x 4 builds each
    .venv/bin/python bench/startup/engine_build.py --rounds 3 --builds 5 --max-model-len 128

Variants, each in a process of its own (vLLM, torch and transformers imported, ~670k objects tracked):
- `before`: as before 44ee5d7: the heap not frozen for the build (so its five collections scan all of it), vLLM's
  two collections at close and none after, and the KV cache `vllm.kv_cache_gib` (1 GiB) whole;
- `3 at close`: as 44ee5d7..e82f705: frozen for the build, the KV cache at most what 256 sequences of
  max_model_len fill, and at close vLLM's two collections, then one more after the engine is dropped;
- `now`: engines/heap.py as it is: frozen for the build, and vLLM's collections at close put off to one.
The processes alternate, their order reversed every other round (this machine is noisy). Printed: per
variant the median CPU and wall seconds of a build and of a close (the first build of each process left
out: it imports vLLM's worker), the ratios of `now` to each of the others, and the KV cache each one had.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ("before", "3 at close", "now")


def child(variant: str, model: str, builds: int, max_model_len: int) -> None:
    """In a process of its own: `builds` engines built and closed; one JSON line of their times."""
    sys.path.insert(0, str(ROOT))
    import contextlib
    import gc

    from alignflow.config import VLLMConfig
    from engines.rollout import vllm_engine
    from engines.rollout.engine_build import build_engine, prepare_engine_process

    @contextlib.contextmanager
    def collected_after():  # vLLM's own collections at close, then one more
        yield
        gc.collect()

    if variant == "before":
        vllm_engine.frozen_for_build = vllm_engine.one_collection_for_close = contextlib.nullcontext
        vllm_engine.cpu_kv_cache_bytes = lambda opts, **_: int(opts.kv_cache_gib * vllm_engine.GIB)
    elif variant == "3 at close":
        vllm_engine.one_collection_for_close = collected_after
    prepare_engine_process(2, None)
    times = []
    for _ in range(builds):
        c0, t0 = time.process_time(), time.perf_counter()
        engine = build_engine("vllm", model, vllm=VLLMConfig(), max_model_len=max_model_len)
        c1, t1 = time.process_time(), time.perf_counter()
        cache = engine.llm.llm_engine.vllm_config.cache_config
        kv_tokens = cache.num_gpu_blocks * cache.block_size
        engine.close()
        del engine
        times.append({"build_cpu": c1 - c0, "build_wall": t1 - t0, "close_cpu": time.process_time() - c1,
                      "close_wall": time.perf_counter() - t1, "kv_tokens": kv_tokens})
    print("RESULT " + json.dumps({"objects": len(gc.get_objects()), "times": times}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="processes per variant")
    ap.add_argument("--builds", type=int, default=4, help="engines built and closed per process")
    ap.add_argument("--max-model-len", type=int, default=128)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.model, args.builds, args.max_model_len)

    sys.path.insert(0, str(ROOT))
    from alignflow.config import TinyModelConfig
    from engines.models import build_tiny_model

    model = str(build_tiny_model(TinyModelConfig(), seed=0, out_dir=tempfile.mkdtemp(prefix="engine-build-")))
    got: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for variant in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            proc = subprocess.run([sys.executable, __file__, "--child", variant, "--model", model, "--builds",
                                   str(args.builds), "--max-model-len", str(args.max_model_len)],
                                  capture_output=True, text=True, env={**_env(), "VLLM_LOGGING_LEVEL": "ERROR"})
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                sys.exit(f"{variant} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
            result = json.loads(line.removeprefix("RESULT "))
            got[variant] += result["times"][1:]
            print(f"round {r + 1} {variant:10s}: {result['objects']} objects tracked; builds (CPU s) "
                  + " ".join(f"{t['build_cpu']:.2f}" for t in result["times"]), flush=True)

    def med(variant: str, key: str) -> float:
        return statistics.median(t[key] for t in got[variant])

    print(f"\nmedian of {len(got['now'])} builds per variant (a process's first left out), 2 torch threads")
    print(f"| {'':10s} | build CPU | build wall | close CPU | close wall | build+close CPU | KV cache (tokens) |")
    print("|---|---|---|---|---|---|---|")
    for v in VARIANTS:
        total = med(v, "build_cpu") + med(v, "close_cpu")
        print(f"| {v:10s} | {med(v, 'build_cpu'):.2f} s | {med(v, 'build_wall'):.2f} s | {med(v, 'close_cpu'):.2f} s"
              f" | {med(v, 'close_wall'):.2f} s | {total:.2f} s | {int(med(v, 'kv_tokens')):,} |")
    for base in VARIANTS[:-1]:
        ratio = {k: med("now", k) / med(base, k) for k in ("build_cpu", "close_cpu", "close_wall")}
        both = (med("now", "build_cpu") + med("now", "close_cpu")) / (med(base, "build_cpu") + med(base, "close_cpu"))
        print(f"now / {base}: build CPU {ratio['build_cpu']:.2f}x, close CPU {ratio['close_cpu']:.2f}x, "
              f"close wall {ratio['close_wall']:.2f}x, build+close CPU {both:.2f}x")


def _env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the config decides, as in a run
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_NUM_OF_RESERVED_CPU="0", TORCH_COMPILE_DISABLE="1")
    return env


if __name__ == "__main__":
    main()
