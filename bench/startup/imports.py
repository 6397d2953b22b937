"""Benchmark: what an engine process spends importing before it does any work, side by side.

    .venv/bin/python bench/startup/imports.py              # 5 rounds
    .venv/bin/python bench/startup/imports.py --runs 9

Each measurement is a fresh interpreter importing what a process of that kind imports: a trainer
(engines.train.worker: torch, transformers' model code, Ray), a trainer rank set up (that, then DeepSpeed
as TrainWorker.setup loads it) and a rollout engine (prepare_engine_process, then vLLM as RolloutActor
loads it). `as shipped` is the code as it is (engines/lean_imports.py: transformers told scikit-learn
and scipy are absent, vLLM loaded without scipy and OpenCV, DeepSpeed without MLflow). The other
variants first import what a process loaded before: `with sklearn` the transformers module that pulls
scikit-learn (and scipy) in, `with mlflow` MLflow, which DeepSpeed's autotuner imported, and `with scipy`
what transformers' detection loss and vLLM's audio and video code imported. Variants alternate, order
reversed every other round. Printed: per process kind and variant the median seconds, the ratio to
`as shipped`, and which of scikit-learn, scipy, OpenCV and MLflow ended up loaded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_RANK = "import engines.train.worker as w; w.import_deepspeed()"
_ENGINE = ("from engines.rollout.engine_build import prepare_engine_process; prepare_engine_process(2, None); "
           "from engines.lean_imports import import_vllm; import_vllm()")
_SKLEARN = "import transformers.generation.candidate_generator"
LOADED = ("sklearn", "scipy", "cv2", "mlflow")
PROCESSES = {  # kind: (what it imports, {variant: what is imported first})
    "trainer": ("import engines.train.worker",
                {"with sklearn": _SKLEARN, "with scipy": "import scipy.optimize", "as shipped": ""}),
    "trainer rank": (_RANK, {"with mlflow": "import mlflow", "with scipy": "import scipy.optimize",
                             "as shipped": ""}),
    "rollout engine": (_ENGINE, {"with sklearn": f"{_SKLEARN}; import scipy.signal, cv2",
                                 "with scipy": "import scipy.optimize, scipy.signal, cv2", "as shipped": ""}),
}


def measure(prelude: str, body: str) -> tuple[float, str]:
    """(seconds from the first import to the last, which of LOADED got imported) in a new interpreter."""
    code = (f"import sys, time, json; t = time.perf_counter()\n{prelude}\n{body}\n"
            f"print(json.dumps([time.perf_counter() - t, [m for m in {LOADED} if sys.modules.get(m)]]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    seconds, loaded = json.loads(out.stdout.strip().splitlines()[-1])
    return seconds, " ".join(loaded) or "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    times: dict[tuple[str, str], list[float]] = {}
    loaded: dict[tuple[str, str], str] = {}
    for i in range(args.runs):
        for kind, (body, variants) in PROCESSES.items():
            order = list(variants) if i % 2 == 0 else list(reversed(variants))
            for variant in order:
                s, what = measure(variants[variant], body)
                times.setdefault((kind, variant), []).append(s)
                loaded[(kind, variant)] = what
                print(f"round {i + 1}: {kind:15s} {variant:13s} {s:6.2f} s", flush=True)
    print(f"\n{'process':15s} {'variant':13s} {'median':>8s} {'ratio':>6s}  loaded")
    for kind, (_, variants) in PROCESSES.items():
        base = statistics.median(times[(kind, "as shipped")])
        for variant in variants:
            m = statistics.median(times[(kind, variant)])
            print(f"{kind:15s} {variant:13s} {m:7.2f}s {m / base:5.2f}x  {loaded[(kind, variant)]}")


if __name__ == "__main__":
    main()
