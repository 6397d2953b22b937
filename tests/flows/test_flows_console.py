"""What the console shows: alignflow's lines, others' warnings once, no user-error tracebacks; stage lines."""

from __future__ import annotations

import logging
import os
import sys

import pytest

from alignflow.errors import DataError
from flows import console
from flows.progress import finished_line


def _record(name: str, level: int, msg: str, exc: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(exc), exc, None) if exc else None
    return logging.LogRecord(name, level, __file__, 1, msg, None, exc_info)


def test_console_shows_warnings_once_and_no_info_line():
    console.setup(verbose=True)  # fills the user-error names
    f = console.ConsoleFilter()
    assert not f.filter(_record("alignflow", logging.INFO, "learning curves (loss.png) at /a/curves"))
    assert f.filter(_record("alignflow", logging.WARNING, "marked 1 MLflow run(s) KILLED"))
    assert not f.filter(_record("alignflow", logging.WARNING, "marked 1 MLflow run(s) KILLED"))
    assert not f.filter(_record("httpx", logging.INFO, "HTTP Request: POST /api/logs"))
    assert not f.filter(_record("mlflow.store.db.utils", logging.INFO, "Creating initial MLflow database tables"))
    assert f.filter(_record("ray", logging.WARNING, "a warning"))
    assert not f.filter(_record("ray", logging.WARNING, "a warning"))
    assert f.filter(_record("ray", logging.WARNING, "another warning"))


def test_console_drops_what_a_user_error_logs_elsewhere():
    console.setup(verbose=True)
    f = console.ConsoleFilter()
    err = DataError("f.jsonl, row 2: missing key 'response'")
    assert not f.filter(_record("prefect.flow_runs", logging.ERROR, "Encountered exception during execution", err))
    assert not f.filter(_record("prefect.task_runs", logging.ERROR,
                                "Finished in state Failed('Task run encountered an exception DataError: f.jsonl')"))
    assert f.filter(_record("prefect.flow_runs", logging.ERROR, "Encountered exception", RuntimeError("worker died")))
    # An interrupt: the CLI says what it stopped, in one line.
    assert not f.filter(_record("prefect.flow_runs", logging.ERROR, "Crashed", KeyboardInterrupt()))
    for how in ("an interrupt signal", "a termination signal", "Python system exit call"):  # Ctrl-C, SIGTERM
        assert not f.filter(_record("prefect.flow_runs", logging.ERROR, f"Crash detected! Execution was aborted by {how}."))
    assert f.filter(_record("prefect.flow_runs", logging.ERROR, "Crash detected! Execution was interrupted by an "
                                                                "unexpected exception: RuntimeError"))


def test_console_records_go_where_stderr_is_when_they_are_written(monkeypatch):
    """While the progress bars are drawn, rich's Live puts a stream of its own in sys.stderr that prints above
    them: a warning written to the stderr of setup time landed in the bars' last line, erased at the next
    refresh."""
    import io

    root = logging.getLogger()
    saved = root.handlers[:]
    try:
        console.setup(verbose=True)
        live = io.StringIO()
        monkeypatch.setattr(sys, "stderr", live)
        logging.getLogger("alignflow").warning("checkpoint step 40 set aside")
        assert "checkpoint step 40 set aside" in live.getvalue()
    finally:
        root.handlers[:] = saved


def test_quiet_setup_sets_the_worker_environment(monkeypatch):
    for key in {**console.QUIET_ENV, **console.QUIET_DRIVER_ENV}:
        monkeypatch.delenv(key, raising=False)
    root = logging.getLogger()
    saved = root.handlers[:]
    try:
        console.setup(verbose=False)
        assert {k: os.environ[k] for k in console.QUIET_ENV} == console.QUIET_ENV
        assert len(root.handlers) == 1 and isinstance(root.handlers[0].filters[0], console.ConsoleFilter)
    finally:
        root.handlers[:] = saved
    from alignflow.cluster import FORWARDED_ENV

    assert set(console.QUIET_ENV) <= set(FORWARDED_ENV)


