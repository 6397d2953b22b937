"""Interrupts: SIGTERM as an exception, telling a stop from a failure, and whether a process that
owned a run is still alive (or died without ending it).

By default SIGTERM ends a Python process on the spot: no `finally` runs, so
MLflow runs stay RUNNING and scratch directories stay behind. The CLI turns
it into `SystemExit` instead. Anything raised that is a `BaseException` but
not an `Exception` (KeyboardInterrupt, SystemExit, a cancellation, Prefect's
TerminationSignal) means the work was stopped, not that it failed.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path


def _raise_system_exit(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


def install_sigterm_handler() -> bool:
    """SIGTERM raises SystemExit(143) in the main thread; False where a handler cannot be set."""
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGTERM, _raise_system_exit)
    return True


def is_interrupt(exc: BaseException | None) -> bool:
    """True for a stop (Ctrl-C, SIGTERM, cancellation); False for an error or for no exception."""
    return exc is not None and not isinstance(exc, Exception)


def end_status(exc: BaseException | None) -> str:
    """The MLflow status of a run that ended with `exc` (None: it succeeded)."""
    if exc is None:
        return "FINISHED"
    return "KILLED" if is_interrupt(exc) else "FAILED"


def pid_alive(pid: int, since: float | None = None) -> bool:
    """Whether process `pid` on this host is alive (one of another user counts; a zombie does not).

    With `since` (epoch seconds the run started), a process that started
    later is a reused pid, not the run's owner (Linux; elsewhere not checked).
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
    except (OSError, StopIteration):
        return True
    fields = stat[stat.rindex(")") + 2:].split()
    started = boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    # btime is whole seconds: 2 s of slack before calling the pid reused.
    return fields[0] != "Z" and (since is None or started <= since + 2)
