"""Settings a run will not read, said as preflight notes: a section of the config that its round's algorithm
or engine has no use for, left in by a switch of `algorithm` or `backend` (an override on a file written for
another). Not refused: the switch is the user's, and what it leaves unread is harmless, but never silent.
Likewise a correction turned off where a round needs it: stale asynchronous samples without ppo.tis_cap, and
gradients summed in bf16 (ZeRO-0/1 in a half dtype)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from alignflow.config import EngineConfig, PipelineConfig
from alignflow.config.base import fp32_gradient_sums
from alignflow.config.preference import REFERENCE_FREE
from alignflow.preflight.findings import Findings


def changed(given: BaseModel, default: BaseModel, prefix: str) -> list[str]:
    """The dotted fields (under `prefix`) where `given` differs from `default`."""

    def walk(a: Any, b: Any, at: str) -> list[str]:
        if isinstance(a, dict) and isinstance(b, dict):
            return [f for k in a if k in b for f in walk(a[k], b[k], f"{at}.{k}")]
        return [at] if a != b else []

    return walk(given.model_dump(mode="json"), default.model_dump(mode="json"), prefix)


def note_unused_settings(cfg: PipelineConfig, found: Findings) -> None:
    unused: list[tuple[list[str], str]] = []
    stale, idle = [], set()  # async rounds without tis_cap; critics nothing trains
    for i, r in enumerate(cfg.rounds):
        at = f"rounds.{i}"
        if not r.spec.critic:
            idle.add(f"{at}.critic")
            unused.append((changed(r.critic, type(r.critic)(), f"{at}.critic"), f"{r.algorithm} has no critic"))
        if not r.partial_rollouts:
            default = type(r).model_fields["partial_tokens"].default
            unused.append(([f"{at}.partial_tokens"] * (r.partial_tokens != default),
                           "it sizes partial_rollouts' pieces, which are off"))
        unused.append(_vllm(r.generation, f"{at}.generation"))
        if r.async_rollouts and r.ppo.tis_cap is None:
            stale.append(
                f"{at}.ppo.tis_cap: null: async_rollouts trains on samples up to max_staleness={r.max_staleness} "
                f"update(s) old with no importance-sampling correction for the policy that sampled them "
                f"({found.sources.of(f'{at}.ppo.tis_cap')})")
    if cfg.evaluation is not None:
        unused.append(_vllm(cfg.evaluation.generation, "evaluation.generation"))
    if cfg.process_reward_model is None:
        steps = (("data.process", cfg.data.process is not None), ("data.synthetic.num_process",
                                                                   cfg.data.synthetic.num_process > 0))
        unused.append(([f for f, given in steps if given], "no process_reward_model trains on step-labelled solutions"))
    if (pref := cfg.preference) is not None and pref.loss in REFERENCE_FREE:
        defaults = type(pref)(loss=pref.loss)
        unused.append(([f"preference.{n}" for n in ("reference_placement", "reference_micro_batch_size")
                        if getattr(pref, n) != getattr(defaults, n)], f"preference.loss {pref.loss} has no reference"))
    found.notes += [f"{', '.join(fields)}: not used ({why}) ({found.sources.of(fields[0])})"
                    for fields, why in unused if fields] + stale
    half = [(at, e) for at, e in engines(cfg, "")
            if at not in idle and not fp32_gradient_sums(e.zero_stage, e.offload, cfg.model.dtype)]
    if low := [at for at, e in half if e.zero_stage < 2]:
        found.notes.append(
            f"{', '.join(f'{at}.zero_stage' for at in low)}: under 2 with model.dtype {cfg.model.dtype}, a step's "
            f"micro-batch gradients are summed in {cfg.model.dtype}, losing precision as micro-batches add up "
            "(DeepSpeed sums them in fp32 at ZeRO-2 and 3, where alignflow asks it to; at 0 it cannot, and at 1 "
            "it would take an optimizer alignflow does not drive): zero_stage 2 sums them in fp32, 4 bytes a "
            f"parameter shared among the ranks ({found.sources.of(f'{low[0]}.zero_stage')})")
    if offloaded := [at for at, e in half if e.zero_stage >= 2]:
        found.notes.append(
            f"{', '.join(f'{at}.offload' for at in offloaded)}: with the optimizer offloaded, a step's micro-batch "
            f"gradients are summed in {cfg.model.dtype}, losing precision as micro-batches add up (DeepSpeed would "
            "keep fp32 sums on the GPU, 4 bytes a parameter per rank, the memory offload frees); fewer, larger "
            f"micro-batches add fewer times ({found.sources.of(f'{offloaded[0]}.offload')})")


def engines(model: BaseModel, at: str):
    """(dotted field, EngineConfig) of every training engine set in `model`, its rounds' included."""
    for name, value in model:
        where = f"{at}{name}"
        for i, item in enumerate(value if isinstance(value, list) else [value]):
            field = f"{where}.{i}" if isinstance(value, list) else where
            if isinstance(item, EngineConfig):
                yield field, item
            elif isinstance(item, BaseModel):
                yield from engines(item, f"{field}.")


def _vllm(generation, at: str) -> tuple[list[str], str]:
    if generation.backend == "vllm":
        return [], ""
    return changed(generation.vllm, type(generation.vllm)(), f"{at}.vllm"), "generation.backend is hf, not vllm"
