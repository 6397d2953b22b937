"""sft and reward_model: DeepSpeed training stages that resume mid-way.

Both tokenize their split, start a TrainerGroup on Ray, and step through a
deterministic schedule. Every `checkpoint_every` steps the full training
state (weights, optimizer, scheduler, RNG, step) is committed as a mid-stage
checkpoint (tasks/checkpoints.py); a retried task starts from the latest
committed one instead of step 0.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from alignflow.cluster import ensure_ray
from alignflow.records import StageResult
from alignflow.seeds import derive_seed
from engines import batches, models, objectives, supervised
from engines.trainer import EngineSpec, TrainerGroup
from tasks.checkpoints import StageCheckpoints
from tasks.context import RunContext, compute_stage
from tasks.data import load_split, token_limits
from tasks.plan import PlannedStage
from tasks.registry import RewardModelStage, SFTStage, TrainInputs


def train_stage(stage: PlannedStage, inputs: TrainInputs, ctx: RunContext, *, kind: str, split: str,
                objective: Callable, paired: bool) -> StageResult:
    cfg: SFTStage | RewardModelStage = stage.config
    train, io = cfg.train, cfg.io
    storage = ctx.storage()

    def compute(out: Path, run, uri: str) -> dict[str, float]:
        init_path = str(storage.fetch(inputs.init.uri))
        tokenizer = models.load_tokenizer(init_path)
        records = load_split(inputs.data, ctx, split)
        to_tensors = batches.pair_tensors if paired else batches.sft_tensors
        limits = token_limits(inputs.data)
        tensors, report = to_tensors(tokenizer, records, limits.prompt, limits.response)
        run.log_metrics(report.as_metrics(split))
        n_rows = tensors["input_ids"].shape[0] // (2 if paired else 1)
        schedule = supervised.plan(n_rows, train.batch_size, train.epochs, train.max_steps,
                                   seed=derive_seed(cfg.seed, "data_order"))

        ensure_ray(ctx.infra)
        spec = EngineSpec.from_config(train, model_path=init_path, kind=kind, total_steps=schedule.total_steps,
                                      global_batch=train.batch_size, dtype=io.dtype,
                                      torch_threads=ctx.infra.torch_threads, seed=derive_seed(cfg.seed, "engine"),
                                      attn_implementation=io.attn_implementation)
        group = TrainerGroup(spec, train.num_workers)
        checkpoints = StageCheckpoints(storage, uri, stage.name, train.checkpoint_every)
        try:
            start = checkpoints.resume(lambda d: int(group.load_state(str(d))["step"]), run)
            run.set_tag("alignflow.total_steps", str(schedule.total_steps))  # the CLI's progress display
            history: list[dict[str, float]] = []

            def after_step(step: int, m: dict[str, float]) -> None:
                history.append(m)
                if step % train.log_every == 0 or step == schedule.total_steps:
                    run.log_metrics({f"train/{k}": v for k, v in m.items()} | {"progress/step": step}, step=step)
                if checkpoints.due(step, schedule.total_steps):
                    checkpoints.save(step, lambda tmp: group.save_state(tmp, {"step": step}))

            steps_run = supervised.fit(group, tensors, schedule, objective, paired=paired, start_step=start,
                                       after_step=after_step)
            group.save_hf(str(out))
        finally:
            group.shutdown()
        tail = history[-min(len(history), 10):] or [{}]
        summary = {f"train/final_{k}": sum(h[k] for h in tail) / len(tail) for k in tail[0]}
        summary.update({"train/steps": float(schedule.total_steps), "train/steps_run": float(steps_run),
                        "train/resumed_from_step": float(start)})
        run.log_metrics(summary)
        return summary

    return compute_stage(ctx, stage, compute)


def sft(stage: PlannedStage, inputs: TrainInputs, ctx: RunContext) -> StageResult:
    """Supervised fine-tuning of the base model on demonstrations."""
    return train_stage(stage, inputs, ctx, kind="causal", split="sft", objective=objectives.causal_lm_objective,
                       paired=False)


def reward_model(stage: PlannedStage, inputs: TrainInputs, ctx: RunContext) -> StageResult:
    """Bradley-Terry reward model initialised from the SFT (or base) backbone."""
    cfg: RewardModelStage = stage.config
    return train_stage(stage, inputs, ctx, kind="scalar", split="preference",
                       objective=functools.partial(objectives.pairwise_objective, margin=cfg.train.margin),
                       paired=True)
