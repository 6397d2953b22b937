"""Stops (Ctrl-C, SIGTERM) while the CLI's main thread waits on its stages: held back during a wait, raised
between waits through the handlers that were in place; SIGTERM's handler kept across `ray.init`-like calls."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import sys
import threading

import pytest

from alignflow.interrupts import DeferredSignals, Terminated, install_sigterm_handler, sigterm_handler_kept

pytestmark = pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                                reason="signal handlers can only be set in the main thread")


class Stop(BaseException):
    pass


@pytest.fixture
def raising_sigterm():
    """SIGTERM raises Stop (as Prefect's handler raises TerminationSignal) for the test, and Ctrl-C is Python's
    KeyboardInterrupt even where pytest was started with SIGINT ignored (`pytest ... &` from a shell without job
    control): DeferredSignals rightly leaves an ignored SIGINT alone, and the first test below then failed."""
    def handler(signum, frame):
        raise Stop(signum)

    saved = signal.signal(signal.SIGTERM, handler)
    saved_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield handler
    signal.signal(signal.SIGTERM, saved)
    if saved_int is not None:  # None: a handler set outside Python, which Python cannot put back
        signal.signal(signal.SIGINT, saved_int)


def test_a_signal_is_held_until_delivered_then_raised_through_the_handler_it_had(raising_sigterm):
    before_int = signal.getsignal(signal.SIGINT)
    with DeferredSignals() as signals:
        assert signal.getsignal(signal.SIGTERM) is not raising_sigterm
        signal.raise_signal(signal.SIGTERM)  # recorded, not raised
        signal.raise_signal(signal.SIGINT)
        assert signals.pending == [signal.SIGTERM, signal.SIGINT]
        with pytest.raises(Stop) as stopped:
            signals.deliver()
        assert stopped.value.args == (signal.SIGTERM,)
        # Delivery puts every handler back: a later signal is the old handlers' at once.
        assert signal.getsignal(signal.SIGTERM) is raising_sigterm
        assert signal.getsignal(signal.SIGINT) is before_int
        signals.pending.clear()
    assert signal.getsignal(signal.SIGTERM) is raising_sigterm


def test_nothing_received_nothing_raised_and_the_handlers_come_back(raising_sigterm):
    with DeferredSignals() as signals:
        signals.deliver()
    assert signals.pending == []
    assert signal.getsignal(signal.SIGTERM) is raising_sigterm


def test_a_signal_still_held_at_the_end_is_raised_there_even_over_a_failure(raising_sigterm):
    with pytest.raises(Stop):
        with DeferredSignals():
            os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(Stop) as stopped:
        with DeferredSignals():
            signal.raise_signal(signal.SIGTERM)
            raise RuntimeError("a stage failed while the stop came")
    assert isinstance(stopped.value.__context__, RuntimeError)


def test_an_ignored_signal_stays_ignored(raising_sigterm):
    saved = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job's Ctrl-C
    try:
        with DeferredSignals() as signals:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            signal.raise_signal(signal.SIGINT)
            assert signals.pending == []
    finally:
        signal.signal(signal.SIGINT, saved)


def test_off_the_main_thread_it_sets_nothing(raising_sigterm):
    seen = {}

    def run():
        with DeferredSignals() as signals:
            seen["handler"] = signal.getsignal(signal.SIGTERM)
            seen["pending"] = signals.pending

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert seen == {"handler": raising_sigterm, "pending": []}


def test_the_sigterm_handler_is_kept_across_a_call_that_replaces_it(raising_sigterm):
    with sigterm_handler_kept():
        signal.signal(signal.SIGTERM, lambda signum, frame: None)  # what ray.init does
    assert signal.getsignal(signal.SIGTERM) is raising_sigterm


def test_a_sigterm_the_replacing_handler_made_an_exit_goes_to_the_kept_handler(raising_sigterm):
    """Ray's handler (set first thing in ray.init) makes a SIGTERM `sys.exit(15)`; it reaches the program as its
    own handler's stop. Another exit, or one under an ignored SIGTERM, is left as it was."""
    def rays(signum, frame):
        sys.exit(signum)

    with pytest.raises(Stop) as stopped:
        with sigterm_handler_kept():
            signal.signal(signal.SIGTERM, rays)
            signal.raise_signal(signal.SIGTERM)
    assert stopped.value.args == (signal.SIGTERM,) and isinstance(stopped.value.__context__, SystemExit)
    assert signal.getsignal(signal.SIGTERM) is raising_sigterm
    with pytest.raises(SystemExit) as other:
        with sigterm_handler_kept():
            sys.exit(3)
    assert other.value.code == 3
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with pytest.raises(SystemExit) as ignored:
        with sigterm_handler_kept():
            signal.signal(signal.SIGTERM, rays)
            signal.raise_signal(signal.SIGTERM)
    assert ignored.value.code == signal.SIGTERM and signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


def test_the_cli_handler_raises_terminated_with_status_143(raising_sigterm):
    assert install_sigterm_handler()
    with pytest.raises(Terminated) as stopped:
        signal.raise_signal(signal.SIGTERM)
    assert stopped.value.code == 143 and isinstance(stopped.value, SystemExit)


class _Running:
    """A stage future of a thread-pool task runner (Prefect's wraps a concurrent.futures.Future)."""

    def __init__(self):
        self.wrapped_future = concurrent.futures.Future()
        self.waited = 0

    def wait(self, timeout=None):
        self.waited += 1
        self.wrapped_future.result(timeout)

    def result(self):
        return self.wrapped_future.result()


def test_a_sigterm_while_stages_run_ends_the_wait_and_the_runs_killed(tracker, raising_sigterm):
    from alignflow.config import InfraConfig
    from flows.report import wait_all
    from tasks.context import RunContext

    parent = tracker.start_parent("pipeline", {})
    infra = InfraConfig(mlflow_tracking_uri=tracker.tracking_uri, mlflow_experiment="alignflow-test")
    done, running = _Running(), _Running()
    done.wrapped_future.set_result("ok")
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    with pytest.raises(Stop):
        wait_all(RunContext(infra=infra, parent_run_id=parent), {"sft": done, "round_1": running})
    assert done.waited == 1 and running.waited == 0  # the running one was only polled, never blocked on
    assert tracker._client.get_run(parent).info.status == "KILLED"
    assert signal.getsignal(signal.SIGTERM) is raising_sigterm


def test_a_stage_that_fails_after_its_pipeline_was_stopped_stays_killed(tracker):
    parent = tracker.start_parent("pipeline", {})
    with pytest.raises(RuntimeError):
        with tracker.stage_run(parent, "eval_round_1", {}) as run:
            tracker.stop_children(parent)  # the pipeline's stop, before the stage fails for it
            raise RuntimeError("its engine host is gone")
    with pytest.raises(RuntimeError):
        with tracker.stage_run(parent, "eval_sft", {}) as failed:
            raise RuntimeError("a failure of its own")
    client = tracker._client
    assert [client.get_run(r.run_id).info.status for r in (run, failed)] == ["KILLED", "FAILED"]


def test_a_runs_scratch_directory_goes_however_the_run_ends(monkeypatch, tmp_path):
    """The CLI's runs and deployed flows alike: the stages write under one directory (ALIGNFLOW_SCRATCH, which the
    run's Ray forwards to its workers), removed on success, error or stop, with what a killed stage left in it;
    a run inside one (the CLI's flow) keeps the CLI's."""
    from pathlib import Path

    from alignflow.cluster import SCRATCH_ENV, run_scratch, scratch_dir

    monkeypatch.delenv(SCRATCH_ENV, raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    for stop in (None, RuntimeError("a stage failed"), KeyboardInterrupt()):
        try:
            with run_scratch() as scratch:
                assert scratch_dir() == scratch == os.environ[SCRATCH_ENV] and scratch.startswith(str(tmp_path))
                (Path(scratch) / "alignflow-base_model-x").mkdir()  # a killed stage's files
                with run_scratch() as inner:
                    assert inner == scratch  # the CLI's, around its flow
                if stop is not None:
                    raise stop
        except (RuntimeError, KeyboardInterrupt):
            pass
        assert not Path(scratch).exists() and SCRATCH_ENV not in os.environ and scratch_dir() is None
