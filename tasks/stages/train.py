"""sft, reward_model, process_reward_model (and preference, tasks/stages/preference.py): DeepSpeed training stages
that resume mid-way.

Each tokenizes their split, start a TrainerGroup on Ray, and step through a
deterministic schedule. Every `checkpoint_every` steps the full training
state (weights, optimizer, scheduler, RNG, step) is committed as a mid-stage
checkpoint (tasks/checkpoints.py); a retried task starts from the latest
committed one instead of step 0.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from alignflow.cluster import ensure_ray
from alignflow.records import StageResult
from alignflow.seeds import derive_seed
from engines import batches, models, steps
from engines.train import objectives, packed_objectives, supervised
from engines.train.group import TrainerGroup
from engines.train.packing import check_fits
from engines.train.spec import EngineSpec
from tasks.checkpoints import StageCheckpoints
from tasks.context import RunContext, StageOutput, compute_stage
from tasks.stages.data import load_split, token_limits
from tasks.plan import PlannedStage
from tasks.registry import (PreferenceInputs, PreferenceStage, ProcessRewardModelStage, RewardModelStage, SFTStage,
                            TrainInputs)

log = logging.getLogger("alignflow")


def train_stage(stage: PlannedStage, inputs: TrainInputs | PreferenceInputs, ctx: RunContext, *, kind: str,
                split: str, objective: Callable, weigh: Callable, paired: bool, to_tensors: Callable) -> StageResult:
    """`to_tensors(tokenizer, records, TokenLimits) -> (tensors, LengthReport)`: the split as training rows
    (pairs: chosen rows, then rejected rows); `weigh`: what `objective` averages over (engines/train/objectives.py)."""
    cfg: SFTStage | RewardModelStage | ProcessRewardModelStage | PreferenceStage = stage.config
    train, io = cfg.train, cfg.io
    storage = ctx.storage()

    def compute(out: StageOutput, run) -> dict[str, float]:
        tokenizer = models.load_tokenizer(ctx.tokenizer_dir(inputs.init))  # the workers fetch the weights
        records = load_split(inputs.data, ctx, split)
        tensors, report = to_tensors(tokenizer, records, token_limits(inputs.data))
        if train.packing and train.packing_max_tokens is not None:
            check_fits(tensors, train.packing_max_tokens, f"{stage.name}.packing_max_tokens")
        run.log_metrics(report.as_metrics(split))
        n_rows = tensors["input_ids"].shape[0] // (2 if paired else 1)
        schedule = supervised.plan(n_rows, train.batch_size, train.epochs, train.max_steps,
                                   seed=derive_seed(cfg.seed, "data_order"), field=f"{stage.name}.batch_size",
                                   what=f"{'pairs' if paired else 'rows'} it trains on (the {split} split, less "
                                        f"those left out: data/{split}_overlong_prompts)")
        unseen = schedule.never_trained()
        if unseen:
            log.warning("%s: %s (epochs %g, max_steps %s)", stage.name, schedule.left_out("pairs" if paired else "rows",
                        unseen), train.epochs, train.max_steps)
        run.log_metrics({"train/rows_left_per_epoch": schedule.left_per_epoch, "train/rows_never_trained": unseen})

        ensure_ray(ctx.infra)
        spec = EngineSpec.from_config(train, model_path=ctx.ref(inputs.init), kind=kind, total_steps=schedule.total_steps,
                                      global_batch=train.batch_size, dtype=io.dtype,
                                      torch_threads=ctx.infra.torch_threads, seed=derive_seed(cfg.seed, "engine"),
                                      attn_implementation=io.attn_implementation)
        group = TrainerGroup(spec, train.num_workers)
        checkpoints = StageCheckpoints(storage, out.uri, stage.name, train.checkpoint_every)
        failed = True  # until the model is saved: what raised may have left a rank's call running
        try:
            start = checkpoints.resume(lambda ref: int(group.load_state(ref)["step"]), run, schedule.total_steps)
            run.set_tag("alignflow.total_steps", str(schedule.total_steps))  # the CLI's progress display
            history: list[dict[str, float]] = []

            def after_step(step: int, m: dict[str, float]) -> None:
                history.append(m)
                if step % train.log_every == 0 or step == schedule.total_steps:
                    run.log_metrics({f"train/{k}": v for k, v in m.items()} | {"progress/step": step}, step=step)
                if checkpoints.due(step, schedule.total_steps):
                    checkpoints.save(step, lambda ref: group.save_state(ref, {"step": step}))
                    run.log_metrics({"progress/step": step}, step=step)  # where an interrupt's line says it stopped

            steps_run = supervised.fit(group, tensors, schedule, objective, weigh, paired=paired, start_step=start,
                                       after_step=after_step)
            out.add(group.save_hf(out.ref))  # uploaded by rank 0, from its node
            failed = False
        finally:
            group.shutdown(failed=failed)
        tail = history[-min(len(history), 10):] or [{}]
        summary = {f"train/final_{k}": sum(h[k] for h in tail) / len(tail) for k in tail[0]}
        summary.update({"train/steps": float(schedule.total_steps), "train/steps_run": float(steps_run),
                        "train/resumed_from_step": float(start)})
        run.log_metrics(summary)
        return summary

    return compute_stage(ctx, stage, compute)


def causal_lm_objective(train, **options) -> Callable:
    """The next-token loss of an SFT-like stage (SFT, the judge): packed rows where `train.packing` says;
    `options` (SFT's objective and NEFTune alpha) reach it."""
    if train.packing:
        return functools.partial(packed_objectives.packed_causal_lm_objective, max_tokens=train.packing_max_tokens,
                                 **options)
    return functools.partial(objectives.causal_lm_objective, **options)


def sft(stage: PlannedStage, inputs: TrainInputs, ctx: RunContext) -> StageResult:
    """Supervised fine-tuning of the base model on demonstrations."""
    train = stage.config.train
    objective = causal_lm_objective(train, loss=train.objective, neftune_alpha=train.neftune_alpha)
    tensors = functools.partial(batches.sft_tensors, assistant_turns=train.train_on == "assistant_turns")
    return train_stage(stage, inputs, ctx, kind="causal", split="sft", objective=objective,
                       weigh=objectives.response_tokens, paired=False, to_tensors=_limited(tensors))


def reward_model(stage: PlannedStage, inputs: TrainInputs, ctx: RunContext) -> StageResult:
    """Bradley-Terry reward model initialised from the SFT (or base) backbone."""
    train = stage.config.train
    objective = (functools.partial(packed_objectives.packed_pairwise_objective, margin=train.margin,
                                   max_tokens=train.packing_max_tokens)
                 if train.packing else functools.partial(objectives.pairwise_objective, margin=train.margin))
    return train_stage(stage, inputs, ctx, kind="scalar", split="preference", objective=objective,
                       weigh=objectives.per_row, paired=True, to_tensors=_limited(batches.pair_tensors))


def process_reward_model(stage: PlannedStage, inputs: TrainInputs, ctx: RunContext) -> StageResult:
    """A process reward model from the SFT (or base) backbone: a score at the end of every step of a solution,
    trained toward its label (engines/steps.py)."""
    return train_stage(stage, inputs, ctx, kind="scalar", split="process", objective=steps.stepwise_objective,
                       weigh=steps.steps, paired=False, to_tensors=_limited(steps.stepwise_tensors))


def _limited(fn: Callable) -> Callable:
    """A `(tokenizer, records, max_prompt_tokens, max_response_tokens)` builder as a `to_tensors`."""
    return lambda tokenizer, records, limits: fn(tokenizer, records, limits.prompt, limits.response)
