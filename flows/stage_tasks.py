"""How a flow runs its stages: every stage kind's Prefect task, bound to one pipeline's result storage
and retry policy, submitted to Ray through the flow's own task runner."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Iterable
from typing import Any

import ray
from prefect.context import FlowRunContext
from prefect.task_runners import TaskRunner
from prefect_ray import RayTaskRunner
from prefect_ray.context import remote_options

from alignflow.cluster import EVALUATION_TURN, init_ray, ray_init_kwargs
from alignflow.config import InfraConfig
from alignflow.store.storage import Storage, StorageError
from flows.runtime import check_api_reachable, result_storage, warn_local_root_on_cluster
from tasks.context import RunContext
from tasks.plan import Plan
from tasks.registry import STAGE_KINDS
from tasks.runner import prefect_task

log = logging.getLogger("alignflow")


class StageTasks:
    def __init__(self, infra: InfraConfig):
        storage = result_storage(infra)
        # One delay, not a backoff list: the UI shows a task run's delay as a number ("Retry Delay: NaNs" for a list).
        self.tasks = {
            name: prefect_task(kind).with_options(result_storage=storage, retries=infra.task_retries,
                                                  retry_delay_seconds=infra.retry_delay_seconds)
            for name, kind in STAGE_KINDS.items()
        }

    def submit_plan(self, plan: Plan, ctx: RunContext) -> dict[str, Any]:
        """Submit every stage in order, each with its upstream futures by input name."""
        futures: dict[str, Any] = {}
        storage = ctx.storage()
        turns = evaluations_take_turns(ctx)
        for stage in plan.stages.values():
            upstream = {name: futures[source] for name, source in stage.inputs.items()}
            # The task is named by the stage (its kind is a tag): a task run that never starts (its upstream
            # failed; Prefect names it before it could render a run name) is then `eval_round_1-97b`, not
            # `evaluate_policy-97b`, and one that runs is `eval_round_1`.
            # Prefect's cache answers for a stage whose artifact is gone (a bucket's lifecycle rule, a cleanup)
            # without running it, and every later run would hand on a URI to nothing: such a stage is run.
            gone = lost_artifact(storage, storage.stage_uri(stage.name, stage.key))
            task = self.tasks[stage.kind].with_options(name=stage.name, task_run_name=stage.name, tags={stage.kind},
                                                       refresh_cache=gone)
            taking_turns = turns and STAGE_KINDS[stage.kind].target == "evaluation"
            with remote_options(**stage_remote_options(ctx.infra, taking_turns)):
                futures[stage.name] = task.submit(stage=stage, inputs=upstream, ctx=ctx)
        return futures


def stage_remote_options(infra: InfraConfig, taking_turns: bool) -> dict[str, Any]:
    """The Ray options of a stage's task. Where its worker dies (the OOM killer, a lost node) Prefect's retries
    never run, the task run having crashed with it: Ray runs the task again, resuming from its checkpoint, 3 times
    by default whatever the config says. As many times as infra.task_retries, as for an error. `taking_turns`: an
    evaluation that waits for the run's one engine-host turn (EVALUATION_TURN)."""
    return {"max_retries": infra.task_retries, **({"resources": {EVALUATION_TURN: 1}} if taking_turns else {})}


def lost_artifact(storage: Storage, uri: str) -> bool:
    """Whether a stage's artifact is not there to reuse: never committed, or committed with files lost since (the
    listing of one prefix). Such an artifact is set aside (its manifest renamed, its files kept), and its stage
    runs again: downstream stages would fail on it at every retry."""
    try:
        lost = storage.unstored(uri)
    except StorageError:  # never committed
        return True
    if lost:
        aside = storage.set_aside(uri)
        log.warning("%s lost %s since its commit: set aside (%s), its stage runs again", uri, ", ".join(lost), aside)
    return bool(lost)


@ray.remote(num_cpus=0)
def _load_stage_modules() -> int:
    """Most of what a stage worker imports before its first stage computes (Prefect's task engine, torch and
    transformers; MLflow, which only alignflow/tracking/runs.py imports, comes with the stage), in the worker;
    its pid."""
    import os

    import prefect.task_engine  # noqa: F401
    import tasks.stages.base_model  # noqa: F401  (engines.models: torch, transformers)

    return os.getpid()


def warm_a_stage_worker() -> ray.ObjectRef:
    """Start the run's first stage worker now, its imports (~10 s of CPU on 2 cores) beside what this process
    does before the flow starts; `wait_for_stage_worker` before the first stage is submitted, and Ray gives
    it the idle worker this left (a job's tasks reuse its workers). A worker still busy importing is not
    idle: the stage would take a fresh one and import all of it again."""
    return _load_stage_modules.remote()


def wait_for_stage_worker(ref: ray.ObjectRef, timeout: float = 600.0) -> None:
    """Wait for `warm_a_stage_worker`'s worker to be idle. One that fails or takes longer is left to the
    stages, which report their own errors (a log line says so). Waiting is never the slower choice: a stage
    submitted while it still imports would take a fresh worker and import it all again (on a busy 2-core
    machine the imports took past 120 s)."""
    try:
        pid = ray.get(ref, timeout=timeout)
        log.info("stage worker pid %d has the stages' modules loaded: the first stage runs in it", pid)
    except Exception as err:  # noqa: BLE001  (GetTimeoutError, an import error on a cluster's node)
        log.info("the first stage worker was not ready (%s: %s): the stages start their own",
                 type(err).__name__, str(err).splitlines()[0] if str(err) else "")


