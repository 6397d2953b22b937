"""distill_teacher, distill: offline distillation of a teacher into the SFT policy on the SFT data.

distill_teacher runs the teacher once over the SFT split (as the student's tokenizer renders it) and
keeps its top-k next-token log-probs at every response position, one column per response token
(objectives.loss_columns: the split's padding and prompts take no room); it is cached per data, teacher and
k, so that a change of the student's training settings does not run the teacher again. distill then
fine-tunes SFT on the same rows toward them (engines/train/objectives.py topk_distill_objective). A
teacher token the student's output layer has no row for (a larger, padded vocabulary) is left out of the
top-k and counted, when the teacher's pass is kept and again when it is read. The pass is written into its
file piece by piece and read back mapped (engines/tensor_files.py): neither stage holds all of it in memory.
"""

from __future__ import annotations

import functools
import logging
import math

import torch

from alignflow.cluster import ensure_ray
from alignflow.errors import ConfigError
from alignflow.records import StageResult
from engines import batches, models, tensor_files
from engines.rl.scoring import scoring
from engines.train import objectives
from tasks.context import RunContext, StageOutput, compute_stage
from tasks.stages.data import load_split, token_limits
from tasks.plan import PlannedStage
from tasks.registry import DistillTeacherInputs, DistillTeacherStage, OfflineDistillInputs
from tasks.stages.rl_round import same_vocabulary, teacher_fits
from tasks.stages.train import train_stage

log = logging.getLogger("alignflow")

TEACHER_FILE = "teacher_topk.safetensors"
PIECE_BYTES = 2**28  # rows of the teacher's top-k computed, checked and written at a time (8 bytes an entry)
# The log-prob given to a teacher's top-k token the student has no output row for: e^-10000 is 0 in
# float32, so the renormalised top-k leaves it out, while the KL's q * (log q - s) stays finite (0).
NO_STUDENT_ROW = -1e4


def drop_ids_past(logprobs: torch.Tensor, ids: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A teacher's top-k (logprobs, ids: (B, W, k), loss_columns' layout) without the ids the student's
    output layer has no row for (a teacher's padded vocabulary can be larger): each such entry's id becomes
    0 and its log-prob NO_STUDENT_ROW, in new tensors. A student's gather at such an id would fail (on a
    GPU, a device-side assert that ends the run). Also returns what was dropped: `entries`, the teacher's
    probability `mass` on them, and `positions` (B, W) bool, the columns where no entry is left to learn
    from."""
    past = ids >= rows
    dropped = {"entries": int(past.sum()), "mass": float(logprobs[past].exp().sum())}
    if dropped["entries"]:
        logprobs = torch.where(past, torch.full_like(logprobs, NO_STUDENT_ROW), logprobs)
        ids = torch.where(past, torch.zeros_like(ids), ids)
    # Dropped now, or when the teacher's pass was kept (a cache read back): every entry NO_STUDENT_ROW.
    dropped["positions"] = (logprobs == NO_STUDENT_ROW).all(-1)
    return logprobs, ids, dropped


def rows_a_piece(shape: tuple[int, ...]) -> int:
    """Rows of a (rows, width, k) top-k of 8-byte entries that make at most PIECE_BYTES (at least one)."""
    return max(1, PIECE_BYTES // max(1, math.prod(shape[1:]) * 8))


def dropped_in_all(parts: list[dict], shape: tuple[int, ...]) -> dict:
    """drop_ids_past's accounts of consecutive pieces of rows as one, for a top-k of `shape`."""
    return {"entries": sum(p["entries"] for p in parts), "mass": sum(p["mass"] for p in parts),
            "positions": torch.cat([p["positions"] for p in parts]) if parts else torch.zeros(shape[:2],
                                                                                            dtype=torch.bool)}


def dropped_by_rows(logprobs: torch.Tensor, ids: torch.Tensor, rows: int) -> dict:
    """drop_ids_past over pieces of rows (rows_a_piece), its results written back in place: a whole cache's
    temporaries are never held at once, and a mapped cache (tensor_files.mapped) keeps the file's pages where
    nothing is dropped. Returns what was dropped, as drop_ids_past."""
    per, parts = rows_a_piece(ids.shape), []
    for i in range(0, len(ids), per):
        new_logprobs, new_ids, dropped = drop_ids_past(logprobs[i:i + per], ids[i:i + per], rows)
        if dropped["entries"]:
            logprobs[i:i + per], ids[i:i + per] = new_logprobs, new_ids
        parts.append(dropped)
    return dropped_in_all(parts, ids.shape)


def _say_dropped(stage: str, dropped: dict, k: int) -> None:
    empty = int(dropped["positions"].sum())
    if dropped["entries"] or empty:
        log.warning("%s: %d of the teacher's top-%d tokens (probability mass %.3g in all) have no row in the "
                    "student's output layer and are left out; %d positions keep none and train on nothing",
                    stage, dropped["entries"], k, dropped["mass"], empty)


def _sft_rows(tokenizer, data: StageResult, ctx: RunContext):
    limits = token_limits(data)
    return batches.sft_tensors(tokenizer, load_split(data, ctx, "sft"), limits.prompt, limits.response)


