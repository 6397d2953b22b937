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


CRASH_PROBE = """
import os, pathlib, sys
from prefect import flow, task
from prefect_ray import RayTaskRunner
from prefect_ray.context import remote_options
from alignflow.config import InfraConfig
from flows.stage_tasks import stage_remote_options

marks = pathlib.Path(sys.argv[1])

@task(retries=0)
def dies_once(room: str) -> int:
    done = len(os.listdir(room))
    pathlib.Path(room, str(done)).touch()
    if done == 0:
        os._exit(1)  # the worker dies under the task, as the OOM killer would have it
    return done + 1

def outcome(future, room: pathlib.Path) -> str:
    try:
        return f"ran {future.result()} times"
    except BaseException as err:  # noqa: BLE001
        return f"{type(err).__name__} after {len(os.listdir(room))} run"

@flow(task_runner=RayTaskRunner())
def run() -> str:
    futures = {}
    for retries in (1, 0):
        (room := marks / str(retries)).mkdir()
        with remote_options(**stage_remote_options(InfraConfig(task_retries=retries), False)):
            futures[retries] = (dies_once.submit(str(room)), room)
    return " | ".join(outcome(*futures[r]) for r in (1, 0))

# The runner takes the Ray started here: init_ray starts it again where its node times out starting.
from alignflow.cluster import init_ray
init_ray(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
print("RESULT", run())
"""


def test_a_stage_whose_worker_dies_runs_again_as_often_as_task_retries_allows(tmp_path, shared_prefect_api):
    """A real Prefect flow on a Ray task runner: a task whose worker dies (os._exit) crashes its task run, where
    Prefect's retries never act; Ray runs it again, and with stage_remote_options as often as infra.task_retries
    says (Ray's default was 3 whatever it said): once for 1, never for 0."""
    import subprocess
    import sys

    script = tmp_path / "crash.py"
    script.write_text(CRASH_PROBE)
    env = {**os.environ, "PREFECT_API_URL": shared_prefect_api(), "RAY_ADDRESS": "", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300,
                         cwd=os.getcwd(), env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    [line] = [x for x in out.stdout.splitlines() if x.startswith("RESULT")]
    assert line == "RESULT ran 2 times | WorkerCrashedError after 1 run", line
