"""How the flow's stage tasks share a local Ray: the evaluations take turns, in one warm process."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

from alignflow.cluster import EVALUATION_TURN
from flows.stage_tasks import evaluations_take_turns


def _span(seconds: float) -> tuple[int, float, float]:
    start = time.time()
    time.sleep(seconds)
    return os.getpid(), start, time.time()


def _meet(room: str, others: int) -> int:
    """Wait (at most 120 s) until `others` more tasks have come into `room`; this one's process."""
    Path(room, str(os.getpid())).touch()
    deadline = time.time() + 120
    while len(os.listdir(room)) <= others and time.time() < deadline:
        time.sleep(0.05)
    assert len(os.listdir(room)) > others, f"only {os.listdir(room)} came"
    return os.getpid()


def test_evaluations_sharing_the_engine_host_run_one_at_a_time_in_one_process(ray_local, tmp_path):
    """Submitted at once, tasks holding the run's one EVALUATION_TURN wait in Ray's scheduler, not in a worker
    each: each runs after the last has ended, in the process it left (its imports done). Tasks without the
    turn run side by side, each in a process of its own."""
    assert ray_local.cluster_resources()[EVALUATION_TURN] == 1
    assert evaluations_take_turns(SimpleNamespace(engine_host="alignflow-engine-host-x"))
    assert not evaluations_take_turns(SimpleNamespace(engine_host=None))  # each its own engine: no turns

    span = ray_local.remote(_span)
    warm = ray_local.get(span.remote(0.0))[0]  # a worker that has run a task, idle now

    taking = ray_local.get([span.options(resources={EVALUATION_TURN: 1}).remote(1.0) for _ in range(3)])
    assert {pid for pid, _, _ in taking} == {warm}, taking
    spans = sorted((start, end) for _, start, end in taking)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), spans

    meet = ray_local.remote(_meet)  # three that can only end once all three run at once
    assert len(set(ray_local.get([meet.remote(str(tmp_path), 2) for _ in range(3)]))) == 3
