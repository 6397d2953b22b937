"""Every stage kind's Prefect task, bound to one pipeline's result storage and retry policy."""

from __future__ import annotations

from typing import Any

from prefect.tasks import exponential_backoff

from alignflow.config import InfraConfig
from flows.runtime import result_storage
from tasks.context import RunContext
from tasks.plan import Plan
from tasks.registry import STAGE_KINDS
from tasks.runner import prefect_task


class StageTasks:
    def __init__(self, infra: InfraConfig):
        storage = result_storage(infra)
        delay = exponential_backoff(backoff_factor=infra.retry_delay_seconds) if infra.retry_delay_seconds else 0
        self.tasks = {
            name: prefect_task(kind).with_options(result_storage=storage, retries=infra.task_retries,
                                                  retry_delay_seconds=delay)
            for name, kind in STAGE_KINDS.items()
        }

    def submit_plan(self, plan: Plan, ctx: RunContext) -> dict[str, Any]:
        """Submit every stage in order, each with its upstream futures by input name."""
        futures: dict[str, Any] = {}
        for stage in plan.stages.values():
            upstream = {name: futures[source] for name, source in stage.inputs.items()}
            futures[stage.name] = self.tasks[stage.kind].submit(stage=stage, inputs=upstream, ctx=ctx)
        return futures
