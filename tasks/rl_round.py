"""rl_round: one RL round (PPO / GRPO / ... / rejection sampling) as a task.

The round's key covers its config and the policy it starts from, so rounds
chain: round k+1 starts from round k's committed policy. Every
`checkpoint_every` steps the round's full state is committed under
`{round_uri}/checkpoints/step-N`; a retried round resumes there.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from alignflow.cluster import ensure_ray
from alignflow.config import DataConfig, ModelConfig, RoundConfig
from alignflow.records import StageResult
from engines import batches, models
from engines.rl import RLRound, RoundInputs
from tasks.context import RunContext, compute_stage, stage_task
from tasks.data import load_split

log = logging.getLogger("alignflow")
CODE_VERSION = "1"


def rl_round(cfg: RoundConfig, model: ModelConfig, data_cfg: DataConfig, key: str, index: int, policy: StageResult,
             reference: StageResult, reward: StageResult, data: StageResult, ctx: RunContext) -> StageResult:
    storage = ctx.storage()
    stage = f"round_{index}"

    def compute(out: Path, run, uri: str) -> dict[str, float]:
        policy_path = str(storage.fetch(policy.uri))
        tokenizer = models.load_tokenizer(policy_path)
        prompts, report = batches.filter_prompts(tokenizer, load_split(data, ctx, "prompts"),
                                                 data_cfg.max_prompt_tokens, "prompts")
        run.log_metrics(report.as_metrics("prompts"))
        inputs = RoundInputs(
            policy_path=policy_path, reference_path=str(storage.fetch(reference.uri)),
            reward_path=str(storage.fetch(reward.uri)), prompts=prompts, dtype=model.dtype,
            torch_threads=ctx.infra.torch_threads,
            max_model_len=data_cfg.max_prompt_tokens + cfg.generation.max_new_tokens,
            rollout_backend=cfg.generation.backend,
        )
        ensure_ray(ctx.infra)
        rl = RLRound(cfg, inputs)
        try:
            start = 0
            latest = storage.latest_checkpoint(uri)
            if latest:
                start = rl.load_state(str(storage.fetch(latest[1])))
                run.set_tag("alignflow.resumed_from_step", str(start))
                log.info("%s: resuming at step %d", stage, start)
            for step in range(start, cfg.steps):
                metrics = rl.step(step)
                run.log_metrics({f"rl/{k}": v for k, v in metrics.items()}, step=step + 1)
                if (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
                    with tempfile.TemporaryDirectory(prefix=f"alignflow-{stage}-ckpt-") as tmp:
                        rl.save_state(tmp, step + 1)
                        storage.commit(tmp, storage.checkpoint_uri(uri, step + 1), meta={"stage": stage, "step": step + 1})
                    storage.prune_checkpoints(uri, keep_step=step + 1)
            rl.save_policy(str(out))
        finally:
            rl.shutdown()
        summary = {"rl/steps": float(cfg.steps), "rl/steps_run": float(cfg.steps - start),
                   "rl/resumed_from_step": float(start), "rl/final_reward_mean": metrics["reward/mean"]}
        run.log_metrics(summary)
        return summary

    return compute_stage(ctx, stage=stage, key=key,
                         params={"round": index, "start_policy": policy.uri, **cfg.model_dump(mode="json")},
                         compute=compute)


rl_round_task = stage_task(rl_round, name="rl_round")
