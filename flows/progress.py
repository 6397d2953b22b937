"""Stage progress on the console while a pipeline runs, read from MLflow.

Stages run in Ray workers, possibly on other machines; each logs its step
(`progress/step`), its total steps (tag `alignflow.total_steps`) and its
metrics to its MLflow child run. A thread in the CLI polls those runs and
shows, on a terminal, a rich progress bar per stage (step, rate, time left,
its key metric); elsewhere (CI, a pipe) one line per stage as it ends.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from alignflow.tracking import Tracker
from flows.report import opened_parent_runs

KEY_METRICS = (("train/loss", "loss"), ("rl/reward/mean", "reward"), ("rl/kl", "kl"),
               ("eval/accuracy", "accuracy"), ("eval/rm_pairwise_accuracy", "accuracy"))
TOKEN_LIMITS = (("data/max_prompt_tokens", "prompt tokens <="), ("data/max_response_tokens", "response tokens <="))


def key_metrics(metrics: dict[str, float]) -> str:
    shown = [f"{label} {metrics[k]:.3f}" for k, label in KEY_METRICS if k in metrics]
    shown += [f"{label} {metrics[k]:.0f}" for k, label in TOKEN_LIMITS if k in metrics]
    for suffix, what in (("_prompts_left_out", "prompts left out"), ("_responses_cut", "responses cut")):
        n = sum(v for k, v in metrics.items() if k.startswith("data/") and k.endswith(suffix))
        if n:
            shown.append(f"{n:.0f} {what}")
    return "  ".join(shown)


def finished_line(run: dict[str, Any]) -> str:
    """One line for a stage that ended: name, state, steps, wall time, key metrics."""
    seconds = ((run["end"] or run["start"]) - run["start"]) / 1000
    steps = f"{run['step']}/{run['total']} steps  " if run["total"] else ""
    state = {"FINISHED": "done", "FAILED": "FAILED", "KILLED": "stopped"}.get(run["status"], run["status"].lower())
    return f"  {run['stage']:<18} {state:<7} {seconds:6.1f} s  {steps}{key_metrics(run['metrics'])}".rstrip()


class ProgressWatcher:
    """Polls the pipeline run this process opened in MLflow every `interval` seconds until stopped."""

    def __init__(self, tracking_uri: str, experiment: str, interval: float = 2.0, terminal: bool | None = None):
        self.tracking_uri, self.experiment, self.interval = tracking_uri, experiment, interval
        self.terminal = _is_terminal() if terminal is None else terminal
        self.printed: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="alignflow-progress", daemon=True)

    def __enter__(self) -> ProgressWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        tracker = None
        bars = _Bars() if self.terminal else None
        try:
            while True:
                stopping = self._stop.is_set()
                try:
                    parents = opened_parent_runs()
                    if parents:  # only once the flow has opened its run: MLflow's tables exist by then
                        tracker = tracker or Tracker(self.tracking_uri, self.experiment)
                    runs = tracker.stage_runs(parents[-1]) if parents else []
                except Exception:  # a display must never fail the run (e.g. the SQLite file is busy)
                    runs = []
                for run in runs:
                    if bars is not None:
                        bars.update(run)
                    elif run["status"] != "RUNNING" and run["stage"] not in self.printed:
                        self.printed.add(run["stage"])
                        print(finished_line(run), flush=True)
                if stopping or self._stop.wait(self.interval):
                    if stopping:
                        break
        finally:
            if bars is not None:
                bars.close()


def _is_terminal() -> bool:
    import sys

    return sys.stdout.isatty() and os.environ.get("TERM") != "dumb"


class _Bars:
    def __init__(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
            TimeRemainingColumn

        self.progress = Progress(TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(),
                                 TimeRemainingColumn(), TextColumn("{task.fields[shown]}"))
        self.tasks: dict[str, Any] = {}
        self.progress.start()

    def update(self, run: dict[str, Any]) -> None:
        name = run["stage"]
        if name not in self.tasks:
            self.tasks[name] = self.progress.add_task(name, total=run["total"] or None, shown="")
        done = run["status"] != "RUNNING"
        total = run["total"] or (1 if done else None)
        self.progress.update(self.tasks[name], total=total, completed=total if done and total else run["step"],
                             shown=key_metrics(run["metrics"]) + ("" if run["status"] in ("RUNNING", "FINISHED")
                                                                  else f"  {run['status']}"))

    def close(self) -> None:
        self.progress.stop()
