"""The actors of one RL round, started from its algorithm's spec.

    actor      TrainerGroup (DeepSpeed)                       always
    critic     TrainerGroup, from the reward model or policy   spec.critic
    reference  ScorerActor (frozen policy)                     spec.reference and a KL term (or online DPO);
               with LoRA on the actor in a round that starts from the reference: the actor, adapters off
    rewarder   ScorerActor (reward model)                      a reward source is the model
    process    ScorerActor (process reward model), of its own   a reward source is the process model
    engines    RolloutEngines (vLLM, or HF generate)           num_rollout_engines
    judge      RolloutEngines of the judge model (one engine)  a reward source is the judge

Reference and reward model share one scorer actor when colocated. What crosses an actor boundary
is CPU tensors; the round never sees a model.

With `colocate_all`, every actor of the round lives in one Ray placement
group, a bundle per actor worker: worker i of the actor and of the critic
and rollout engine i share bundle i, the scorers bundle 0, each with a
fractional share of the bundle's GPU (engines/rl/round_placement.py). The
engines then sleep while the models train and wake to generate: weights
first, then the weight update, then the KV cache; the trainers' optimizer
state leaves the GPU meanwhile. Where every model fits its GPU at once
(`colocate_offload`: auto, decided at the first update; never), nothing
moves between steps: the engines stay awake and the optimizer state stays.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import ray
import torch

from alignflow.store.artifacts import Source
from alignflow.config import RoundConfig
from alignflow.seeds import derive_seed
from engines.placement import warm
from engines.placement.groups import wait_placement_group
from engines.rl.round_placement import (RoundSetup, check_resources, colocated_bundles,  # noqa: F401 (RoundSetup
                                       engines_share_a_gpu, gpu_share, reference_is_actor)  # kept importable here)
from engines.rl.scoring import start_scorer
from engines.rollout.actors import RolloutEngines, start_engines
from engines.rollout.base import PendingRollouts, Rollout, Sampling
from engines.train import objectives
from engines.train.group import TrainerGroup
from engines.train.spec import EngineSpec
from engines.transport.sync import WeightSync, default_bucket_bytes

RESIDENT_HEADROOM = 0.1  # colocate_offload auto: the share of a GPU left free with every model on it


@dataclass
class RoundModels:
    actor: TrainerGroup | None = None
    critic: TrainerGroup | None = None
    reference: object = None  # ScorerActor handle
    reference_from_actor: bool = False  # LoRA: the actor with its adapters disabled is the reference
    rewarder: object = None  # ScorerActor handle
    process: object = None  # ScorerActor handle: never shared, so that nothing scored ahead queues before it
    engines: RolloutEngines = field(default_factory=lambda: RolloutEngines([]))
    judge: RolloutEngines = field(default_factory=lambda: RolloutEngines([]))  # its weights never change
    colocated: bool = False
    placement_group: object = None  # colocate_all: the round's one placement group
    bucket_bytes: int = field(default_factory=default_bucket_bytes)  # the weight transport's (generation.weight_bucket_mb)
    weight_sync: WeightSync | None = None  # made at the first sync
    offload: str = "always"  # colocate_offload; "auto" until decided (`_stay_resident`)
    publishes: bool = False  # async_rollouts: an update is published, not waited for (WeightSync.push)
    updates_pushed: int = 0  # weight updates pushed (or published): the version the engines hold once they take them
    timings: dict[str, float] = field(default_factory=dict)  # the last step's colocation moves, by what moved

    def _trainers(self) -> list[TrainerGroup]:
        return [g for g in (self.actor, self.critic) if g is not None]

    @property
    def has_reference(self) -> bool:
        return self.reference is not None or self.reference_from_actor

    def ref_logprobs(self, batch: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
        """log π_ref of each response token at `temperature` (the scorer's own where one holds the reference)."""
        if self.reference_from_actor:
            return self.actor.evaluate_rows(
                batch, functools.partial(objectives.response_logprobs, temperature=temperature), without_adapters=True)
        return ray.get(self.reference.ref_logprobs.remote(batch, temperature))

    def model_rewards(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return ray.get(self.rewarder.rewards.remote(batch))

    def process_score(self, method: str, *args) -> torch.Tensor:  # the PRM's ScorerActor: engines/rl/process.py
        return ray.get(getattr(self.process, method).remote(*args))

    def scorers(self) -> list:  # each scorer actor once (reference and reward model may share one)
        return list({id(x): x for x in (self.reference, self.rewarder, self.process) if x is not None}.values())

    def submit(self, prompt_ids: list[list[int]], sampling: Sampling, piece_tokens: int | None = None,
               episodes: tuple | None = None) -> PendingRollouts:
        """Start a generation without waiting (asynchronous rollouts; never colocated), in pieces of
        `piece_tokens` where given (partial rollouts); `episodes` = (records, EnvironmentConfig): episodes
        of those records instead of one response per prompt."""
        if episodes is not None:
            return self.engines.submit_episodes(episodes[0], sampling, episodes[1])
        return self.engines.submit(prompt_ids, sampling, piece_tokens)

    def collect(self, pending: PendingRollouts) -> list[Rollout]:
        return self.engines.collect(pending)

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling, episodes: tuple | None = None
                 ) -> list[Rollout]:
        """Prompts spread across the engines; rollouts come back grouped per prompt, in prompt order (episodes
        as `submit` says). Colocated, the engines then sleep and the trainers take their optimizer state back."""
        rollouts = self.collect(self.submit(prompt_ids, sampling, episodes=episodes))
        if self.colocated and self.offload != "never":
            start = time.perf_counter()
            self.engines.sleep()
            for group in self._trainers():
                group.reload_states()
            self.timings["time/colocation/sleep_and_reload"] = time.perf_counter() - start
        return rollouts

    def sync(self, push: bool = True) -> None:
        """Stream the actor's weights into every rollout engine, no restart (`push=False`: unchanged, none sent).
        Colocated: trainers' optimizer state, scorers' cached memory leave the GPU; engines wake weights, update, KV."""
        if not self.colocated or self.offload == "never":
            self._timed_push(push)
            if self.colocated:
                self.timings["resident"] = 1.0
            return
        start = time.perf_counter()
        if push and self.offload == "auto":
            self.offload = "never" if self._stay_resident() else "always"
        if self.offload != "never":  # "auto" still undecided (no update yet) moves as "always"
            for group in self._trainers():
                group.offload_states()
            ray.get([s.release_memory.remote() for s in self.scorers()])
        self.engines.wake(["weights"])
        self.timings["time/colocation/offload_and_wake"] = time.perf_counter() - start
        self._timed_push(push)
        self.engines.wake(["kv_cache"])
        self.timings["resident"] = float(self.offload == "never")

    def _stay_resident(self) -> bool:
        """colocate_offload: auto, at the first update (the optimizer state exists by then): whether every
        model of the round fits its GPU at once, engines awake, with RESIDENT_HEADROOM of the GPU to spare.
        Asked of each engine while it sleeps: the GPU's free bytes now against what its sleep gave back.
        Then nothing moves between steps: no sleep, no optimizer state off the GPU and back."""
        reports = self.engines.memory()
        fits = bool(reports) and all(r is not None and r["free"] - r["slept"] >= RESIDENT_HEADROOM * r["total"]
                                     for r in reports)
        if fits:
            self.timings["resident_spare_gib"] = min(r["free"] - r["slept"] for r in reports) / 2**30
        return fits

    def _timed_push(self, push: bool) -> None:
        start = time.perf_counter()
        if push:
            self._push()
        self.timings["time/colocation/weights" if self.colocated else "time/sync/weights"] = time.perf_counter() - start

    def _push(self) -> None:
        """One update through the weight transport; the first also makes its group (names and shapes
        are checked by every engine before that)."""
        if self.weight_sync is None:  # the backend follows where the actors are (weight_sync.choose_backend)
            self.weight_sync = WeightSync(self.actor, self.engines, bucket_bytes=self.bucket_bytes,
                                          publish=self.publishes)
        try:
            self.weight_sync.push(self.updates_pushed + 1, publish=self.publishes)
            self.updates_pushed += 1
        except BaseException:
            self.weight_sync = None  # a group with a failed transfer in it is not used again
            raise

    def settle(self) -> None:
        """Every update published so far taken by the engines (a failure raised here, not lost)."""
        if self.weight_sync is not None:
            self.weight_sync.settle()

    def shutdown(self, failed: bool = False) -> None:
        """End every actor; outside a failed round (`failed`) each is reset and kept where a warm pool keeps its
        kind (engines/placement/warm.py), not where a call of theirs may still be running."""
        for group in self._trainers():
            group.shutdown(failed=failed)
        for a in self.scorers():
            warm.end(a, failed=failed)  # ray.kill, or kept for the next start inside keep_warm()
        self.engines.shutdown(failed=failed)
        self.judge.shutdown(failed=failed)
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None


def start_round_models(cfg: RoundConfig, setup: RoundSetup, updates_per_step: int, rows_per_update: int) -> RoundModels:
    """Start every actor the spec needs, all at once where no engine shares a GPU, and wait for the trainers;
    on failure, kill what was started (the caller's process lives on)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    check_resources(cfg, setup, wait_s=setup.nodes_wait_s)
    spec, models = cfg.spec, RoundModels(colocated=cfg.colocate_all, offload=cfg.colocate_offload,
                                         publishes=cfg.async_rollouts)
    models.bucket_bytes = int(cfg.generation.weight_bucket_mb * 2**20)

    def engine(c, path: Source, kind: str, purpose: str, steps: int) -> EngineSpec:
        """`steps`: the round steps that train it, which its learning-rate schedule spans."""
        return EngineSpec.from_config(c, model_path=path, kind=kind, total_steps=steps * updates_per_step,
                                      global_batch=rows_per_update, dtype=setup.dtype,
                                      torch_threads=setup.torch_threads, seed=derive_seed(setup.seed, purpose),
                                      attn_implementation=setup.attn_implementation)

    share = gpu_share(cfg, setup)  # each colocated actor's (0 where the actors have no GPUs)

    def on_bundle(i: int, num_cpus: float) -> dict:
        """Placement of one colocated actor on bundle i (None when not colocated)."""
        if models.placement_group is None:
            return {}
        return {"num_cpus": num_cpus, "num_gpus": share, "scheduling_strategy":
                PlacementGroupSchedulingStrategy(models.placement_group, placement_group_bundle_index=i)}

    try:
        if cfg.colocate_all:
            models.placement_group = ray.util.placement_group(colocated_bundles(cfg, setup), strategy="PACK")
            wait_placement_group(models.placement_group, f"round ({cfg.algorithm}) colocate_all", "PACK")
        n = cfg.actor.num_workers
        models.actor = TrainerGroup(engine(cfg.actor, setup.policy_path, "causal", "actor",
                                           cfg.steps - cfg.actor.freeze_steps), n,
                                    placements=[on_bundle(i, cfg.actor.placement.num_cpus) for i in range(n)]
                                    if cfg.colocate_all else None, wait=False)
        if spec.critic:
            start = setup.reward_path if cfg.critic.init == "reward_model" else setup.policy_path
            k = cfg.critic.num_workers
            models.critic = TrainerGroup(engine(cfg.critic, start, "scalar", "critic", cfg.steps), k,
                                         placements=[on_bundle(i, cfg.critic.placement.num_cpus) for i in range(k)]
                                         if cfg.colocate_all else None, wait=False)
        p = cfg.scorer_placement
        place = on_bundle(0, p.num_cpus) or {"num_cpus": p.num_cpus, "num_gpus": p.num_gpus, "resources": p.resources}
        # The scorers see the actor's batches: they take its micro-batch size.
        common = dict(dtype=setup.dtype, torch_threads=setup.torch_threads, micro_batch_size=cfg.actor.micro_batch_size,
                      micro_batch_tokens=cfg.actor.micro_batch_tokens, cpu_cores=p.cpu_cores,
                      attn_implementation=setup.attn_implementation, **place)
        models.reference_from_actor = reference_is_actor(cfg, setup)
        reference = setup.reference_path if cfg.uses_reference and not models.reference_from_actor else None
        reward = setup.reward_path if cfg.reward.uses_model else None
        if cfg.colocate_reference_and_reward and reference and reward:
            models.reference = models.rewarder = start_scorer(reference, reward, **common)
        else:
            if reference:
                models.reference = start_scorer(reference, None, **common)
            if reward:
                models.rewarder = start_scorer(None, reward, **common)
        if cfg.reward.uses_process_model:
            models.process = start_scorer(None, None, process_path=setup.process_reward_path, **common)
        if engines_share_a_gpu(cfg):  # vLLM sizes its cache by the memory free on the GPU: trainers and scorers first
            for group in models._trainers():
                group.wait_ready()
            ray.get([s.device_report.remote() for s in models.scorers()])
        if cfg.reward.uses_judge:
            j, strategies = cfg.reward.judge.generation, None
            if cfg.colocate_all:  # beside the scorers on bundle 0, awake throughout (its weights never change)
                j = j.model_copy(update={"placement": j.placement.model_copy(update={"num_gpus": share})})
                strategies = [on_bundle(0, j.placement.num_cpus)["scheduling_strategy"]]
            models.judge = start_engines(
                j, setup.judge_path, count=1, seeds=[derive_seed(setup.seed, "judge")], dtype=setup.dtype,
                torch_threads=setup.torch_threads, max_model_len=setup.judge_max_model_len,
                attn_implementation=setup.attn_implementation, strategies=strategies)
        g, count = cfg.generation, cfg.num_rollout_engines
        if models.judge is not None and engines_share_a_gpu(cfg) and (share or g.placement.num_gpus):
            models.judge.wait_built()  # vLLM sizes its KV cache by what another engine's build leaves free
        placements = None
        if cfg.colocate_all:
            g = g.model_copy(update={"placement": g.placement.model_copy(update={"num_gpus": share})})
            placements = [on_bundle(i, g.placement.num_cpus)["scheduling_strategy"] for i in range(count)]
        models.engines = start_engines(
            g, setup.policy_path, count=count, seeds=[derive_seed(setup.seed, f"rollout/{i}") for i in range(count)],
            dtype=setup.dtype, torch_threads=setup.torch_threads, max_model_len=setup.max_model_len,
            attn_implementation=setup.attn_implementation, sleep_mode=cfg.colocate_all, strategies=placements,
            one_at_a_time=0 < g.placement.num_gpus < 1 and not cfg.colocate_all)  # two may share a GPU
        for group in models._trainers():
            group.wait_ready()
        if models.publishes:  # the transport at once: its set-up would queue behind the generations ahead
            models.weight_sync = WeightSync(models.actor, models.engines, bucket_bytes=models.bucket_bytes,
                                            publish=True)
    except BaseException:
        models.shutdown(failed=True)
        raise
    return models
