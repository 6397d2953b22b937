"""Preflight's Ray check: can a local Ray place each stage's actors at once?

Counted without importing the engines (torch and Ray take ~10 s): a round's
actors as engines/rl/round_placement.py round_resources counts them, a training
stage's workers, an evaluation's engine and scorers; and, where the
evaluations keep their engine for the run (`evaluation.keeps_engine`), the
run's engine host beside every stage (tasks/stages/eval_engine.py). An evaluation
with an engine of its own ends it before its scorer starts: it needs the
larger of the two, not both (one GPU serves configs/gpu-small.yaml).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from alignflow.config import PipelineConfig


def _round_needs(r) -> tuple[float, float, str]:
    """(CPUs, GPUs, what asks) of a round's actors: as engines/rl/round_placement.py round_resources, which
    imports torch and Ray (~10 s); tests/core/test_core_preflight.py holds the two equal."""
    g = r.generation
    scorers = int(r.uses_reference)
    scorers += int(r.reward.uses_model)
    scorers = (min(scorers, 1) if r.colocate_reference_and_reward else scorers) + int(r.reward.uses_process_model)
    parts = [("actor", r.actor.placement.num_cpus, r.actor.placement.num_gpus, r.actor.num_workers),
             ("scorer_placement", r.scorer_placement.num_cpus, r.scorer_placement.num_gpus, scorers),
             ("generation", g.placement.num_cpus, g.gpus_per_engine, r.num_rollout_engines),
             ("reward.judge.generation", r.reward.judge.generation.placement.num_cpus,
              r.reward.judge.generation.gpus_per_engine, int(r.reward.uses_judge))]
    if r.spec.critic:
        parts.append(("critic", r.critic.placement.num_cpus, r.critic.placement.num_gpus, r.critic.num_workers))
    cpus, what = sum(c * n for _, c, _, n in parts), ", ".join(f"{k} {n}x{c:g}" for k, c, _, n in parts if n)
    if r.colocate_all:  # a bundle per actor worker: the CPUs of all on it, one GPU if the actor asks any
        return cpus, float(r.actor.num_workers) * (r.actor.placement.num_gpus > 0), f"actors x CPUs: {what}"
    return cpus, sum(gp * n for _, _, gp, n in parts), f"actors x CPUs: {what}"


def _gpus() -> int:
    """GPUs the local Ray will see. torch.cuda only if torch is already imported (importing it takes
    seconds); otherwise the NVIDIA driver's device list, narrowed by CUDA_VISIBLE_DEVICES."""
    if "torch" in sys.modules:
        return sys.modules["torch"].cuda.device_count()
    count = len(list(Path("/proc/driver/nvidia/gpus").glob("*")))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return count if visible is None else min(count, len([d for d in visible.split(",") if d.strip()]))


def check_slots(cfg: PipelineConfig, found) -> None:
    """Each stage's actors against a local Ray's slots, into preflight's `found` (a cluster,
    infra.ray_address, is checked once Ray is up)."""
    if cfg.infra.ray_address:
        return
    stages = [(f"rounds.{i}", *_round_needs(r)) for i, r in enumerate(cfg.rounds)]
    for name in ("sft", "reward_model", "process_reward_model", "judge"):
        t = getattr(cfg, name)
        if t is not None and (name != "reward_model" or cfg.trains_reward_model):
            p = t.placement
            stages.append((name, p.num_cpus * t.num_workers, p.num_gpus * t.num_workers,
                           f"{name}.num_workers={t.num_workers} x {name}.placement.num_cpus={p.num_cpus:g}"))
    if cfg.evaluation is not None:  # one rollout engine; scorers are actors only when they ask for GPUs
        g, s = cfg.evaluation.generation, cfg.evaluation.scorer_placement
        if cfg.evaluation.keeps_engine:  # held for the whole run, beside every other stage's actors
            stages = [(f, c + g.placement.num_cpus, gp + g.gpus_per_engine,
                       f"{w}; the run's evaluation engine host 1x{g.placement.num_cpus:g}") for f, c, gp, w in stages]
        n = int(s.num_gpus > 0)
        what = f"actors x CPUs: generation 1x{g.placement.num_cpus:g}, scorer_placement {n}x{s.num_cpus:g}"
        if cfg.evaluation.keeps_engine:  # the host keeps its slots while the scorer runs
            stages.append(("evaluation", g.placement.num_cpus + s.num_cpus * n, g.gpus_per_engine + s.num_gpus, what))
        else:  # an engine of its own, gone before the scorer starts (tasks/stages/eval_engine.py): one after the other
            stages.append(("evaluation", max(g.placement.num_cpus, s.num_cpus * n), max(g.gpus_per_engine, s.num_gpus),
                           f"{what}, one after the other"))
    slots, gpus = cfg.infra.ray_num_cpus, _gpus() if any(s[2] > 0 for s in stages) else 0
    for field, cpu, gpu, what in stages:
        if cpu > slots:
            found.fail(field, f"its actors need {cpu:g} CPU slots at once ({what}); the local Ray gets {slots} "
                              f"(infra.ray_num_cpus): lower the placements or counts, or raise infra.ray_num_cpus",
                       also=("infra.ray_num_cpus",))
        elif gpu > gpus:
            found.fail(field, f"its actors need {gpu:g} GPU{'s' * (gpu != 1)} at once; this machine has "
                              f"{gpus}" + (": run it where GPUs are, or set their placements' num_gpus to 0"
                                           if not gpus else ": lower the placements' num_gpus"))
        else:
            found.ok()
