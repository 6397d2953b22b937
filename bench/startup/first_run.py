"""Benchmark: the whole first run of a pipeline (`alignflow run`, nothing cached), variants side by side.

    .venv/bin/python bench/startup/first_run.py                    # evaluation engines: one per run vs one per stage
    .venv/bin/python bench/startup/first_run.py --runs 3 --variants ';infra.allocator=system'
    .venv/bin/python bench/startup/first_run.py --config configs/tiny.yaml --variants 'seed=0;seed=1'

Each variant is a list of `key=value` overrides (space-separated; empty: the config as it is), and
each run of it is the CLI in a process of its own with a fresh storage root and MLflow database, so
every stage computes, Prefect's API and Ray included. The variants alternate run by run, their order
reversed every other round (this machine is noisy: only numbers taken side by side compare). Printed:
each run's wall time, then per variant the median wall time, its ratio to the first variant's and
each stage's median duration (a stage's duration as the CLI reports it: concurrent stages overlap),
and whether every variant printed the same comparison table (a variant that only moves work, such as
evaluation.engine_lifetime, must not change a figure).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAGE_LINE = re.compile(r"^  (\S+)\s+done\s+([\d.]+) s")


def run_once(config: str | None, overrides: list[str], workdir: Path) -> tuple[float, dict[str, float], str]:
    """(wall seconds, {stage: seconds}, the comparison table) of one `alignflow run` from scratch."""
    cmd = [str(ROOT / ".venv/bin/alignflow"), "run", *([config] if config else []), *overrides,
           f"infra.storage.root={workdir / 'artifacts'}", f"infra.mlflow_tracking_uri=sqlite:///{workdir / 'mlflow.db'}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    lines = proc.stdout.splitlines()
    stages = {m.group(1): float(m.group(2)) for m in map(STAGE_LINE.match, lines) if m}
    start = next((i for i, line in enumerate(lines) if line.startswith("policy ")), len(lines))
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("stages:")), len(lines))
    return wall, stages, "\n".join(line.rstrip() for line in lines[start:end] if line.strip())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="evaluation.engine_lifetime=stage;evaluation.engine_lifetime=run",
                   help="';'-separated variants, each space-separated key=value overrides")
    p.add_argument("--runs", type=int, default=2, help="runs of each variant")
    p.add_argument("--config", default=None, help="config file (default: the embedded tiny pipeline)")
    args = p.parse_args()
    variants = [v.split() for v in args.variants.split(";")]
    names = [" ".join(v) or "(as configured)" for v in variants]
    walls: list[list[float]] = [[] for _ in variants]
    stages: list[list[dict[str, float]]] = [[] for _ in variants]
    tables: list[set[str]] = [set() for _ in variants]
    for r in range(args.runs):
        order = list(range(len(variants)))[:: 1 if r % 2 == 0 else -1]
        for i in order:
            with tempfile.TemporaryDirectory(prefix="alignflow-bench-run-") as tmp:
                wall, per_stage, table = run_once(args.config, variants[i], Path(tmp))
            walls[i].append(wall)
            stages[i].append(per_stage)
            tables[i].add(table)
            print(f"run {r + 1}  {names[i]:50s} {wall:7.1f} s", flush=True)
    base = statistics.median(walls[0])
    print(f"\n{'variant':60s} {'median':>8s} {'ratio':>6s}")
    for i, (name, w) in enumerate(zip(names, walls)):
        print(f"{f'{i + 1}: {name}':60s} {statistics.median(w):7.1f}s {statistics.median(w) / base:6.2f}x")
    every = list(dict.fromkeys(s for runs in stages for run in runs for s in run))  # in the order they ended
    print("\nstage medians (s)  " + "".join(f"{f'variant {i + 1}':>12s}" for i in range(len(names))))
    for s in every:
        print(f"  {s:17s}" + "".join(f"{statistics.median([run.get(s, 0.0) for run in v]):12.1f}" for v in stages))
    same = len(set().union(*tables)) == 1
    print(f"\nthe same comparison table from every run: {'yes' if same else 'NO'}")
    if not same:
        for name, t in zip(names, tables):
            print(f"--- {name}\n" + "\n=====\n".join(sorted(t)))


if __name__ == "__main__":
    main()
