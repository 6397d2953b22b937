"""Interrupts: SIGTERM as an exception, telling a stop from a failure, and whether a process that
owned a run is still alive (or died without ending it).

By default SIGTERM ends a Python process on the spot: no `finally` runs, so
MLflow runs stay RUNNING and scratch directories stay behind. The CLI turns
it into `SystemExit` instead. Anything raised that is a `BaseException` but
not an `Exception` (KeyboardInterrupt, SystemExit, a cancellation, Prefect's
TerminationSignal) means the work was stopped, not that it failed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path


class Terminated(SystemExit):
    """SIGTERM, as the CLI raises it: a SystemExit with status 143 (128 + 15), as a shell reports it."""


def _raise_terminated(signum: int, frame) -> None:
    raise Terminated(128 + signum)


def install_sigterm_handler() -> bool:
    """SIGTERM raises Terminated (SystemExit(143)) in the main thread; False where a handler cannot be set."""
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGTERM, _raise_terminated)
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


@contextlib.contextmanager
def sigterm_handler_kept() -> Iterator[None]:
    """Keep this thread's SIGTERM handler across the block (alignflow/cluster.py `init_ray`: Ray sets its own,
    `sys.exit(15)`, first thing). A SIGTERM that Ray's handler turned into `SystemExit(15)` inside the block is
    handed to the kept handler, so it stops the program as any other SIGTERM would (the CLI: its `interrupted:`
    line and status 143; a flow run: Prefect's cancellation)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    kept = signal.getsignal(signal.SIGTERM)
    try:
        yield
    except SystemExit as exc:
        if exc.code == signal.SIGTERM and kept not in (None, signal.SIG_IGN):
            signal.signal(signal.SIGTERM, kept)
            signal.raise_signal(signal.SIGTERM)  # the kept handler raises its own stop, chained to this one
        raise
    finally:
        if kept is not None:
            signal.signal(signal.SIGTERM, kept)


class DeferredSignals:
    """Ctrl-C and SIGTERM held back while the main thread waits in native code, then handed on between waits.

    A Python signal handler runs wherever the main thread next runs Python, and Ray's blocking calls run
    Python callbacks: an exception raised by a handler there (Prefect's `TerminationSignal`) surfaces as
    `SystemError: ... returned a result with an exception set`, not as the stop it was. Inside this
    context a signal is only recorded; `deliver()`, called by the waiting loop between short waits, puts
    the handlers back as they were and raises the first signal through them, so the stop is raised from
    the loop itself. A signal still pending on exit is delivered then. Off the main thread, where
    handlers cannot be set, it does nothing.
    """

    def __init__(self, signums: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)):
        self.signums, self.pending = signums, []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> DeferredSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in self.signums:
                handler = signal.getsignal(signum)
                if handler not in (signal.SIG_IGN, None):  # an ignored signal stays ignored
                    self._previous[signum] = signal.signal(signum, self._record)
        return self

    def _record(self, signum: int, frame) -> None:
        self.pending.append(signum)

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def deliver(self) -> None:
        """Raise the first signal received, through the handlers in place before; nothing if none came."""
        if self.pending:
            self._restore()
            signal.raise_signal(self.pending.pop(0))

    def __exit__(self, *exc) -> None:
        self._restore()
        if self.pending:  # a stop asked for while a failure was raised is still a stop
            signal.raise_signal(self.pending.pop(0))
