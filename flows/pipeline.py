"""The alignment pipeline as Prefect flows that walk the planned graph (tasks/plan.py).

Every stage is a task cached by its content key, persisted under the storage
root and retried after infra.retry_delay_seconds; tasks run on Ray. `pipeline` runs the whole
graph; `partial_pipeline` runs one target and what it needs (earlier stages
come from cache), for `alignflow stage TARGET`. The deployed flows
(flows/deployed.py) call `run_all` and `run_target` in their own flow run,
so the stages are their task runs, with no subflow in between.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from alignflow.cluster import apply_process_env
from alignflow.config import PipelineConfig, config_from_parameter, resolve_paths
from alignflow.config.loading import ConfigSources
from alignflow.records import StageResult
from flows.console import quiet_deployed_run
from flows.planview import publish_plan
from flows.report import PipelineReport, build_report, close_run, open_run, parent_closed_on_error, wait_all
from flows.stage_tasks import PipelineTaskRunner, StageTasks, join_ray
from tasks.stages.eval_engine import engine_host
from tasks.plan import plan_pipeline


def deployment_config(config: PipelineConfig | dict[str, Any], overrides: list[str] | None = None
                      ) -> tuple[PipelineConfig, ConfigSources]:
    """A deployed flow's `config` parameter (as the API sends it, a mapping; or a model, from Python) and its
    `overrides`, validated, paths resolved, the process environment set (the console quiet, as the CLI's);
    and where each value came from."""
    apply_process_env()
    quiet_deployed_run()
    # A model as the fields its author set (defaults stay defaults): validated again, a full dump would read as
    # settings the author never gave, which the config refuses where they do nothing (reward.sources' siblings).
    tree = config.model_dump(mode="json", exclude_unset=True) if isinstance(config, PipelineConfig) else config
    cfg, sources = config_from_parameter(tree, overrides)
    return resolve_paths(cfg), sources


def run_all(config: PipelineConfig) -> PipelineReport:
    """Every stage, as task runs of the calling flow run; the report."""
    join_ray(config.infra)
    plan = plan_pipeline(config)
    ctx = open_run(config, plan)
    with parent_closed_on_error(ctx):
        publish_plan(plan, ctx)
        with engine_host(plan, ctx) as ctx:
            results, states = wait_all(ctx, StageTasks(config.infra).submit_plan(plan, ctx))
        report = build_report(ctx, plan, results, states)
        close_run(ctx, report)
    return report


def run_target(config: PipelineConfig, target: str) -> dict[str, StageResult]:
    """The stages of `target` (a stage name, or a target such as `rl`) and all they need; the result of each stage
    the target names (`evaluation`: every evaluation; `rl`: every round), by stage name in plan order."""
    join_ray(config.infra)
    full = plan_pipeline(config)
    plan = full.upto(target)
    ctx = open_run(config, plan)
    with parent_closed_on_error(ctx):
        publish_plan(plan, ctx)
        with engine_host(plan, ctx) as ctx:
            results, _ = wait_all(ctx, StageTasks(config.infra).submit_plan(plan, ctx))
        close_run(ctx)
    return {name: results[name] for name in full.resolve(target)}


@flow(name="alignflow-pipeline", task_runner=PipelineTaskRunner(), log_prints=True)
def pipeline(config: PipelineConfig) -> PipelineReport:
    return run_all(config)


@flow(name="alignflow-partial-pipeline", task_runner=PipelineTaskRunner(), log_prints=True)
def partial_pipeline(config: PipelineConfig, target: str) -> dict[str, StageResult]:
    """The stages of `target` and all they need; each target stage's result, by name."""
    return run_target(config, target)