def evaluations_take_turns(ctx: RunContext) -> bool:
    """Whether the run's evaluations run one at a time: where they share the run's engine host (no GPU for
    their engine, tasks/stages/eval_engine.py), on a Ray this run started (it has one EVALUATION_TURN).

    Their generation runs one at a time in that host anyway, and on the CPU their scoring shares its cores.
    Taking turns, they queue in Ray's scheduler rather than each in a worker process of its own: the next
    one runs in the process the last one left warm, not a fresh one that first spends ~13 s of CPU (2 cores)
    importing torch, transformers, Prefect and MLflow. A cluster joined by address has no EVALUATION_TURN:
    there they run as their inputs allow."""
    return ctx.engine_host is not None and ray.cluster_resources().get(EVALUATION_TURN, 0) >= 1


class PipelineTaskRunner(RayTaskRunner):
    """A Ray task runner that joins Ray once the flow knows its config (`join`), not when the flow starts.

    A flow's task runner is fixed when it is decorated, before its
    parameters (the config, and with it the Ray address) exist. A runner
    configured per call (`with_options`) makes the pipeline a subflow of
    whatever calls it, and a Prefect retry of the caller then starts a new
    subflow beside the failed one. With this runner a deployed flow runs the
    stages as its own task runs: it reads its config, then joins Ray (or
    uses the one the CLI started, which it leaves running).
    """

    def __enter__(self):
        TaskRunner.__enter__(self)  # Ray is joined in `join`
        return self

    def join(self, infra: InfraConfig) -> None:
        if self._owns_ray:
            return
        warn_local_root_on_cluster(infra)
        if ray.is_initialized():  # the CLI's, started while the Prefect API came up
            return
        kwargs = ray_init_kwargs(infra)
        self.address = kwargs.pop("address", None)
        self.init_kwargs = {"namespace": "prefect", **kwargs}
        self._owns_ray = True
        self._ray_context = init_ray(self.address, **self.init_kwargs)  # Prefect's SIGTERM handler kept
        # A deployed run on a cluster, as the CLI's: nodes that cannot reach the Prefect API are refused up front
        # (a server bound to 127.0.0.1, prefect.yaml's default), not found by stages that lose their task runs.
        check_api_reachable(infra)

    def submit(self, task, parameters, wait_for=None, dependencies=None):
        if not ray.is_initialized():
            raise RuntimeError("PipelineTaskRunner: the flow submits stages before join_ray(infra)")
        return super().submit(task, parameters, wait_for, dependencies)


def join_ray(infra: InfraConfig) -> None:
    """Join (or start) the Ray this flow run's stages run on, from the run's config. A flow called with
    another task runner (a test's thread pool) keeps it."""
    ctx = FlowRunContext.get()
    if isinstance(ctx.task_runner if ctx else None, PipelineTaskRunner):
        ctx.task_runner.join(infra)


def settled(future: Any, timeout: float) -> bool:
    """Whether a stage's future (Ray's or a thread pool's) has ended, after waiting at most `timeout` seconds;
    one that has is then waited for, so its state is final. A future of another kind is simply waited for."""
    inner = getattr(future, "wrapped_future", None)
    if isinstance(inner, ray.ObjectRef):
        done = bool(ray.wait([inner], timeout=timeout)[0])
    elif isinstance(inner, concurrent.futures.Future):
        done = bool(concurrent.futures.wait([inner], timeout=timeout).done)
    else:
        done = True
    if done:
        future.wait()
    return done


def stop_unfinished(futures: Iterable[Any]) -> None:
    """Stop the stages of a stopped pipeline that are still running or waiting: each one's Ray task is cancelled
    and its worker killed outright, and with it the trainers and engines it owns, so none goes on to commit
    after the stop; the checkpoints it wrote stay for the rerun to resume from."""
    refs = [f.wrapped_future for f in futures if isinstance(getattr(f, "wrapped_future", None), ray.ObjectRef)]
    if not refs:
        return
    try:
        _, unfinished = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        for ref in unfinished:
            ray.cancel(ref, force=True)
    except Exception as err:  # noqa: BLE001  (Ray going down with the CLI ends them as well)
        log.warning("could not cancel the stages still running (%s: %s); they end with the run's Ray",
                    type(err).__name__, err)


STOPPED = "the pipeline run was stopped (Ctrl-C, SIGTERM or Cancel) while this stage ran"


def cancel_task_runs(futures: Iterable[Any]) -> None:
    """Set Cancelled the task runs of a stopped pipeline's stages that have not ended (their Ray tasks were
    stopped: stop_unfinished), else the Prefect UI would show them Running under a finished flow run for good.
    A stage whose Ray task never started has no task run to set."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterId
    from prefect.states import Cancelled

    ids = [f.task_run_id for f in futures if getattr(f, "task_run_id", None)]
    if not ids:
        return
    try:
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(task_run_filter=TaskRunFilter(id=TaskRunFilterId(any_=ids)), limit=len(ids))
            for run in runs:
                if run.state is not None and not run.state.is_final():
                    client.set_task_run_state(run.id, Cancelled(message=STOPPED), force=True)
    except Exception as err:  # noqa: BLE001  (the API may be going down with the CLI)
        log.warning("could not set the stopped stages' task runs Cancelled (%s: %s)", type(err).__name__, err)
