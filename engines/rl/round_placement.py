"""Where a round's models come from (RoundSetup) and where its actors go: which of them start, the Ray slots
they take, and how colocation shares its bundles (engines/rl/round_models.py starts them there;
alignflow/preflight/slots.py counts the same slots without importing this)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import ray

from alignflow.config import RoundConfig
from alignflow.errors import InsufficientResourcesError
from alignflow.store.artifacts import Source

log = logging.getLogger("alignflow")


@dataclass(frozen=True)
class RoundSetup:
    """Where a round's models come from, and how its actors run. Models are refs to committed
    artifacts, which each actor fetches on its own node, or directories on every node (tests)."""

    policy_path: Source  # where this round starts (the previous round, SFT or the base model)
    reference_path: Source | None  # the frozen KL reference (algorithms that use one)
    reward_path: Source | None  # the reward model (scoring, or a critic's start)
    prompts: list[tuple[list[int], dict]]  # (prompt ids, record with "answer")
    dtype: str
    torch_threads: int
    max_model_len: int
    seed: int  # the round's stage seed
    attn_implementation: str = "sdpa"  # model.attn_implementation
    judge_path: Source | None = None  # the generative judge (a judge reward source)
    process_reward_path: Source | None = None  # the process reward model (a process_model source)
    step_separator: str = "\n"  # where it splits a response into steps (its data's)
    judge_max_model_len: int | None = None  # the judge's positions
    # On a cluster that may grow (infra.ray_address: an autoscaler, spot nodes coming back), how long a round short
    # of resources waits for nodes before it refuses; 0 on a local Ray, which cannot grow (preflight checked it).
    nodes_wait_s: float = 0.0


RoundSetupLike = Any  # a RoundSetup, or anything with its policy_path and reference_path (sizing, tests)


def reference_is_actor(cfg: RoundConfig, setup: RoundSetupLike | None) -> bool:
    """With LoRA on the actor and a round that starts from its reference (the first round after SFT or the
    preference stage), the reference is the actor's frozen base with its adapters disabled, not a second
    copy in a scorer. Later rounds start elsewhere and keep a reference scorer. Without a setup (sizing a
    round before its inputs exist) a scorer is counted."""
    return (setup is not None and cfg.uses_reference and cfg.actor.lora is not None
            and setup.reference_path == setup.policy_path)


def _scorers(cfg: RoundConfig, setup: RoundSetupLike | None = None) -> int:
    """How many scorer actors the round starts: reference and/or reward model, shared when colocated, and the
    process reward model's, never shared."""
    wanted = int(cfg.uses_reference and not reference_is_actor(cfg, setup)) + int(cfg.reward.uses_model)
    return (min(wanted, 1) if cfg.colocate_reference_and_reward else wanted) + int(cfg.reward.uses_process_model)


def round_resources(cfg: RoundConfig, setup: RoundSetupLike | None = None) -> dict[str, float]:
    """Total CPU/GPU slots (and custom resources) of a round's actors (trainers, scorers, rollout
    engines). Colocated, the GPUs are the bundles' (one per actor worker), whatever the shares. `setup`: the
    round's inputs, where known (a reference that is the actor's own base starts no scorer)."""
    g = cfg.generation
    if cfg.colocate_all:
        parts = [({"GPU": 0.0, **b}, 1) for b in colocated_bundles(cfg, setup)]
    else:
        j = cfg.reward.judge.generation
        parts = [(_slots(cfg.actor.placement), cfg.actor.num_workers),
                 (_slots(cfg.scorer_placement), _scorers(cfg, setup)),
                 ({**_slots(g.placement), "GPU": g.gpus_per_engine}, cfg.num_rollout_engines),
                 ({**_slots(j.placement), "GPU": j.gpus_per_engine}, int(cfg.reward.uses_judge))]
        if cfg.spec.critic:
            parts.append((_slots(cfg.critic.placement), cfg.critic.num_workers))
    total: dict[str, float] = {"CPU": 0.0, "GPU": 0.0}
    for slots, n in parts:
        for k, v in slots.items():
            total[k] = total.get(k, 0.0) + v * n
    return total


