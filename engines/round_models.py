"""The actors of one RL round, started from its algorithm's spec.

    actor      TrainerGroup (DeepSpeed)                       always
    critic     TrainerGroup, from the reward model or policy   spec.critic
    reference  ScorerActor (frozen policy)                     spec.reference
    rewarder   ScorerActor (reward model)                      reward.source = model
    engines    rollout actors (vLLM, or HF generate)           num_rollout_engines

Reference and reward model share one scorer actor when colocated. What
crosses an actor boundary is CPU tensors; the round never sees a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ray
import torch

from alignflow.config import RoundConfig
from alignflow.errors import InsufficientResourcesError
from alignflow.seeds import derive_seed
from engines.rollout import Rollout, Sampling, start_rollout_actor
from engines.scoring import ScorerActor
from engines.trainer import EngineSpec, TrainerGroup


@dataclass(frozen=True)
class RoundSetup:
    """Where a round's models come from, and how its actors run."""

    policy_path: str  # where this round starts (the previous round, SFT or the base model)
    reference_path: str | None  # the frozen KL reference (algorithms that use one)
    reward_path: str | None  # the reward model (scoring, or a critic's start)
    prompts: list[tuple[list[int], dict]]  # (prompt ids, record with "answer")
    dtype: str
    torch_threads: int
    max_model_len: int
    seed: int  # the round's stage seed


def _scorers(cfg: RoundConfig) -> int:
    """How many scorer actors the round starts: reference and/or reward model, shared when colocated."""
    wanted = int(cfg.spec.reference) + int(cfg.reward.source == "model")
    return min(wanted, 1) if cfg.colocate_reference_and_reward else wanted


def round_resources(cfg: RoundConfig) -> dict[str, float]:
    """Total CPU/GPU slots of a round's actors (trainers, scorers, rollout engines)."""
    parts = [(cfg.actor.placement, cfg.actor.num_workers), (cfg.scorer_placement, _scorers(cfg)),
             (cfg.generation.placement, cfg.num_rollout_engines)]
    if cfg.spec.critic:
        parts.append((cfg.critic.placement, cfg.critic.num_workers))
    return {"CPU": sum(p.num_cpus * n for p, n in parts), "GPU": sum(p.num_gpus * n for p, n in parts)}


def check_resources(cfg: RoundConfig) -> None:
    """Fail before starting anything: an actor Ray cannot place would wait forever."""
    total = ray.cluster_resources()
    need = round_resources(cfg)
    short = {k: (v, total.get(k, 0.0)) for k, v in need.items() if v > total.get(k, 0.0)}
    if short:
        detail = ", ".join(f"{k}: needs {v:g}, cluster has {have:g}" for k, (v, have) in short.items())
        raise InsufficientResourcesError(
            f"round ({cfg.algorithm}) cannot be placed on this Ray cluster ({detail}); lower the placements "
            f"(actor/critic/generation/scorer_placement), the worker or engine counts, or infra.ray_num_cpus")


@dataclass
class RoundModels:
    actor: TrainerGroup | None = None
    critic: TrainerGroup | None = None
    reference: object = None  # ScorerActor handle
    rewarder: object = None  # ScorerActor handle
    engines: list = field(default_factory=list)

    def ref_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return ray.get(self.reference.ref_logprobs.remote(batch))

    def model_rewards(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return ray.get(self.rewarder.rewards.remote(batch))

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling) -> list[Rollout]:
        """Prompts spread across the engines; rollouts come back grouped per prompt, in prompt order."""
        k = len(self.engines)
        chunks = [list(range(i, len(prompt_ids), k)) for i in range(k)]
        results = ray.get([e.generate.remote([prompt_ids[j] for j in c], sampling)
                           for e, c in zip(self.engines, chunks)])
        by_prompt: dict[int, list[Rollout]] = {}
        for chunk, rollouts in zip(chunks, results):
            for r in rollouts:
                orig = chunk[r.prompt_index]
                by_prompt.setdefault(orig, []).append(
                    Rollout(orig, r.prompt_ids, r.token_ids, r.text, r.logprobs, r.finished))
        return [r for i in range(len(prompt_ids)) for r in by_prompt[i]]

    def sync(self) -> None:
        """Push the actor's weights into every rollout engine (no restart)."""
        blob = ray.put(self.actor.weights_bytes())  # one copy in the object store for every engine
        ray.get([e.update_weights.remote(blob) for e in self.engines])

    def shutdown(self) -> None:
        for group in (self.actor, self.critic):
            if group is not None:
                group.shutdown()
        for a in {id(x): x for x in (self.reference, self.rewarder, *self.engines) if x is not None}.values():
            ray.kill(a)


def start_round_models(cfg: RoundConfig, setup: RoundSetup, updates_per_step: int) -> RoundModels:
    """Start every actor the spec needs; on failure, kill what was started (the caller's process lives on)."""
    check_resources(cfg)
    spec, models = cfg.spec, RoundModels()
    total = cfg.steps * updates_per_step

    def engine(c, path: str, kind: str, purpose: str) -> EngineSpec:
        return EngineSpec.from_config(c, model_path=path, kind=kind, total_steps=total,
                                      global_batch=cfg.ppo.minibatch_size, dtype=setup.dtype,
                                      torch_threads=setup.torch_threads, seed=derive_seed(setup.seed, purpose))

    try:
        models.actor = TrainerGroup(engine(cfg.actor, setup.policy_path, "causal", "actor"), cfg.actor.num_workers)
        if spec.critic:
            start = setup.reward_path if cfg.critic.init == "reward_model" else setup.policy_path
            models.critic = TrainerGroup(engine(cfg.critic, start, "scalar", "critic"), cfg.critic.num_workers)
        p = cfg.scorer_placement
        scorer = ray.remote(num_cpus=p.num_cpus, num_gpus=p.num_gpus)(ScorerActor)
        reference = setup.reference_path if spec.reference else None
        reward = setup.reward_path if cfg.reward.source == "model" else None
        if cfg.colocate_reference_and_reward and reference and reward:
            models.reference = models.rewarder = scorer.remote(reference, reward, setup.dtype, setup.torch_threads)
        else:
            if reference:
                models.reference = scorer.remote(reference, None, setup.dtype, setup.torch_threads)
            if reward:
                models.rewarder = scorer.remote(None, reward, setup.dtype, setup.torch_threads)
        g = cfg.generation
        models.engines = [
            start_rollout_actor(g.backend, setup.policy_path, dtype=setup.dtype,
                                seed=derive_seed(setup.seed, f"rollout/{i}"), torch_threads=setup.torch_threads,
                                max_model_len=setup.max_model_len, num_cpus=g.placement.num_cpus,
                                num_gpus=g.placement.num_gpus)
            for i in range(cfg.num_rollout_engines)
        ]
    except BaseException:
        models.shutdown()
        raise
    return models

