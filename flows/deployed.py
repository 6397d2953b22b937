"""Entrypoints for prefect.yaml deployments: the whole pipeline config as one typed parameter.

`config` is annotated as the PipelineConfig model, so Prefect's Custom run
form renders every section and field with its type, default, bounds and
description, and the server refuses a run whose values break the schema.
Each deployment in prefect.yaml carries its config as that parameter,
filled at `prefect deploy` by the build step `config_parameter` from a
config file; `overrides` (`key.sub=value`, as on the command line) patch it.

The flows validate the parameter themselves (validate_parameters=False), so
an error names the parameter a value came from, and the file, the target
and what the run needs from outside (alignflow/preflight/) are checked
before anything runs. Then the pipeline (or one target of it) runs in this
flow run: every stage is one of its task runs, on Ray
(flows/stage_tasks.py PipelineTaskRunner), so Retry on a failed run's page
reruns that same run (finished stages come from cache, a half-done round
resumes). The flow run's own API (the worker's) serves the Ray workers too.

Prefect loads this file as a module of its own (`deployed`), which Ray
workers cannot import, and ships the flow functions to them by value: they
call only what other modules define.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from alignflow.cluster import run_scratch
from alignflow.config import PipelineConfig, load_config
from alignflow.config.overrides import as_set_with_made_defaults
from alignflow.preflight import check
from alignflow.records import StageResult
from flows.pipeline import deployment_config, run_all, run_target
from flows.report import PipelineReport
from flows.stage_tasks import PipelineTaskRunner
from tasks.plan import plan_pipeline


def config_parameter(path: str, overrides: list[str] | None = None) -> dict[str, Any]:
    """A prefect.yaml build step: the config file at `path` (relative to where `prefect deploy` runs),
    validated, as `{"config": {...}}` for a deployment's `parameters: {config: "{{ <step id>.config }}"}`.
    A broken file fails the deploy, not a run.

    The values the file sets, as it sets them (the form shows the schema's defaults for the rest): a
    field a section checks only when it is set (KTO's weights under another loss) stays unset. Also every
    default made by a factory that holds something (the default rounds, a judge's verdict scores, the
    reward model's margin bins) beside what the file sets: the schema has no default for such a field, and
    the form would show it empty, though the run has it."""
    cfg = load_config(path, overrides or [])
    return {"config": as_set_with_made_defaults(cfg)}


@flow(name="alignflow-scheduled-pipeline", task_runner=PipelineTaskRunner(), log_prints=True,
      validate_parameters=False)
def run_pipeline(config: PipelineConfig, overrides: list[str] | None = None) -> PipelineReport:
    """The whole pipeline: `config` every section of it, `overrides` `key.sub=value` patches on top."""
    cfg, sources = deployment_config(config, overrides)
    check(cfg, sources=sources)  # data, model, lengths, rewards, storage: before any task
    with run_scratch():  # as the CLI's runs: a killed stage's files go with the flow run, not left in /tmp
        report = run_all(cfg)
    print(report.table())
    return report


@flow(name="alignflow-stage", task_runner=PipelineTaskRunner(), log_prints=True, validate_parameters=False)
def run_stage(stage: str, config: PipelineConfig, overrides: list[str] | None = None) -> dict[str, StageResult]:
    """One target of the pipeline (data, base_model, sft, reward_model, rl, evaluation, or a stage's name); the
    result of each stage it names, by name."""
    cfg, sources = deployment_config(config, overrides)
    plan_pipeline(cfg).resolve(stage)  # an unknown target fails here, listing the valid ones
    check(cfg, sources=sources)
    with run_scratch():
        return run_target(cfg, stage)