# Worker lines as a CPU run's console showed them before (2026-11-24), and lines that must stay.
CPU_ADVICE_LINES = [
    "[W1124 22:59:30.623148114 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for memory allocation "
    "on the NUMA nodes (0). Memory allocations will be strictly bound to these NUMA nodes. (function init_cpu_memory_env)",
    "Triton is installed, but doesn't include CPU backend. Disabling Triton.",
    "[2026-11-24 22:58:46,992] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU. "
    "If you have GPU or other accelerator, we were unable to detect it.",
]
KEPT_LINES = ["[W1124 22:59:30.6 ProcessGroupNCCL.cpp:1] Warning: NCCL watchdog timed out",
              "RuntimeError: Triton kernel failed", "ERROR 11-24 vllm engine died"]


def test_quiet_console_drops_cpu_build_advice_that_ray_forwards_and_keeps_the_rest():
    """Ray's own log deduplicator in a CLI-like process set up quiet: the CPU-only advice lines
    of two workers are gone, every other line arrives; `-v` keeps them all."""
    import json
    import subprocess

    code = (
        "import json, sys\n"
        "from flows import console\n"
        "console.setup(verbose=sys.argv[1] == 'v')\n"
        "from ray._private.ray_logging import stderr_deduplicator as d\n"
        "lines = json.loads(sys.argv[2])\n"
        "out = [line for pid in (1, 2) for b in d.deduplicate({'ip': 'x', 'pid': pid, 'lines': lines}) for line in b['lines']]\n"
        "print(json.dumps(out))")
    env = {k: v for k, v in os.environ.items() if k not in {**console.QUIET_ENV, **console.QUIET_DRIVER_ENV}}

    def forwarded(mode: str) -> list[str]:
        res = subprocess.run([sys.executable, "-c", code, mode, json.dumps(CPU_ADVICE_LINES + KEPT_LINES)],
                             capture_output=True, text=True, env=env, timeout=120)
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout.strip().splitlines()[-1])

    assert forwarded("quiet") == KEPT_LINES  # each kept line once: the second worker's copies are deduplicated
    assert forwarded("v") == CPU_ADVICE_LINES + KEPT_LINES


def test_a_finished_stage_line():
    run = {"stage": "sft", "status": "FINISHED", "step": 188, "total": 188, "start": 1_000, "end": 43_500,
           "metrics": {"train/loss": 0.41234, "progress/step": 188}}
    assert finished_line(run) == "  sft                done      42.5 s  188/188 steps  loss 0.412"
    failed = {**run, "stage": "round_1", "status": "FAILED", "total": 0, "metrics": {"rl/reward/mean": -1.5}}
    assert finished_line(failed) == "  round_1            FAILED    42.5 s  reward -1.500"


def test_the_data_stage_line_shows_the_token_limits_and_what_they_drop():
    run = {"stage": "data", "status": "FINISHED", "step": 0, "total": 0, "start": 0, "end": 1_200,
           "metrics": {"data/max_prompt_tokens": 24.0, "data/max_response_tokens": 2.0,
                       "data/sft_prompts_left_out": 0.0, "data/eval_prompts_left_out": 3.0,
                       "data/sft_responses_cut": 5.0, "data/preference_responses_cut": 1.0}}
    assert finished_line(run) == ("  data               done       1.2 s  prompt tokens <= 24  response tokens <= 2  "
                                  "3 prompts left out  6 responses cut")


def test_stage_runs_lists_a_parents_children_oldest_first_with_their_progress(tracker):
    import time

    parent = tracker.start_parent("progress-parent", {})
    for stage, step, total in (("sft", 10, 40), ("round_1", 0, 0)):
        with tracker.stage_run(parent, stage, {}) as run:
            if total:
                run.set_tag("alignflow.total_steps", str(total))
            run.log_metrics({"progress/step": step, "train/loss": 0.5}, step=step)
        time.sleep(0.01)  # distinct start times
    runs = tracker.stage_runs(parent)
    assert [(r["stage"], r["status"], r["step"], r["total"]) for r in runs] == [
        ("sft", "FINISHED", 10, 40), ("round_1", "FINISHED", 0, 0)]
    assert runs[0]["metrics"] == {"progress/step": 10.0, "train/loss": 0.5}
    assert tracker.stage_runs(tracker.start_parent("other-parent", {})) == []


