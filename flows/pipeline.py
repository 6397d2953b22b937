"""The alignment pipeline as a Prefect flow.

    prepare_data ─┬─> sft ─> reward_model ─> round 1 ─> round 2 ─> ... round R
    base_model ───┘                 │            │          │
                                    └──> evaluate(base, sft, round 1..R, reward model)

Every box is a task cached by its content key (tasks/plan.py), persisted
under the storage root and retried with backoff; tasks run on Ray. Round k
starts from round k-1's policy; all rounds share the SFT reference.
"""

from __future__ import annotations

from prefect import flow

from alignflow.config import PipelineConfig
from flows.report import PipelineReport, finish_pipeline_run, start_pipeline_run
from flows.stage_tasks import StageTasks
from tasks.plan import plan_keys


@flow(name="alignflow-pipeline", log_prints=True)
def pipeline(config: PipelineConfig) -> PipelineReport:
    keys = plan_keys(config)
    t = StageTasks(config.infra)
    ctx = start_pipeline_run(config, keys)

    data = t.prepare_data.submit(config.data, keys.data, ctx)
    base = t.base_model.submit(config.model, keys.base_model, ctx)
    sft = t.sft.submit(config.sft, config.model, config.data, keys.sft, data, base, ctx)
    rm = t.reward_model.submit(config.reward_model, config.model, config.data, keys.reward_model, data, sft, ctx)

    policies = {"base": base, "sft": sft}
    policy = sft
    for i, (round_cfg, key) in enumerate(zip(config.rounds, keys.rounds), start=1):
        policy = t.rl_round.submit(round_cfg, config.model, config.data, key, i, policy, sft, rm, data, ctx)
        policies[f"round_{i}"] = policy

    evals = {
        name: t.evaluate_policy.submit(config.evaluation, config.model, config.data, keys.eval_policy[name],
                                       name, policy, rm, sft, data, ctx)
        for name, policy in policies.items()
    }
    rm_eval = t.evaluate_reward_model.submit(config.model, config.data, keys.eval_reward_model, rm, data, ctx)

    return finish_pipeline_run(
        ctx,
        stages={"data": data, "base_model": base, "sft": sft, "reward_model": rm,
                **{name: p for name, p in policies.items() if name.startswith("round_")}},
        policy_evals=evals,
        rm_eval=rm_eval,
        kl_budgets={f"round_{i}": r.kl.budget for i, r in enumerate(config.rounds, start=1)},
    )
