"""Interrupts: SIGTERM as an exception, and telling a stop from a failure.

By default SIGTERM ends a Python process on the spot: no `finally` runs, so
MLflow runs stay RUNNING and scratch directories stay behind. The CLI turns
it into `SystemExit` instead. Anything raised that is a `BaseException` but
not an `Exception` (KeyboardInterrupt, SystemExit, a cancellation, Prefect's
TerminationSignal) means the work was stopped, not that it failed.
"""

from __future__ import annotations

import signal
import threading


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