@pytest.mark.parametrize("width", [60, 80, 100, 160])
def test_progress_bars_fit_the_terminal_with_whole_numbers(width):
    """At any width a stage's bar line fits, and what does not fit is dropped whole (the time left, the
    bar, then metrics), never cut to `0:0…`."""
    import io

    from rich.console import Console

    from flows.progress import _Bars

    bars = _Bars(console=Console(file=io.StringIO(), width=width, force_terminal=True))
    run = {"stage": "eval_reward_model", "status": "RUNNING", "step": 123, "total": 200, "start": 0, "end": None,
           "metrics": {"rl/reward/mean": -0.51234, "rl/kl": 0.01234, "train/loss": 1.25}}
    bars.update(run)
    bars.update({**run, "stage": "round_1", "status": "FAILED", "step": 7, "total": 20})
    table = bars.progress.make_tasks_table(bars.progress.tasks)  # what each refresh draws
    bars.close()
    check = Console(file=io.StringIO(), width=width, record=True)
    check.print(table)
    lines = [line for line in check.export_text().splitlines() if line.strip()]
    shown = {line.split()[0]: line for line in lines}
    assert set(shown) == {"eval_reward_model", "round_1"}, lines
    for line in lines:
        assert len(line) <= width and "…" not in line, (width, line)
    assert "123/200" in shown["eval_reward_model"] and "0:00:0" in shown["eval_reward_model"]
    assert shown["round_1"].rstrip().endswith("FAILED") and " 7/20 " in shown["round_1"], shown["round_1"]
    if width >= 100:
        assert "reward -0.512" in shown["eval_reward_model"]


def test_a_stage_that_stops_keeps_its_step_and_one_retried_is_shown_to_its_end():
    """A bar filled to its total for a stage stopped at step 7 (Ctrl-C: KILLED, or FAILED) said it was done; and
    where Prefect retried a failed stage, its run reopened and ended again, the lines printed off a terminal said
    FAILED and never its end."""
    import io

    from rich.console import Console

    from flows.progress import ProgressWatcher, _Bars

    run = {"stage": "round_1", "status": "RUNNING", "step": 3, "total": 20, "start": 0, "end": None,
           "metrics": {}}
    bars = _Bars(console=Console(file=io.StringIO(), width=120, force_terminal=True))
    [task] = (bars.update(run), bars.progress.tasks)[1]
    bars.update({**run, "status": "KILLED", "step": 7, "end": 9000})
    assert (task.completed, task.finished, task.stop_time is not None) == (7, False, True)
    bars.update({**run, "step": 8, "end": 9000})  # retried: running again, its time anew
    assert (task.completed, task.stop_time) == (8, None)
    bars.update({**run, "status": "FINISHED", "step": 20, "end": 20000})
    assert task.completed == 20 and task.finished
    bars.close()

    watcher = ProgressWatcher("sqlite:///unused.db", "x", terminal=False)
    failed = {**run, "status": "FAILED", "step": 7, "start": 0, "end": 9000}
    assert [line.split()[:2] for line in watcher.ended_lines([failed])] == [["round_1", "FAILED"]]
    assert watcher.ended_lines([failed]) == [] and watcher.ended_lines([{**failed, "status": "RUNNING"}]) == []
    done = watcher.ended_lines([{**failed, "status": "FINISHED", "step": 20, "end": 20000}])
    assert [line.split()[:2] for line in done] == [["round_1", "done"]] and "20/20 steps" in done[0]


def test_the_interrupted_line_names_each_stopped_stage_and_its_step(tracker, monkeypatch):
    from alignflow.config import load_config
    from flows import report
    from flows.cli import interrupted_line

    cfg = load_config(None, [f"infra.mlflow_tracking_uri={tracker.tracking_uri}", "infra.mlflow_experiment=alignflow-test"])
    assert interrupted_line(cfg, "run", None) == "interrupted before a stage was under way; alignflow run starts again"
    parent = tracker.start_parent("pipeline", {})
    monkeypatch.setattr(report, "_opened", [parent])
    with tracker.stage_run(parent, "data", {}):
        pass
    for stage, step in (("sft", 40), ("eval_base", 0)):
        running = tracker.stage_run(parent, stage, {})
        run = running.__enter__()
        if step:
            run.log_metrics({"progress/step": step}, step=step)
            run.set_tag("alignflow.total_steps", "100")
    tracker.stop_children(parent)  # what wait_all does on an interrupt
    assert interrupted_line(cfg, "stage", "sft") == \
        "interrupted: sft stopped at step 40 of 100, eval_base stopped; alignflow stage sft resumes them"


