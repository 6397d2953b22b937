"""Every stage kind as a Prefect task: cached by its content key, persisted, retried.

The task body is the same for every kind: the upstream results arrive by
input name (Prefect resolves the futures), become the kind's typed inputs
object, and go to the kind's own function. User errors (wrong config or
data) are not retried: the same input would fail the same way.
"""

from __future__ import annotations

from typing import Any

from alignflow.errors import UserError
from alignflow.records import StageResult
from tasks.context import RunContext
from tasks.plan import PlannedStage
from tasks.registry import STAGE_KINDS, StageKind


def run_stage(stage: PlannedStage, inputs: dict[str, StageResult], ctx: RunContext) -> StageResult:
    kind = STAGE_KINDS[stage.kind]
    return kind.runner()(stage, kind.inputs.model_validate(inputs), ctx)


def stage_cache_key(context: Any, parameters: dict[str, Any]) -> str:
    """Prefect's cache key: the stage's content key (config + input keys + code version)."""
    stage = parameters["stage"]
    return f"{stage.name}-{stage.key}"


def retry_unless_user_error(task: Any, task_run: Any, state: Any) -> bool:
    try:
        state.result()
    except UserError:
        return False
    except BaseException:
        return True
    return True


def prefect_task(kind: StageKind):
    """The Prefect task of one stage kind (defaults; the flow binds storage and retries)."""
    from prefect import task
    from prefect.tasks import exponential_backoff

    # JSON results, not pickles: the results directory may be a shared bucket,
    # and a pickle read back on a cache hit could run anyone's code.
    return task(
        run_stage, name=kind.name, task_run_name="{stage.name}", cache_key_fn=stage_cache_key, persist_result=True,
        result_serializer="json", retries=2, retry_delay_seconds=exponential_backoff(backoff_factor=2),
        retry_jitter_factor=0.5, retry_condition_fn=retry_unless_user_error,
    )