def _slots(p) -> dict[str, float]:
    return {"CPU": p.num_cpus, "GPU": p.num_gpus, **p.resources}


def _kinds_on_bundle(cfg: RoundConfig, index: int, setup: RoundSetupLike | None = None) -> list[tuple[str, float]]:
    """(kind, CPUs) of the actors that colocation puts on bundle `index` (the scorers and the judge's engine on 0)."""
    kinds = [("actor", cfg.actor.placement.num_cpus), ("engine", cfg.generation.placement.num_cpus)]
    if cfg.spec.critic:
        kinds.append(("critic", cfg.critic.placement.num_cpus))
    if index == 0:
        kinds += [("scorer", cfg.scorer_placement.num_cpus)] * _scorers(cfg, setup)
        kinds += [("judge", cfg.reward.judge.generation.placement.num_cpus)] * int(cfg.reward.uses_judge)
    return kinds


def colocated_bundles(cfg: RoundConfig, setup: RoundSetupLike | None = None) -> list[dict[str, float]]:
    """One bundle per actor worker: the CPUs of everything placed on it, and one GPU when the
    actor's placement asks for GPUs (on a CPU-only cluster the bundles hold CPUs alone)."""
    gpu = {"GPU": 1.0} if cfg.actor.placement.num_gpus > 0 else {}
    return [{"CPU": sum(c for _, c in _kinds_on_bundle(cfg, i, setup)), **gpu, **cfg.actor.placement.resources}
            for i in range(cfg.actor.num_workers)]


def gpu_share(cfg: RoundConfig, setup: RoundSetupLike | None = None) -> float:
    """The GPU fraction of each colocated actor: the bundle's GPU split evenly among the most
    crowded bundle's actors (bundle 0, which also holds the scorers); 0 without GPUs."""
    return 1.0 / len(_kinds_on_bundle(cfg, 0, setup)) if cfg.actor.placement.num_gpus > 0 else 0.0


def engines_share_a_gpu(cfg: RoundConfig) -> bool:
    """Whether a rollout engine may share a GPU with another of the round's actors (colocate_all, or a
    fractional GPU anywhere): then its start waits for the trainers. Otherwise every actor starts at once."""
    places = [cfg.actor.placement, cfg.critic.placement, cfg.scorer_placement, cfg.generation.placement]
    return cfg.colocate_all or any(0 < p.num_gpus < 1 for p in places)


def check_resources(cfg: RoundConfig, setup: RoundSetupLike | None = None, *, wait_s: float = 0.0,
                    poll_s: float = 10.0) -> None:
    """Fail before starting anything: an actor Ray cannot place would wait forever. On a cluster whose nodes may
    come back (`wait_s`: a preempted spot node replaced, a worker restarted, as under the last attempt), wait up
    to `wait_s` for them first, saying so. It asks no autoscaler for nodes (no demand is pending while it
    waits): a node group scaled to zero needs its minimum raised."""
    need, start, said = round_resources(cfg, setup), time.monotonic(), None
    while True:
        total = ray.cluster_resources()
        short = {k: (v, total.get(k, 0.0)) for k, v in need.items() if v > total.get(k, 0.0)}
        if not short:
            return
        detail = ", ".join(f"{k}: needs {v:g}, cluster has {have:g}" for k, (v, have) in short.items())
        waited = time.monotonic() - start
        if waited >= wait_s:
            break
        if said is None or waited - said >= 60:
            said = waited
            log.warning("round (%s): waiting up to %.0f s for the cluster to grow (%s)", cfg.algorithm, wait_s,
                        detail)
        time.sleep(min(poll_s, wait_s - waited))
    raise InsufficientResourcesError(
        f"round ({cfg.algorithm}) cannot be placed on this Ray cluster ({detail}"
        f"{f'; waited {waited:.0f} s for nodes' if wait_s else ''}); lower the placements "
        f"(actor/critic/generation/scorer_placement), the worker or engine counts, or infra.ray_num_cpus")
