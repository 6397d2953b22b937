"""Benchmark: the CPU a whole first run spends, by kind of process, variants side by side.

    .venv/bin/python bench/startup/process_cpu.py --small                      # the tests' small pipeline, once
    .venv/bin/python bench/startup/process_cpu.py --small --runs 2 --variants 'evaluation.engine_lifetime=stage;'

Each run is `alignflow run` from scratch, as bench/startup/first_run.py runs it, while this process reads
/proc every 0.5 s and charges each process's CPU time since the last read to what that process was
then. A Ray worker is named by the first actor or stage task it ran: its time as `ray::IDLE` before
that (the imports of the actor's class or the stage's module) counts to it. Kinds: each actor class
(TrainWorker, ScorerActor, RolloutActor, EngineHost), `stage worker` (a worker running stage tasks),
`cli`, `prefect server` and `ray` (Ray's own processes). A process that lives less than 0.5 s
may be missed. Printed: per variant the median wall time, CPU seconds and processes of each kind,
and the ratio of each median to the first variant's. On 2 cores a run keeps both busy, so CPU
seconds are what the tests running beside each other share.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from first_run import run_once  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TICK = os.sysconf("SC_CLK_TCK")
RAY_SYSTEM = ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py", "agent", "runtime_env",
              "DashboardAgent", "RuntimeEnvAgent")


def _read(pid: str) -> tuple[float, str] | None:
    """(CPU seconds so far, command line) of a process; None once it is gone or for a kernel thread."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline") as f:
            cmd = f.read().replace("\0", " ").strip()
    except OSError:
        return None
    return ((int(fields[11]) + int(fields[12])) / TICK, cmd) if cmd else None


def kind_of(names: list[str]) -> str:
    """A process's kind from what it was named over its life (in order)."""
    for name in names:
        if name.startswith("ray::") and name != "ray::IDLE":
            what = name[5:].split(".")[0].split(":")[-1]
            if any(s in what for s in RAY_SYSTEM):
                return "ray"
            return what if what[:1].isupper() else "stage worker"
    first = names[0]
    if "alignflow" in first and " run" in first:
        return "cli"
    if "prefect" in first and "server" in first:
        return "prefect server"
    return "ray" if "ray" in first else "other"


class Sampler(threading.Thread):
    """Charges the CPU of every process that appears after it starts (and what older ones add) by kind."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.cpu: dict[str, float] = defaultdict(float)
        self.names: dict[str, list[str]] = defaultdict(list)
        self.first = {pid: r[0] for pid in os.listdir("/proc") if pid.isdigit() and (r := _read(pid))}

    def run(self) -> None:
        while not self.stop.is_set():
            for pid in filter(str.isdigit, os.listdir("/proc")):
                read = _read(pid)
                if read is None:
                    continue
                seconds, cmd = read
                self.cpu[pid] = seconds - self.first.get(pid, 0.0)
                name = cmd.split()[0] if cmd.startswith("ray::") else cmd[:200]
                if not self.names[pid] or self.names[pid][-1] != name:
                    self.names[pid].append(name)
            self.stop.wait(0.5)

    def by_kind(self) -> dict[str, tuple[float, int]]:
        """{kind: (CPU seconds, processes)}, this sampler's own process left out."""
        out: dict[str, list] = defaultdict(lambda: [0.0, 0])
        for pid, seconds in self.cpu.items():
            if int(pid) == os.getpid() or seconds <= 0:
                continue
            k = kind_of(self.names[pid])
            out[k][0] += seconds
            out[k][1] += 1
        return {k: (v[0], v[1]) for k, v in out.items()}


def measure(config: str | None, overrides: list[str]) -> tuple[float, dict[str, tuple[float, int]], str]:
    sampler = Sampler()
    sampler.start()
    with tempfile.TemporaryDirectory(prefix="alignflow-bench-") as d:
        wall, _, table = run_once(config, overrides, Path(d))
    sampler.stop.set()
    sampler.join()
    return wall, sampler.by_kind(), table


def small_overrides() -> list[str]:
    """The tests' small pipeline (tests/conftest.py SMALL_OVERRIDES, one small round)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import SMALL_OVERRIDES, rounds_override

    return [*SMALL_OVERRIDES, *rounds_override(1)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="", help="';'-separated variants, each space-separated overrides")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--config", default=None)
    p.add_argument("--small", action="store_true", help="the tests' small pipeline settings first")
    args = p.parse_args()
    base = small_overrides() if args.small else []
    variants = [v.strip() for v in args.variants.split(";")] if args.variants else [""]
    results: dict[str, list] = {v: [] for v in variants}
    for i in range(args.runs):
        for v in variants if i % 2 == 0 else list(reversed(variants)):
            wall, kinds, table = measure(args.config, [*base, *v.split()])
            total = sum(c for c, _ in kinds.values())
            print(f"run {i + 1} [{v or 'as configured'}]: {wall:.1f} s wall, {total:.1f} s CPU", flush=True)
            results[v].append((wall, kinds, table))
    first = variants[0]

    def median(v: str, key) -> float:
        return statistics.median(key(r) for r in results[v])

    kinds = sorted({k for rs in results.values() for _, ks, _ in rs for k in ks},
                   key=lambda k: -median(first, lambda r: r[1].get(k, (0.0, 0))[0]))
    rows = [("wall s", lambda r: r[0]), ("CPU s, all", lambda r: sum(c for c, _ in r[1].values()))]
    rows += [(f"CPU s, {k}", lambda r, k=k: r[1].get(k, (0.0, 0))[0]) for k in kinds]
    rows += [(f"processes, {k}", lambda r, k=k: r[1].get(k, (0.0, 0))[1]) for k in kinds]
    names = [v or "as configured" for v in variants]
    print(f"\nmedians of {args.runs} run(s) each, ratio to [{names[0]}]")
    print(f"{'':<28}" + "".join(f"{n[:30]:>32}" for n in names))
    for label, key in rows:
        base_value = median(first, key)
        cells = []
        for v in variants:
            value = median(v, key)
            ratio = f" ({value / base_value:.2f}x)" if v != first and base_value else ""
            cells.append(f"{value:.1f}{ratio}")
        print(f"{label:<28}" + "".join(f"{c:>32}" for c in cells))
    tables = {r[2] for rs in results.values() for r in rs}
    print(f"\nsame comparison table in every run: {len(tables) == 1}")


if __name__ == "__main__":
    main()
