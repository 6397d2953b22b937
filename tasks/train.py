"""sft and reward_model: DeepSpeed training stages that resume mid-way.

Both tokenize their split, start a TrainerGroup on Ray, and step through a
deterministic schedule. Every `checkpoint_every` steps the full training
state (weights, optimizer, scheduler, RNG, step) is committed under
`{stage_uri}/checkpoints/step-N`; a retried task starts from the latest
committed one instead of step 0.
"""

from __future__ import annotations

import functools
import logging
import tempfile
from collections.abc import Callable
from pathlib import Path


from alignflow.cluster import ensure_ray
from alignflow.config import DataConfig, ModelConfig, RewardModelConfig, SFTConfig, TrainConfig
from alignflow.records import StageResult
from engines import batches, models, objectives, supervised
from engines.trainer import EngineSpec, TrainerGroup
from tasks.context import RunContext, compute_stage, stage_task
from tasks.data import load_split

log = logging.getLogger("alignflow")
CODE_VERSION = "2"  # 2: newly initialised scalar heads start at zero


def train_stage(
    *, stage: str, key: str, cfg: TrainConfig, model: ModelConfig, data_cfg: DataConfig, init: StageResult,
    data: StageResult, ctx: RunContext, kind: str, split: str, objective: Callable, paired: bool,
) -> StageResult:
    storage = ctx.storage()

    def compute(out: Path, run, uri: str) -> dict[str, float]:
        init_path = str(storage.fetch(init.uri))
        tokenizer = models.load_tokenizer(init_path)
        records = load_split(data, ctx, split)
        to_tensors = batches.pair_tensors if paired else batches.sft_tensors
        tensors, report = to_tensors(tokenizer, records, data_cfg.max_prompt_tokens, data_cfg.max_response_tokens)
        run.log_metrics(report.as_metrics(split))
        n_rows = tensors["input_ids"].shape[0] // (2 if paired else 1)
        schedule = supervised.plan(n_rows, cfg.batch_size, cfg.epochs, cfg.max_steps, cfg.seed)

        ensure_ray(ctx.infra)
        spec = EngineSpec.from_config(cfg, model_path=init_path, kind=kind, total_steps=schedule.total_steps,
                                      global_batch=cfg.batch_size, dtype=model.dtype,
                                      torch_threads=ctx.infra.torch_threads)
        group = TrainerGroup(spec, cfg.num_workers)
        try:
            start = _resume(group, storage, uri)
            if start:
                run.set_tag("alignflow.resumed_from_step", str(start))
            history: list[dict[str, float]] = []

            def on_metrics(step: int, m: dict[str, float]) -> None:
                history.append(m)
                if step % cfg.log_every == 0 or step == schedule.total_steps:
                    run.log_metrics({f"train/{k}": v for k, v in m.items()}, step=step)

            def on_checkpoint(step: int) -> None:
                with tempfile.TemporaryDirectory(prefix=f"alignflow-{stage}-ckpt-") as tmp:
                    group.save_state(tmp, {"step": step})
                    storage.commit(tmp, storage.checkpoint_uri(uri, step), meta={"stage": stage, "step": step})
                storage.prune_checkpoints(uri, keep_step=step)
                log.info("%s: checkpoint at step %d", stage, step)

            steps_run = supervised.fit(
                group, tensors, schedule, objective, paired=paired, start_step=start,
                checkpoint_every=cfg.checkpoint_every, on_metrics=on_metrics, on_checkpoint=on_checkpoint,
            )
            group.save_hf(str(out))
        finally:
            group.shutdown()
        tail = history[-min(len(history), 10):] or [{}]
        summary = {f"train/final_{k}": sum(h[k] for h in tail) / len(tail) for k in tail[0]}
        summary.update({"train/steps": float(schedule.total_steps), "train/steps_run": float(steps_run),
                        "train/resumed_from_step": float(start)})
        run.log_metrics(summary)
        return summary

    return compute_stage(ctx, stage=stage, key=key, params=cfg.model_dump(mode="json"), compute=compute)


def _resume(group: TrainerGroup, storage, uri: str) -> int:
    latest = storage.latest_checkpoint(uri)
    if latest is None:
        return 0
    step, ckpt_uri = latest
    extra = group.load_state(str(storage.fetch(ckpt_uri)))
    log.info("resuming from step %d (%s)", step, ckpt_uri)
    return int(extra["step"])


def sft(cfg: SFTConfig, model: ModelConfig, data_cfg: DataConfig, key: str, data: StageResult,
        base: StageResult, ctx: RunContext) -> StageResult:
    """Supervised fine-tuning of the base model on demonstrations."""
    return train_stage(
        stage="sft", key=key, cfg=cfg, model=model, data_cfg=data_cfg, init=base, data=data, ctx=ctx,
        kind="causal", split="sft", objective=objectives.causal_lm_objective, paired=False,
    )


def reward_model(cfg: RewardModelConfig, model: ModelConfig, data_cfg: DataConfig, key: str, data: StageResult,
                 sft_model: StageResult, ctx: RunContext) -> StageResult:
    """Bradley-Terry reward model initialised from the SFT backbone."""
    return train_stage(
        stage="reward_model", key=key, cfg=cfg, model=model, data_cfg=data_cfg, init=sft_model, data=data,
        ctx=ctx, kind="scalar", split="preference",
        objective=functools.partial(objectives.pairwise_objective, margin=cfg.margin), paired=True,
    )


sft_task = stage_task(sft, name="sft")
reward_model_task = stage_task(reward_model, name="reward_model")
