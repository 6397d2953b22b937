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

from alignflow.tracking.runs import Tracker
from flows.report import opened_parent_runs

KEY_METRICS = (("train/loss", "loss"), ("rl/reward/mean", "reward"), ("rl/kl", "kl"),
               ("eval/accuracy", "accuracy"), ("eval/rm_pairwise_accuracy", "accuracy"),
               ("eval/judge_verdict_accuracy", "verdict accuracy"))
TOKEN_LIMITS = (("data/max_prompt_tokens", "prompt tokens <="), ("data/max_response_tokens", "response tokens <="))


def key_metrics(metrics: dict[str, float], width: int | None = None) -> str:
    """The stage's key metrics, as many whole ones as fit in `width` characters (all without one)."""
    shown = [f"{label} {metrics[k]:.3f}" for k, label in KEY_METRICS if k in metrics]
    shown += [f"{label} {metrics[k]:.0f}" for k, label in TOKEN_LIMITS if k in metrics]
    for suffix, what in (("_prompts_left_out", "prompts left out"), ("_responses_cut", "responses cut")):
        n = sum(v for k, v in metrics.items() if k.startswith("data/") and k.endswith(suffix))
        if n:
            shown.append(f"{n:.0f} {what}")
    if width is not None:
        while shown and len("  ".join(shown)) > width:
            shown.pop()
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
        self.printed: dict[str, Any] = {}  # stage -> the end time of its run whose line was printed
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
                if bars is not None:
                    for run in runs:
                        bars.update(run)
                else:
                    for line in self.ended_lines(runs):
                        print(line, flush=True)
                if stopping or self._stop.wait(self.interval):
                    if stopping:
                        break
        finally:
            if bars is not None:
                bars.close()


    def ended_lines(self, runs: list[dict[str, Any]]) -> list[str]:
        """A line for each stage run that ended since the last call. A stage that failed and ran again
        (Prefect's retry reopens its run, which keeps its old end time while it runs) gets a line each time it
        ends: its retry's outcome was never printed after its FAILED line."""
        lines = []
        for run in runs:
            if run["status"] != "RUNNING" and self.printed.get(run["stage"], -1) != run["end"]:
                self.printed[run["stage"]] = run["end"]
                lines.append(finished_line(run))
        return lines


def _is_terminal() -> bool:
    import sys

    return sys.stdout.isatty() and os.environ.get("TERM") != "dumb"


NAME_WIDTH = 18


class _Bars:
    """A rich progress bar per stage that fits the terminal: on a narrow one it drops the time left, then
    shortens the bar, then drops it, and shows as many whole key metrics as the rest of the line holds
    (never a number cut to `0:0…`)."""

    def __init__(self, console: Any = None) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
            TimeRemainingColumn

        console = console or Console()
        width = console.width
        columns: list[Any] = [TextColumn(f"{{task.description:<{NAME_WIDTH}}}")]
        used = NAME_WIDTH + 9 + 7  # name, "188/188" (up to 9), elapsed "0:00:42"
        bar = 40 if width >= 120 else 20 if width >= 90 else 10 if width >= 70 else 0
        if bar:
            columns.append(BarColumn(bar_width=bar))
            used += bar
        columns += [MofNCompleteColumn(), TimeElapsedColumn()]
        if width >= 120:
            columns.append(TimeRemainingColumn())
            used += 7
        columns.append(TextColumn("{task.fields[shown]}"))
        self.room = max(width - used - len(columns), 0)  # a space between columns
        self.progress = Progress(*columns, console=console)
        self.tasks: dict[str, Any] = {}
        self.status: dict[str, str] = {}
        self.progress.start()

    def update(self, run: dict[str, Any]) -> None:
        """A FINISHED stage's bar is full; a FAILED or KILLED one stops at its step, its time frozen; one that runs
        again (Prefect's retry reopens its run) starts its time anew."""
        name, status = run["stage"], run["status"]
        if name not in self.tasks:
            self.tasks[name] = self.progress.add_task(name, total=run["total"] or None, shown="")
        task, before = self.tasks[name], self.status.get(name)
        finished = status == "FINISHED"
        total = run["total"] or (1 if finished else None)
        completed = total if finished and total else run["step"]
        if status == "RUNNING" and before in ("FAILED", "KILLED"):
            self.progress.reset(task, total=total, completed=completed)
            # rich's reset keeps a stopped task's stop time, before its new start: its elapsed would be negative
            next(t for t in self.progress.tasks if t.id == task).stop_time = None
        self.progress.update(task, total=total, completed=completed, shown=self.shown(run))
        if status in ("FAILED", "KILLED") and before != status:
            self.progress.stop_task(task)
        self.status[name] = status

    def shown(self, run: dict[str, Any]) -> str:
        status = "" if run["status"] in ("RUNNING", "FINISHED") else run["status"]
        metrics = key_metrics(run["metrics"], self.room - (len(status) + 2 if status else 0))
        return "  ".join(x for x in (metrics, status) if x)

    def close(self) -> None:
        self.progress.stop()
