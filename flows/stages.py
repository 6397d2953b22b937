"""One flow per stage, so each can be deployed and rerun on its own.

A stage flow runs its stage and whatever it needs; upstream stages that
already ran come from cache (same content keys as in the pipeline). Each
opens its own MLflow parent run and closes it (FAILED if the stage fails).
"""

from __future__ import annotations

from prefect import flow

from alignflow.config import PipelineConfig
from alignflow.records import StageResult
from flows.report import start_pipeline_run
from flows.stage_tasks import StageTasks
from tasks.plan import plan_keys

def _run_chain(config: PipelineConfig, until: str) -> StageResult:
    """Submit the training chain up to and including `until`; its result."""
    keys, t = plan_keys(config), StageTasks(config.infra)
    ctx = start_pipeline_run(config, keys)
    tracker = ctx.tracker()
    try:
        last = data = t.prepare_data.submit(config.data, keys.data, ctx)
        if until != "data":
            base = t.base_model.submit(config.model, keys.base_model, ctx)
            last = sft = t.sft.submit(config.sft, config.model, config.data, keys.sft, data, base, ctx)
        if until in ("reward_model", "rl"):
            last = rm = t.reward_model.submit(config.reward_model, config.model, config.data, keys.reward_model,
                                              data, sft, ctx)
        if until == "rl":
            last = sft  # round 1 starts from SFT, round k from round k-1
            for i, (round_cfg, key) in enumerate(zip(config.rounds, keys.rounds), start=1):
                last = t.rl_round.submit(round_cfg, config.model, config.data, key, i, last, sft, rm, data, ctx)
        result = last.result()
    except BaseException:
        tracker.finish(ctx.parent_run_id, status="FAILED")
        raise
    tracker.finish(ctx.parent_run_id)
    return result

@flow(name="alignflow-data", log_prints=True)
def data_flow(config: PipelineConfig) -> StageResult:
    return _run_chain(config, "data")

@flow(name="alignflow-sft", log_prints=True)
def sft_flow(config: PipelineConfig) -> StageResult:
    return _run_chain(config, "sft")

@flow(name="alignflow-reward-model", log_prints=True)
def reward_model_flow(config: PipelineConfig) -> StageResult:
    return _run_chain(config, "reward_model")

@flow(name="alignflow-rl", log_prints=True)
def rl_flow(config: PipelineConfig) -> StageResult:
    """Every RL round (upstream stages from cache); returns the last policy."""
    return _run_chain(config, "rl")

STAGE_FLOWS = {"data": data_flow, "sft": sft_flow, "reward_model": reward_model_flow, "rl": rl_flow}
