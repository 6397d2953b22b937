"""preference_reference and preference: offline DPO and its family, KTO, or SimPO / ORPO, after SFT.

preference_reference scores every preference row (and KTO's mismatched rows)
with the frozen reference once: `reference_logps.safetensors`, keyed by the
data and the reference only, so changing β or the loss reuses it. The
preference stage then trains like SFT (tasks/stages/train.py: DeepSpeed, mid-stage
checkpoints, resume) with the cached log-probabilities riding in each batch.
SimPO and ORPO have no reference, so no preference_reference stage and no
cached log-probabilities: their batches are the pairs alone.
"""

from __future__ import annotations

import functools
import logging

import torch

from alignflow.config.preference import DPO_LOSS_TYPE, REFERENCE_FREE
from alignflow.records import StageResult
from alignflow.cluster import ensure_ray
from engines import models
from engines.rl.scoring import scoring
from engines.train import objectives
from engines.train import preference as pref
from tasks.context import RunContext, StageOutput, compute_stage
from tasks.stages.data import TokenLimits, load_split, token_limits
from tasks.plan import PlannedStage
from tasks.registry import PreferenceInputs, PreferenceReferenceInputs, PreferenceReferenceStage, PreferenceStage
from tasks.stages.train import train_stage

REFERENCE_FILE = "reference_logps.safetensors"
log = logging.getLogger("alignflow")


def preference_reference(stage: PlannedStage, inputs: PreferenceReferenceInputs, ctx: RunContext) -> StageResult:
    """log π_ref(y | x) of the 2N `main` rows and the 2N `kl` rows (engines/train/preference.py), float32."""
    cfg: PreferenceReferenceStage = stage.config

    def compute(output: StageOutput, run) -> dict[str, float]:
        from safetensors.torch import save_file

        rows = _rows(models.load_tokenizer(ctx.tokenizer_dir(inputs.reference)), inputs, ctx)
        run.log_metrics(rows.metrics())
        if cfg.placement.num_gpus:
            ensure_ray(ctx.infra)
        with scoring(ctx.ref(inputs.reference), None, num_cpus=cfg.placement.num_cpus, num_gpus=cfg.placement.num_gpus,
                     resources=cfg.placement.resources, cpu_cores=cfg.placement.cpu_cores,
                     dtype=cfg.io.dtype, torch_threads=ctx.infra.torch_threads,
                     attn_implementation=cfg.io.attn_implementation, micro_batch_size=cfg.micro_batch_size) as call:
            logps = {name: call("reference_map", batch, pref.sequence_logps)
                     for name, batch in (("main", rows.main), ("kl", rows.kl))}
        save_file({k: v.float().contiguous() for k, v in logps.items()}, str(output.dir / REFERENCE_FILE))
        n = rows.pairs
        return {"preference/pairs": float(n), "preference/unpaired": float(len(rows.desirable) - 2 * n),
                "preference/reference_logp_chosen": logps["main"][:n].mean().item() if n else 0.0,
                "preference/reference_logp_rejected": logps["main"][n : 2 * n].mean().item() if n else 0.0}

    return compute_stage(ctx, stage, compute)


def _rows(tokenizer, inputs, ctx: RunContext, limits: TokenLimits | None = None,
          pairs: list[dict] | None = None) -> pref.PreferenceRows:
    """The pairs and the unpaired examples of the data stage, as rows (the same for both stages)."""
    limits = limits or token_limits(inputs.data)
    pairs = load_split(inputs.data, ctx, "preference") if pairs is None else pairs
    unpaired = load_split(inputs.data, ctx, "preference_unpaired")
    return pref.preference_tensors(tokenizer, pairs, limits.prompt, limits.response, unpaired)


def _with_reference(reference: dict[str, torch.Tensor] | None, loss: str, inputs: PreferenceInputs, ctx: RunContext):
    """`to_tensors` for train_stage: the preference rows with the cached reference log-probabilities (None: a
    reference-free loss's, without). KTO takes every row as an example; the DPO family, SimPO and ORPO the pairs
    (unpaired rows are left out, counted, with a warning)."""

    def to_tensors(tokenizer, records: list[dict], limits: TokenLimits):
        rows = _rows(tokenizer, inputs, ctx, limits, pairs=records)
        kto = loss == "kto"
        total = rows.main["input_ids"].shape[0]
        if reference is not None and reference["main"].shape[0] != total:
            raise RuntimeError(f"the cached reference log-probabilities cover {reference['main'].shape[0]} rows, the "
                               f"preference split gives {total}: rerun the preference_reference stage")
        if kto and rows.kl_own_prompt:
            log.warning("preference: all examples share one prompt, so %d of KTO's KL rows (its reference point "
                        "z0) pair it with its own completions, where z0 wants other prompts'", rows.kl_own_prompt)
        if kto:
            tensors = {**rows.main, "ref_logps": reference["main"], "desirable": rows.desirable,
                       **{f"kl_{k}": v for k, v in rows.kl.items()}, "ref_kl_logps": reference["kl"]}
        else:
            keep = 2 * rows.pairs
            if total > keep:
                log.warning("preference: %d unpaired rows are KTO's; preference.loss=%s trains on the %d pairs",
                            total - keep, loss, rows.pairs)
            tensors = {k: v[:keep] for k, v in rows.main.items()}
            if reference is not None:
                tensors["ref_logps"] = reference["main"][:keep]
        return tensors, _Report(rows.metrics(), 0 if kto else total - 2 * rows.pairs)

    return to_tensors


class _Report:
    """What train_stage logs about the rows (LengthReport's interface)."""

    def __init__(self, metrics: dict[str, float], unused: int):
        self.metrics, self.unused = metrics, unused

    def as_metrics(self, split: str) -> dict[str, float]:
        return self.metrics | {"data/preference_unpaired_unused": float(self.unused)}


def preference(stage: PlannedStage, inputs: PreferenceInputs, ctx: RunContext) -> StageResult:
    """DPO's family (against the cached reference), SimPO or ORPO (without one) on the pairs, or KTO on their
    2N examples and the unpaired ones, from the SFT policy (or the base model)."""
    from safetensors.torch import load_file

    cfg: PreferenceStage = stage.config
    train = cfg.train
    free = train.loss in REFERENCE_FREE
    reference = None if free else load_file(str(ctx.storage().fetch(ctx.uri(inputs.reference)) / REFERENCE_FILE))
    kto = train.loss == "kto"
    packing = train.packing_max_tokens if train.packing else False
    if free:
        objective = functools.partial(pref.reference_free_objective, loss=train.loss, beta=train.beta,
                                      gamma=train.simpo_gamma, packing_max_tokens=packing)
    elif kto:
        objective = pref.KTOObjective(beta=train.beta, desirable_weight=train.desirable_weight,
                                      undesirable_weight=train.undesirable_weight, packing_max_tokens=packing)
    else:
        objective = functools.partial(pref.dpo_objective, loss_type=DPO_LOSS_TYPE[train.loss], beta=train.beta,
                                      label_smoothing=train.label_smoothing, packing_max_tokens=packing,
                                      rpo_alpha=train.rpo_alpha)
    return train_stage(stage, inputs, ctx, kind="causal", split="preference", objective=objective,
                       weigh=objectives.per_row, paired=not kto,
                       to_tensors=_with_reference(reference, train.loss, inputs, ctx))
