"""Trainer ranks kept warm: a process that builds one training engine after another reuses the ranks' processes.

A rank's process spends about 10 s of CPU starting (torch, transformers and DeepSpeed imported) against about
1 s setting up an engine in it (a tiny model, on a 2-core AMD EPYC; tests/engines/train/test_train_warm.py
prints how long a group of two ranks takes to start either way: 15.1 s and 0.1 s there). Inside `keep_warm()`, a `TrainerGroup` (engines/train/group.py) that ends cleanly resets its ranks
(`TrainWorker.reset`: the DeepSpeed engine destroyed and its model verified freed) and leaves them idle, with
their placement group; the next group of the same shape (ranks, CPUs, GPUs, resources, threads, cores) takes
them and sets its own engine up in them. Their torch.distributed group is the one they made at their start.

What is not kept: a group placed by its caller (a colocated round's shared bundles), a group one of whose
calls raised, and ranks whose reset failed or left their model alive; those end as they do outside. Idle
ranks hold their Ray resources, so a group that finds none of its shape first ends every idle rank, and
leaving `keep_warm()` ends them all. Anything else that asks Ray for resources meanwhile (a rollout engine,
another process's stage) may wait for them: keep it to a driver that builds the engines one after another
(a test module, a sweep, a notebook). `Counts` says what was started, reused and ended.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

RESET_TIMEOUT_S = 120.0  # a rank still busy (a collective waiting for a peer that failed) is ended instead


@dataclasses.dataclass
class Counts:
    started: int = 0  # ranks started by a group that found none idle of its shape
    reused: int = 0  # ranks a group took idle
    kept: int = 0  # ranks reset and left idle when their group ended
    ended: int = 0  # idle ranks ended: for a group of another shape, or as keep_warm() closed
    not_kept: int = 0  # ranks of a group that ended cleanly whose reset failed or left the model alive


@dataclasses.dataclass
class Idle:
    workers: list  # the ranks' actor handles, rank order
    placement_group: Any  # theirs, or None (one rank, or nothing to reserve)
    master: Any  # rank 0's rendezvous address (setup's argument; the group already exists)


class WarmTrainers:
    """Idle ranks by shape (`shape(...)`), at most one group of each."""

    def __init__(self):
        self.idle: dict[tuple, Idle] = {}
        self.counts = Counts()
        self._lock = threading.Lock()

    def take(self, key: tuple, size: int) -> Idle | None:
        """The idle group of shape `key`, or None, having ended every idle group (theirs are resources
        the new group may need)."""
        with self._lock:
            found = self.idle.pop(key, None)
            others, self.idle = list(self.idle.values()), {}
            if found is not None:
                self.counts.reused += size
            else:
                self.counts.started += size
        for idle in others:
            self._end(idle)
        return found

    def give(self, key: tuple, idle: Idle) -> bool:
        """Reset the ranks and keep them idle; False (the caller ends them) where a reset failed or did not
        free its model. A group already idle in that shape is ended for them."""
        import ray

        try:
            released = ray.get([w.reset.remote() for w in idle.workers], timeout=RESET_TIMEOUT_S)
        except Exception:  # a dead rank, a reset that raised or did not return: the caller kills them
            released = [False]
        if not all(released):
            with self._lock:
                self.counts.not_kept += len(idle.workers)
            return False
        with self._lock:
            previous = self.idle.pop(key, None)
            self.idle[key] = idle
            self.counts.kept += len(idle.workers)
        if previous is not None:
            self._end(previous)
        return True

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside, groups start and end their ranks as outside `keep_warm()` (the idle ones ended first)."""
        global _active
        self.close()
        _active = None
        try:
            yield
        finally:
            _active = self

    def close(self) -> None:
        with self._lock:
            others, self.idle = list(self.idle.values()), {}
        for idle in others:
            self._end(idle)

    def _end(self, idle: Idle) -> None:
        import ray

        for w in idle.workers:
            ray.kill(w)
        if idle.placement_group is not None:
            ray.util.remove_placement_group(idle.placement_group)
        with self._lock:
            self.counts.ended += len(idle.workers)


def shape(num_workers: int, options: dict[str, Any], torch_threads: int, cpu_cores: tuple[int, ...] | None) -> tuple:
    """A group's shape: what its ranks were started with (TrainerGroup's own placement, not a caller's)."""
    resources = tuple(sorted((options.get("resources") or {}).items()))
    return (num_workers, options.get("num_cpus"), options.get("num_gpus"), resources, torch_threads,
            tuple(cpu_cores) if cpu_cores is not None else None)


_active: WarmTrainers | None = None


def active() -> WarmTrainers | None:
    """The pool of the `keep_warm()` this process is in, or None."""
    return _active


@contextlib.contextmanager
def keep_warm() -> Iterator[WarmTrainers]:
    """Trainer groups ended inside leave their ranks for the next of their shape (module docstring); every idle
    rank ends on the way out. Not nested."""
    global _active
    if _active is not None:
        raise RuntimeError("keep_warm() is already active in this process")
    _active = pool = WarmTrainers()
    try:
        yield pool
    finally:
        _active = None
        pool.close()
