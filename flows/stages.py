"""One flow per stage, so each can be deployed and rerun on its own.

A stage flow runs its stage and whatever it needs; upstream stages that
already ran come from cache (same content keys as in the pipeline).
"""

from __future__ import annotations

from prefect import flow

from alignflow.config import PipelineConfig
from alignflow.records import StageResult
from flows.report import start_pipeline_run
from flows.stage_tasks import StageTasks
from tasks.plan import plan_keys


@flow(name="alignflow-data", log_prints=True)
def data_flow(config: PipelineConfig) -> StageResult:
    keys, ctx, t = plan_keys(config), start_pipeline_run(config, plan_keys(config)), StageTasks(config.infra)
    return t.prepare_data(config.data, keys.data, ctx)


@flow(name="alignflow-sft", log_prints=True)
def sft_flow(config: PipelineConfig) -> StageResult:
    keys, t = plan_keys(config), StageTasks(config.infra)
    ctx = start_pipeline_run(config, keys)
    data = t.prepare_data.submit(config.data, keys.data, ctx)
    base = t.base_model.submit(config.model, keys.base_model, ctx)
    return t.sft.submit(config.sft, config.model, config.data, keys.sft, data, base, ctx).result()


@flow(name="alignflow-reward-model", log_prints=True)
def reward_model_flow(config: PipelineConfig) -> StageResult:
    keys, t = plan_keys(config), StageTasks(config.infra)
    ctx = start_pipeline_run(config, keys)
    data = t.prepare_data.submit(config.data, keys.data, ctx)
    base = t.base_model.submit(config.model, keys.base_model, ctx)
    sft = t.sft.submit(config.sft, config.model, config.data, keys.sft, data, base, ctx)
    return t.reward_model.submit(config.reward_model, config.model, config.data, keys.reward_model, data, sft, ctx).result()


@flow(name="alignflow-rl", log_prints=True)
def rl_flow(config: PipelineConfig) -> StageResult:
    """Every RL round (upstream stages from cache); returns the last policy."""
    keys, t = plan_keys(config), StageTasks(config.infra)
    ctx = start_pipeline_run(config, keys)
    data = t.prepare_data.submit(config.data, keys.data, ctx)
    base = t.base_model.submit(config.model, keys.base_model, ctx)
    sft = t.sft.submit(config.sft, config.model, config.data, keys.sft, data, base, ctx)
    rm = t.reward_model.submit(config.reward_model, config.model, config.data, keys.reward_model, data, sft, ctx)
    policy = sft
    for i, (round_cfg, key) in enumerate(zip(config.rounds, keys.rounds), start=1):
        policy = t.rl_round.submit(round_cfg, config.model, config.data, key, i, policy, sft, rm, data, ctx)
    return policy.result()


STAGE_FLOWS = {"data": data_flow, "sft": sft_flow, "reward_model": reward_model_flow, "rl": rl_flow}