def test_a_deployed_runs_console_shows_a_traceback_nowhere_else_changed():
    """WithoutTraceback on the console handler: the line without its traceback; the same record, formatted
    by another handler after it (the Prefect API's), keeps it."""
    import io
    import logging

    from flows.console import WithoutTraceback

    try:
        raise RuntimeError("stage broke")
    except RuntimeError:
        record = logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1, "flow failed: %s", ("x",),
                                   sys.exc_info())
    quiet, full = io.StringIO(), io.StringIO()
    console = logging.StreamHandler(quiet)
    console.setFormatter(WithoutTraceback(logging.Formatter("%(levelname)s %(message)s")))
    api = logging.StreamHandler(full)
    api.setFormatter(logging.Formatter("%(message)s"))
    console.handle(record)
    api.handle(record)
    assert quiet.getvalue() == "ERROR flow failed: x\n"
    assert "Traceback (most recent call last)" in full.getvalue() and "RuntimeError: stage broke" in full.getvalue()


@pytest.mark.parametrize("verbose", [False, True])
def test_a_deployed_run_quiets_its_libraries_unless_asked(verbose, monkeypatch):
    import logging
    import os

    from prefect.logging.handlers import PrefectConsoleHandler

    from flows.console import QUIET_ENV, WithoutTraceback, quiet_deployed_run

    for key in QUIET_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("ALIGNFLOW_VERBOSE", "1" if verbose else "0")
    handler = PrefectConsoleHandler()
    logger = logging.getLogger("prefect.test_quiet_deployed")
    monkeypatch.setattr(logger, "handlers", [handler])
    for lg in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for h in getattr(lg, "handlers", []):
            monkeypatch.setattr(h, "formatter", h.formatter)  # this process's own, put back after
    quiet_deployed_run()
    assert (os.environ.get("TRANSFORMERS_VERBOSITY"), os.environ.get("ALIGNFLOW_QUIET")) == \
        ((None, None) if verbose else ("error", "1"))
    assert "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL" not in os.environ  # a line per stage stays on the console
    assert isinstance(handler.formatter, WithoutTraceback) is not verbose


def test_rays_start_notice_is_kept_off_the_console_without_end_through_a_handler_the_root_logger_shares():
    """quiet_ray_notices' filter sends Ray's start notice on to `alignflow.ray` (INFO: the log file) and keeps it
    off Ray's console handler. Where that handler is also the root logger's, the notice logged again reaches
    the filter again, which once logged it again without end (RecursionError inside ray.init)."""
    class Kept(logging.Handler):
        def __init__(self):
            super().__init__()
            self.records = []

        def emit(self, record):
            self.records.append(record)

    root, ray_logger = logging.getLogger(), logging.getLogger("ray")
    shared, log_file = Kept(), Kept()
    shared.addFilter(console._NoticeToLogFile())
    saved = root.level, root.handlers[:], ray_logger.handlers[:], ray_logger.propagate
    root.handlers[:], ray_logger.handlers[:], ray_logger.propagate = [shared, log_file], [shared], True
    root.setLevel(logging.INFO)
    try:
        ray_logger.warning("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled")
        ray_logger.warning("another warning")
    finally:
        root.setLevel(saved[0])
        root.handlers[:], ray_logger.handlers[:], ray_logger.propagate = saved[1], saved[2], saved[3]
    assert [r.getMessage() for r in shared.records] == ["another warning"] * 2  # Ray's handler, then root's
    noted = [r.name for r in log_file.records if "Token authentication" in r.getMessage() and r.levelname == "INFO"]
    assert noted == [console.NOTICE_LOGGER]  # once, though the notice passed the filter twice
