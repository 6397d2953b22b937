"""Benchmark: what an engine process spends importing before it does any work, side by side.

    .venv/bin/python bench/imports.py              # 5 rounds
    .venv/bin/python bench/imports.py --runs 9

Each measurement is a fresh interpreter importing what a process of that kind imports: a trainer
(engines.train.worker: torch, transformers' model code, DeepSpeed's hooks, Ray) and a rollout engine
(prepare_engine_process, then vLLM). `as shipped` is the code as it is (transformers told scikit-learn
is absent, engines/lean_imports.py); `with sklearn` first imports the transformers module that pulls
scikit-learn in, which is how every process started before. Variants alternate, order reversed every
other round. Printed: per process kind and variant the median seconds, the ratio to `with sklearn`,
and whether scikit-learn ended up loaded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROCESSES = {
    "trainer": "import engines.train.worker",
    "rollout engine": "from engines.rollout.actors import prepare_engine_process; prepare_engine_process(2, None); "
                      "from vllm import LLM",
}
VARIANTS = {"with sklearn": "import transformers.generation.candidate_generator", "as shipped": ""}


def measure(prelude: str, body: str) -> tuple[float, bool]:
    """(seconds from the first import to the last, whether sklearn got imported) in a new interpreter."""
    code = (f"import sys, time, json; t = time.perf_counter()\n{prelude}\n{body}\n"
            "print(json.dumps([time.perf_counter() - t, 'sklearn' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    seconds, loaded = json.loads(out.stdout.strip().splitlines()[-1])
    return seconds, loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    times: dict[tuple[str, str], list[float]] = {}
    loaded: dict[tuple[str, str], bool] = {}
    for i in range(args.runs):
        order = list(VARIANTS) if i % 2 == 0 else list(reversed(VARIANTS))
        for kind, body in PROCESSES.items():
            for variant in order:
                s, sk = measure(VARIANTS[variant], body)
                times.setdefault((kind, variant), []).append(s)
                loaded[(kind, variant)] = sk
                print(f"round {i + 1}: {kind:15s} {variant:13s} {s:6.2f} s", flush=True)
    print(f"\n{'process':15s} {'variant':13s} {'median':>8s} {'ratio':>6s}  sklearn loaded")
    for kind in PROCESSES:
        base = statistics.median(times[(kind, "with sklearn")])
        for variant in VARIANTS:
            m = statistics.median(times[(kind, variant)])
            print(f"{kind:15s} {variant:13s} {m:7.2f}s {m / base:5.2f}x  {loaded[(kind, variant)]}")


if __name__ == "__main__":
    main()
