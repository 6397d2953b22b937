"""Entrypoints for prefect.yaml deployments: a config file plus overrides.

A deployment's parameters name a config file (relative to the repository)
and `key.sub=value` overrides; the file, the target and what the run needs
from outside (alignflow/preflight.py) are checked before anything runs.
Then the pipeline (or one target of it) runs in this flow run: every stage
is one of its task runs, on Ray (flows/stage_tasks.py PipelineTaskRunner),
so Retry on a failed run's page reruns that same run (finished stages come
from cache, a half-done round resumes). The flow run's own API (the
worker's) serves the Ray workers too.
"""

from __future__ import annotations

from prefect import flow

from alignflow.cluster import apply_process_env
from alignflow.config import load_config, resolve_paths
from alignflow.preflight import check
from alignflow.records import StageResult
from flows.pipeline import run_all, run_target
from flows.report import PipelineReport
from flows.stage_tasks import PipelineTaskRunner
from tasks.plan import plan_pipeline


@flow(name="alignflow-scheduled-pipeline", task_runner=PipelineTaskRunner(), log_prints=True)
def run_pipeline(config_path: str = "configs/tiny.yaml", overrides: list[str] | None = None) -> PipelineReport:
    apply_process_env()
    cfg = resolve_paths(load_config(config_path, overrides or []))
    check(cfg, overrides, config_path)  # data, model, lengths, rewards, storage: before any task
    report = run_all(cfg)
    print(report.table())
    return report


@flow(name="alignflow-stage", task_runner=PipelineTaskRunner(), log_prints=True)
def run_stage(stage: str, config_path: str = "configs/tiny.yaml", overrides: list[str] | None = None) -> StageResult:
    """One target of the pipeline (data, base_model, sft, reward_model, rl, evaluation, or a stage's name)."""
    apply_process_env()
    cfg = resolve_paths(load_config(config_path, overrides or []))
    plan_pipeline(cfg).resolve(stage)  # an unknown target fails here, listing the valid ones
    check(cfg, overrides, config_path)
    return run_target(cfg, stage)