def distill_teacher(stage: PlannedStage, inputs: DistillTeacherInputs, ctx: RunContext) -> StageResult:
    cfg: DistillTeacherStage = stage.config

    def compute(output: StageOutput, run) -> dict[str, float]:
        student_dir = ctx.tokenizer_dir(inputs.student)
        student = models.load_tokenizer(student_dir)
        teacher_dir = ctx.tokenizer_dir(inputs.teacher)
        same_vocabulary(student, models.load_tokenizer(teacher_dir), "distill.teacher")
        tensors, report = _sft_rows(student, inputs.data, ctx)
        columns = objectives.loss_columns(tensors["loss_mask"])
        teacher_fits(student_dir, teacher_dir, tensors["input_ids"].shape[1], "distill.teacher", sampled=False)
        run.log_metrics(report.as_metrics("sft"))
        p = cfg.placement
        if p.num_gpus:
            ensure_ray(ctx.infra)
        # Written piece by piece into the file, which is the cache: the whole of it (rows x width x k x 8
        # bytes, 13 GB at 20k rows of 4096 tokens and k = 20) is never in memory at once.
        shape = (*columns.shape, cfg.top_k)
        cache = tensor_files.create(output.dir / TEACHER_FILE, {"logprobs": (shape, torch.float32),
                                                                "ids": (shape, torch.int32),
                                                                "positions": (columns.shape, torch.int32)})
        cache["positions"].copy_(columns)
        per, rows = rows_a_piece(shape), models.output_rows(student_dir)
        mass, dropped = 0.0, []
        topk = functools.partial(objectives.topk_next_tokens, k=cfg.top_k, width=columns.shape[1])
        with scoring(ctx.ref(inputs.teacher), None, num_cpus=p.num_cpus, num_gpus=p.num_gpus, resources=p.resources,
                     cpu_cores=p.cpu_cores,
                     dtype=cfg.io.dtype, torch_threads=ctx.infra.torch_threads,
                     attn_implementation=cfg.io.attn_implementation, micro_batch_size=cfg.scoring_micro_batch_size,
                     micro_batch_tokens=cfg.scoring_micro_batch_tokens) as call:
            for start in range(0, shape[0], per):
                top = call("reference_map", batches.take(tensors, torch.arange(start, min(start + per, shape[0]))),
                           topk)
                logprobs, ids, piece = drop_ids_past(top[..., 0].float(), top[..., 1].to(torch.int32), rows)
                dropped.append(piece)
                cache["logprobs"][start:start + per], cache["ids"][start:start + per] = logprobs, ids
                mass += float(logprobs.exp().sum(-1)[columns[start:start + per] >= 0].sum())
        del cache
        dropped = dropped_in_all(dropped, shape)
        _say_dropped(stage.name, dropped, cfg.top_k)
        mask = columns >= 0
        metrics = {"distill/rows": float(mask.shape[0]), "distill/positions": float(mask.sum()),
                   "distill/teacher_ids_past_student": float(dropped["entries"]),
                   # the teacher's probability mass in its top-k, the mean over positions
                   "distill/teacher_topk_mass": mass / max(1, int(mask.sum()))}
        run.log_metrics(metrics)
        return metrics

    return compute_stage(ctx, stage, compute)


def with_teacher(tensors: dict[str, torch.Tensor], cached: dict[str, torch.Tensor], output_rows: int,
                 where: str) -> dict[str, torch.Tensor]:
    """SFT rows (sft_tensors) with the teacher's cached top-k of them (distill_teacher's file), as
    topk_distill_objective reads them. The cache must hold these rows' response positions; its ids past the
    student's `output_rows` are dropped and counted again (a cache written for another student), and a
    position left with none is taken out of the loss mask."""
    columns = objectives.loss_columns(tensors["loss_mask"])
    kept_at = cached.get("positions")
    if kept_at is None or not torch.equal(kept_at.long(), columns):
        raise ConfigError(f"{where}: the teacher's cached response positions are not the SFT rows' "
                          f"({int((columns >= 0).sum())} in {len(columns)} rows); rerun distill_teacher")
    logprobs, ids = cached["logprobs"], cached["ids"]
    dropped = dropped_by_rows(logprobs, ids, output_rows)  # in place: a mapped cache's pages copied where changed
    _say_dropped(where, dropped, ids.shape[-1])
    loss_mask = tensors["loss_mask"].clone()
    empty = dropped["positions"]
    loss_mask[:, 1:][empty.nonzero(as_tuple=True)[0], columns[empty]] = 0
    return {**tensors, "loss_mask": loss_mask, "teacher_ids": ids, "teacher_logprobs": logprobs,
            "teacher_positions": columns}


def distill(stage: PlannedStage, inputs: OfflineDistillInputs, ctx: RunContext) -> StageResult:
    """SFT's policy trained toward the cached teacher distributions, row for row."""
    def to_tensors(tokenizer, records, limits):
        tensors, report = batches.sft_tensors(tokenizer, records, limits.prompt, limits.response)
        # Mapped: each step reads its rows from the file (kept on local disk by the storage's fetch).
        cached = tensor_files.mapped(ctx.storage().fetch(ctx.uri(inputs.teacher)) / TEACHER_FILE)
        return with_teacher(tensors, cached, models.output_rows(ctx.tokenizer_dir(inputs.init)), stage.name), report

    return train_stage(stage, inputs, ctx, kind="causal", split="sft", objective=objectives.topk_distill_objective,
                       weigh=objectives.response_tokens, paired=False, to_tensors=to_tensors)
