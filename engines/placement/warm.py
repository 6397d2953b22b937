"""Actors kept warm: a process that starts one engine after another reuses their processes.

A trainer rank's process spends about 10 s of CPU starting (torch, transformers and DeepSpeed imported)
against about 1 s setting up an engine in it (a tiny model, on a 2-core AMD EPYC;
tests/engines/placement/test_placement_warm.py prints how long a group of two ranks takes to start either way: 15.1 s
and 0.1 s there); a vLLM rollout engine's, about 17 s of imports against a few seconds to build the engine.
Inside `keep_warm()`, an actor that ends cleanly is reset and left idle, and the next start of its kind that
matches takes it instead of a new process:

- trainer ranks (engines/train/group.py): a `TrainerGroup` of the same shape (ranks, CPUs, GPUs, resources,
  threads, cores) takes them, with their placement group and torch.distributed group, and sets its own
  engine up in them (`TrainWorker.reset` destroys the last one and checks its model was freed);
- rollout engines (engines/rollout/actors.py) and scorers (engines/rl/scoring.py) started with the same
  arguments: `RolloutActor.reset` builds its engine again from them (the weights and sampling seed it
  started with); a scorer holds frozen models only, and is taken as it is.

A run's stage worker (tasks/runner.py) keeps trainer ranks and scorers that hold no GPU the same way from one
stage to the next (`between_stages`): SFT's ranks train the reward model, those the actor of a round, and a
round's actor, critic and scorer serve the next round, where placements match. There nothing closes the pool: an
actor idle for `infra.keep_warm_s` seconds is ended, so what it holds goes to whatever else waits for it (a stage
in another worker). Not kept there:
- rollout engines: one is reset by building its engine again, for a start with its own model, which a run's next
  stage never has;
- actors that hold GPUs: an idle one would hold its GPU from every stage that starts something it does not take
  (an engine, a colocated round's bundles) until its idle time ran out, at every stage change of a one-GPU run;
  an idle scorer's models would sit in the memory a fractional-GPU engine sizes its cache by; and an offloading
  rank's pinned host memory outlives its reset.

What is not kept: actors placed by their caller (a colocated round's bundles, a tensor-parallel engine's
group), an actor whose calls failed where that may have left it mid-transfer (`taint`), and one whose reset
failed or left its model alive; those end as outside. Idle actors hold their Ray resources, so a start that
finds none to take first ends the idle ones of its kind, and leaving `keep_warm()` ends them all. Anything
else that asks Ray for resources meanwhile may wait for them: keep it to a driver that starts its engines one
after another (a test module, a sweep, a notebook). `Counts` says how many processes were started, reused
and ended.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("alignflow")

RESET_TIMEOUT_S = 120.0  # an actor still busy (a collective waiting for a peer that failed) is ended instead
ANSWER_TIMEOUT_S = 10.0  # an idle actor runs nothing: one round trip, unless its node is gone


def _answer(actors: list) -> bool:
    """Whether every actor answers a call (Ray's own no-op): an idle one that died raises at once."""
    import ray

    try:
        ray.get([a.__ray_ready__.remote() for a in actors], timeout=ANSWER_TIMEOUT_S)
        return True
    except Exception:  # noqa: BLE001  (RayActorError, a timeout: not an actor to hand on)
        return False


@dataclasses.dataclass
class Counts:
    started: int = 0  # processes started by a start that found none idle to take
    reused: int = 0  # idle processes taken
    kept: int = 0  # processes reset and left idle as their owner ended
    ended: int = 0  # idle processes ended: for a start of their kind, or as keep_warm() closed
    not_kept: int = 0  # processes of a clean end whose reset failed or left the model alive


@dataclasses.dataclass
class Idle:
    actors: list  # handles (a trainer's ranks in rank order)
    placement_group: Any = None  # theirs, or None
    master: Any = None  # a trainer's rank 0 rendezvous address (setup's argument; its group exists already)
    since: float = 0.0  # time.monotonic() as it was left idle


class WarmActors:
    """Idle actors by key (its first item the kind: "trainer", "rollout", "scorer"): the groups left under each,
    oldest first (a round's actor and critic of one shape are two).

    `kinds`: the kinds kept (None: all); `gpus`: whether actors that hold GPUs are; `idle_s`: where set, an actor
    idle that long is ended (a thread looks every second or so), as none may close the pool."""

    def __init__(self, *, kinds: frozenset[str] | None = None, gpus: bool = True, idle_s: float | None = None):
        self.idle: dict[tuple, list[Idle]] = {}
        self.counts = Counts()
        self.kinds, self.gpus, self.idle_s = kinds, gpus, idle_s
        self._owned: dict[Any, tuple] = {}  # single actors `start` made or took, by handle: their keys
        self._lock = threading.Lock()
        self._stop = threading.Event()  # set as the pool is dropped: its idle-ending thread returns
        if idle_s is not None:
            threading.Thread(target=self._end_idle_forever, name="alignflow-warm-idle", daemon=True).start()

    def keeps(self, kind: str, gpus: float) -> bool:
        return (self.kinds is None or kind in self.kinds) and (self.gpus or not gpus)

    def end_idle_since(self, moment: float) -> int:
        """End the groups left idle at or before `moment` (time.monotonic()); how many actors ended."""
        with self._lock:
            ending = [idle for groups in self.idle.values() for idle in groups if idle.since <= moment]
            self.idle = {k: kept for k, groups in self.idle.items()
                         if (kept := [idle for idle in groups if idle.since > moment])}
        for idle in ending:
            self._end(idle)
        return sum(len(idle.actors) for idle in ending)

    def _end_idle_forever(self) -> None:
        while not self._stop.wait(min(1.0, self.idle_s / 4)):
            try:
                if ended := self.end_idle_since(time.monotonic() - self.idle_s):
                    log.debug("ended %d actor(s) idle for %.0f s", ended, self.idle_s)
            except Exception as err:  # noqa: BLE001  (Ray shut down under the thread: the process is ending)
                log.debug("could not end idle actors: %s", err)

    def take(self, key: tuple, size: int) -> Idle | None:
        """An idle group of `key` (the last one left) whose actors all answer, or None, having ended the idle ones
        of its kind (theirs may be the resources the new one needs). A group with an actor that died idle (its
        node lost, Ray's memory monitor) is ended, not handed on to fail its taker's start."""
        while True:
            with self._lock:
                groups = self.idle.get(key)
                if not groups:
                    break
                found = groups.pop()  # the latest: the others may reach their idle_s first
                if not groups:
                    del self.idle[key]
            if _answer(found.actors):
                with self._lock:
                    self.counts.reused += size
                return found
            log.warning("an idle %s of %d process(es) had died; it is ended, and another taken or started",
                        key[0], len(found.actors))
            self._end(found)
        with self._lock:
            self.counts.started += size
            others = [k for k in self.idle if k[0] == key[0]]
            ending = [idle for k in others for idle in self.idle.pop(k)]
        for idle in ending:
            self._end(idle)
        return None

    def give(self, key: tuple, idle: Idle) -> bool:
        """Reset the actors and keep them idle; False (the caller ends them) where a reset failed or did not
        free its model."""
        import ray

        try:
            released = ray.get([a.reset.remote() for a in idle.actors], timeout=RESET_TIMEOUT_S)
        except Exception:  # a dead actor, a reset that raised or did not return: the caller kills them
            released = [False]
        with self._lock:
            if not all(released):
                self.counts.not_kept += len(idle.actors)
                return False
            idle.since = time.monotonic()
            self.idle.setdefault(key, []).append(idle)
            self.counts.kept += len(idle.actors)
        return True

    def own(self, actor: Any, key: tuple) -> None:
        """Remember a single actor `start` made or took, for `end` to keep under `key`."""
        with self._lock:
            self._owned[actor] = key

    def disown(self, actor: Any) -> tuple | None:
        """The key `own` remembered for `actor` (forgotten now), or None for an actor it never saw."""
        with self._lock:
            return self._owned.pop(actor, None)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside, actors start and end as outside `keep_warm()` (the idle ones ended first)."""
        global _active
        self.close()
        _active = None
        try:
            yield
        finally:
            _active = self

    def close(self) -> None:
        with self._lock:
            ending, self.idle = [idle for groups in self.idle.values() for idle in groups], {}
        for idle in ending:
            self._end(idle)

    def _end(self, idle: Idle) -> None:
        import ray

        for a in idle.actors:
            ray.kill(a)
        if idle.placement_group is not None:
            ray.util.remove_placement_group(idle.placement_group)
        with self._lock:
            self.counts.ended += len(idle.actors)


def trainer_shape(num_workers: int, options: dict[str, Any], torch_threads: int,
                  cpu_cores: tuple[int, ...] | None) -> tuple:
    """A trainer group's key: what its ranks were started with (TrainerGroup's own placement, not a caller's);
    its item 3 the GPUs of each rank."""
    resources = tuple(sorted((options.get("resources") or {}).items()))
    return ("trainer", num_workers, options.get("num_cpus"), options.get("num_gpus"), resources, torch_threads,
            tuple(cpu_cores) if cpu_cores is not None else None)


def _pool(kind: str, gpus: float) -> WarmActors | None:
    """The pool active now, where it keeps actors of `kind` holding `gpus` each."""
    pool = _active
    return pool if pool is not None and pool.keeps(kind, gpus) else None


def take(key: tuple, size: int) -> Idle | None:
    """Inside `keep_warm()`, an idle group of the trainer shape `key` (`WarmActors.take`); None there too where
    there is none, and always outside."""
    pool = _pool(key[0], key[3])
    return pool.take(key, size) if pool is not None else None


def keep(key: tuple, idle: Idle) -> bool:
    """Inside `keep_warm()` (the one active now, not the one a group was taken from), reset the actors and keep
    them idle under the trainer shape `key` (`WarmActors.give`); False, and the caller ends them, outside or
    where that failed."""
    pool = _pool(key[0], key[3])
    return pool is not None and pool.give(key, idle)


def start(kind: str, arguments: dict[str, Any], make: Callable[[], Any]) -> Any:
    """`make()`, or inside `keep_warm()` the idle actor of `kind` started with the same `arguments` (every
    argument of its start, placement included); the actor is remembered for `end`."""
    pool = _pool(kind, arguments.get("num_gpus") or 0)
    if pool is None:
        return make()
    key = (kind, repr(sorted(arguments.items())))
    idle = pool.take(key, 1)
    actor = idle.actors[0] if idle is not None else make()
    pool.own(actor, key)
    return actor


def end(actor: Any, *, failed: bool = False) -> None:
    """`ray.kill(actor)`; or, for an actor `start` gave inside the `keep_warm()` active now and no failure
    left in doubt, its reset and a place among the idle ones."""
    import ray

    pool = _active
    key = pool.disown(actor) if pool is not None else None  # only an actor this pool keeps was owned by it
    if key is None or failed or not pool.give(key, Idle([actor])):
        ray.kill(actor)


_active: WarmActors | None = None
_activating = threading.Lock()

STAGE_KINDS = frozenset({"trainer", "scorer"})  # what a run's stages hand on, holding no GPU (module docstring)


def between_stages(idle_s: float) -> WarmActors | None:
    """In a Ray worker that runs a run's stages, the pool its stages share (made by the first; not closed:
    an actor idle `idle_s` seconds ends); None, and nothing kept, for `idle_s` 0 (a pool an earlier stage
    made is closed), outside a Ray worker (a driver: a test, a notebook), or where `keep_warm()` is active."""
    global _active
    import ray

    if not ray.is_initialized() or ray.get_runtime_context().worker.mode != ray.WORKER_MODE:
        return None
    with _activating:
        if idle_s <= 0:
            if _active is not None and _active.idle_s is not None:
                _active, pool = None, _active
                pool._stop.set()
                pool.close()
            return None
        if _active is None:
            _active = WarmActors(kinds=STAGE_KINDS, gpus=False, idle_s=idle_s)
        elif _active.idle_s is None:  # keep_warm()'s
            return None
        _active.idle_s = idle_s
        return _active


@contextlib.contextmanager
def keep_warm() -> Iterator[WarmActors]:
    """Actors ended inside are kept for the next start that matches (module docstring); every idle one ends on
    the way out. Not nested."""
    global _active
    if _active is not None:
        raise RuntimeError("keep_warm() is already active in this process")
    _active = pool = WarmActors()
    try:
        yield pool
    finally:
        _active = None
        pool.close()
