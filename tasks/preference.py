"""preference_reference and preference: offline DPO / IPO / cDPO / KTO after SFT.

preference_reference scores every preference row (and KTO's mismatched rows)
with the frozen reference once: `reference_logps.safetensors`, keyed by the
data and the reference only, so changing β or the loss reuses it. The
preference stage then trains like SFT (tasks/train.py: DeepSpeed, mid-stage
checkpoints, resume) with the cached log-probabilities riding in each batch.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from alignflow.config.preference import DPO_LOSS_TYPE
from alignflow.records import StageResult
from alignflow.cluster import ensure_ray
from engines import models
from engines import preference as pref
from engines.scoring import scoring
from tasks.context import RunContext, compute_stage
from tasks.data import TokenLimits, load_split, token_limits
from tasks.plan import PlannedStage
from tasks.registry import PreferenceInputs, PreferenceReferenceInputs, PreferenceReferenceStage, PreferenceStage
from tasks.train import train_stage

REFERENCE_FILE = "reference_logps.safetensors"


def preference_reference(stage: PlannedStage, inputs: PreferenceReferenceInputs, ctx: RunContext) -> StageResult:
    """log π_ref(y | x) of the 2N `main` rows and the 2N `kl` rows (engines/preference.py), float32."""
    cfg: PreferenceReferenceStage = stage.config
    storage = ctx.storage()

    def compute(out: Path, run, uri: str) -> dict[str, float]:
        from safetensors.torch import save_file

        ref_path = str(storage.fetch(inputs.reference.uri))
        limits = token_limits(inputs.data)
        main, kl, report = pref.preference_tensors(models.load_tokenizer(ref_path),
                                                   load_split(inputs.data, ctx, "preference"),
                                                   limits.prompt, limits.response)
        run.log_metrics(report.as_metrics("preference"))
        if cfg.placement.num_gpus:
            ensure_ray(ctx.infra)
        with scoring(ref_path, None, num_cpus=cfg.placement.num_cpus, num_gpus=cfg.placement.num_gpus,
                     dtype=cfg.io.dtype, torch_threads=ctx.infra.torch_threads,
                     attn_implementation=cfg.io.attn_implementation, micro_batch_size=cfg.micro_batch_size) as call:
            logps = {name: call("reference_map", rows, pref.sequence_logps) for name, rows in (("main", main),
                                                                                               ("kl", kl))}
        save_file({k: v.float().contiguous() for k, v in logps.items()}, str(out / REFERENCE_FILE))
        n = main["input_ids"].shape[0] // 2
        return {"preference/pairs": float(n), "preference/reference_logp_chosen": logps["main"][:n].mean().item(),
                "preference/reference_logp_rejected": logps["main"][n:].mean().item()}

    return compute_stage(ctx, stage, compute)


def _with_reference(reference: dict[str, torch.Tensor], kto: bool):
    """`to_tensors` for train_stage: the preference rows with the cached reference log-probabilities."""

    def to_tensors(tokenizer, records: list[dict], limits: TokenLimits):
        main, kl, report = pref.preference_tensors(tokenizer, records, limits.prompt, limits.response)
        rows = main["input_ids"].shape[0]
        if reference["main"].shape[0] != rows:
            raise RuntimeError(f"the cached reference log-probabilities cover {reference['main'].shape[0]} rows, the "
                               f"preference split gives {rows}: rerun the preference_reference stage")
        tensors = {**main, "ref_logps": reference["main"]}
        if kto:
            tensors.update({f"kl_{k}": v for k, v in kl.items()}, ref_kl_logps=reference["kl"],
                           desirable=torch.arange(rows) < rows // 2)
        return tensors, report

    return to_tensors


def preference(stage: PlannedStage, inputs: PreferenceInputs, ctx: RunContext) -> StageResult:
    """DPO / IPO / cDPO on pairs, or KTO on their 2N examples, from the SFT policy (or the base model)."""
    from safetensors.torch import load_file

    cfg: PreferenceStage = stage.config
    train = cfg.train
    reference = load_file(str(ctx.storage().fetch(inputs.reference.uri) / REFERENCE_FILE))
    kto = train.loss == "kto"
    packing = train.packing_max_tokens if train.packing else False
    if kto:
        objective = functools.partial(pref.kto_objective, beta=train.beta, desirable_weight=train.desirable_weight,
                                      undesirable_weight=train.undesirable_weight, packing_max_tokens=packing)
    else:
        objective = functools.partial(pref.dpo_objective, loss_type=DPO_LOSS_TYPE[train.loss], beta=train.beta,
                                      label_smoothing=train.label_smoothing, packing_max_tokens=packing)
    return train_stage(stage, inputs, ctx, kind="causal", split="preference", objective=objective, paired=not kto,
                       to_tensors=_with_reference(reference, kto))
