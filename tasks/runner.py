"""Every stage kind as a Prefect task: cached by its content key, persisted, retried.

The task body is the same for every kind: the upstream results arrive by
input name (Prefect resolves the futures), become the kind's typed inputs
object, and go to the kind's own function. User errors (wrong config or
data) are not retried: the same input would fail the same way; nor is an
input found corrupt, which is set aside so that the next run computes it.
"""

from __future__ import annotations

import logging
from typing import Any

from alignflow.errors import UserError
from alignflow.records import StageResult
from alignflow.store.faults import CorruptInput, corrupt_artifacts
from tasks.context import RunContext
from tasks.plan import PlannedStage
from tasks.registry import STAGE_KINDS, StageKind

log = logging.getLogger("alignflow")


def run_stage(stage: PlannedStage, inputs: dict[str, StageResult], ctx: RunContext) -> StageResult:
    """The stage's result; in a Prefect task run that resumed from a checkpoint, a Completed state whose
    message says from where (the result is its data)."""
    from engines.placement import warm

    kind = STAGE_KINDS[stage.kind]
    pool = warm.between_stages(ctx.infra.keep_warm_s)  # the processes an earlier stage here left, where they fit
    reused = pool.counts.reused if pool is not None else 0
    try:
        result = kind.runner()(stage, kind.inputs.model_validate(inputs), ctx)
    except Exception as err:
        set_aside_corrupt_inputs(err, stage, inputs, ctx)
        raise
    finally:
        message = _resumed.pop(_task_run_id(), None)  # a stage that failed after resuming leaves nothing behind
        if pool is not None and pool.counts.reused > reused:
            _task_log().info("%s took %d process(es) an earlier stage left (infra.keep_warm_s)", stage.name,
                             pool.counts.reused - reused)
    if message is None:
        return result
    from prefect.states import Completed

    return Completed(message=message, data=result)


def set_aside_corrupt_inputs(err: Exception, stage: PlannedStage, inputs: dict[str, Any], ctx: RunContext) -> None:
    """Where `err` comes of an input whose files no longer match its manifest (changed at the same size after
    its commit: the cache's check before a stage runs compares sizes only), set that input aside and raise
    CorruptInput, not retried: every retry would read the same files, and Prefect's cache would hand the
    input on again at the next run. Set aside (uncommitted, its files kept), it is computed again then."""
    found = corrupt_artifacts(err)
    if not found:  # most failures: nothing to look up
        return
    storage = ctx.storage()
    for name, result in inputs.items():
        if not isinstance(result, StageResult):
            continue
        uri = ctx.uri(result)
        bad = [c for c in found if c.uri == uri or c.uri.startswith(f"{uri}/")]
        if bad:
            aside = storage.set_aside(uri) if storage.is_committed(uri) else "set aside already"
            raise CorruptInput(f"{stage.name}: its input {name!r} ({result.stage} at {uri}) no longer matches its "
                               f"manifest ({bad[0].detail}): set aside ({aside}); run the "
                               f"pipeline again and {result.stage} is computed again, then the stages after it"
                               ) from err


def _task_log() -> logging.Logger | logging.LoggerAdapter:
    """The Prefect task run's logger (its log in the UI), in one; else alignflow's."""
    from prefect.context import TaskRunContext
    from prefect.logging import get_run_logger

    return get_run_logger() if TaskRunContext.get() is not None else log


_resumed: dict[str, str] = {}  # task run id -> "resumed from step S of T", until its task returns


def _task_run_id() -> str | None:
    from prefect.context import TaskRunContext

    ctx = TaskRunContext.get()
    return str(ctx.task_run.id) if ctx else None


def note_resumed(step: int, total: int) -> None:
    """Say on this Prefect task run (if in one) that its stage resumed at `step` of `total`: tags
    `resumed` and `resumed-from-step-S`, a line in its log, and the message of the state it ends in."""
    from prefect.context import TaskRunContext
    from prefect.logging import get_run_logger

    ctx = TaskRunContext.get()
    if ctx is None:
        return
    message = f"resumed from step {step} of {total}"
    # The task run is sent to the API with each state change, tags included: its final state carries these.
    ctx.task_run.tags = sorted({*ctx.task_run.tags, "resumed", f"resumed-from-step-{step}"})
    _resumed[str(ctx.task_run.id)] = message
    get_run_logger().info("%s: %s", ctx.task_run.name, message)


def stage_cache_key(context: Any, parameters: dict[str, Any]) -> str:
    """Prefect's cache key: the stage's content key (config + input keys + code version).

    Prefect 3 keeps the key on the run's states, while its UI shows the task run's own `cache_key`
    ("Cache Key: None"): the key is also set there, and goes to the API with the run's next state
    (Running, or Cached on a hit)."""
    stage = parameters["stage"]
    key = f"{stage.name}-{stage.key}"
    if getattr(context, "task_run", None) is not None:
        context.task_run.cache_key = key
    return key


def retry_unless_user_error(task: Any, task_run: Any, state: Any) -> bool:
    try:
        state.result()
    except (UserError, CorruptInput):
        return False
    except BaseException:
        return True
    return True


def prefect_task(kind: StageKind):
    """The Prefect task of one stage kind (defaults; the flow binds storage and retries)."""
    from prefect import task

    # JSON results, not pickles: the results directory may be a shared bucket,
    # and a pickle read back on a cache hit could run anyone's code.
    return task(
        run_stage, name=kind.name, task_run_name="{stage.name}", cache_key_fn=stage_cache_key, persist_result=True,
        result_serializer="json", retries=2, retry_delay_seconds=2.0,
        # Each retry waits a random delay up to 1.5x retry_delay_seconds (Prefect's server draws it).
        retry_jitter_factor=0.5, retry_condition_fn=retry_unless_user_error,
    )
