"""One RL round: vLLM rollouts, experience making, updates, weight sync.

A step:
  1. the rollout engines sample n responses per prompt (with logprobs);
  2. rewards (reward model / rule / remote), reference logprobs, the actor's
     own logprobs and (PPO) critic values;
  3. KL penalty and advantages through the `algos` registry;
  4. PPO epochs over minibatches for the actor (and critic) on DeepSpeed —
     or, for rejection sampling, fine-tuning on the best response per prompt;
  5. the new weights are pushed into the running rollout engines.
Resumable state: actor and critic training state, KL coefficient, step.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch

import algos
from alignflow.config import EngineConfig, RoundConfig
from engines import batches, objectives
from engines.experience import minibatches, rollout_batch, select
from engines.rewards import RemoteReward, RuleReward, ScoredText
from engines.rollout import Rollout, Sampling, start_rollout_actor
from engines.scoring import ScorerActor
from engines.supervised import Schedule
from engines.trainer import EngineSpec, TrainerGroup

@dataclass(frozen=True)
class RoundInputs:
    policy_path: str  # where this round starts (SFT or the previous round)
    reference_path: str  # the frozen reference policy (SFT)
    reward_path: str  # the reward model (also the critic's initialisation)
    prompts: list[tuple[list[int], dict]]  # (prompt ids, record with "answer")
    dtype: str
    torch_threads: int
    max_model_len: int
    rollout_backend: str = "vllm"


class InsufficientResourcesError(RuntimeError):
    """The round's actors need more Ray resources than the cluster has."""


def round_resources(cfg: RoundConfig) -> dict[str, float]:
    """Total CPU/GPU slots of a round's actors (trainers, scorers, rollout engines)."""
    parts = [(cfg.actor.placement, cfg.actor.num_workers),
             (cfg.scorer_placement, 1 if cfg.colocate_reference_and_reward or cfg.reward.source != "model" else 2),
             (cfg.generation.placement, cfg.num_rollout_engines)]
    if cfg.algorithm == "ppo":
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


def _updates_per_step(cfg: RoundConfig) -> int:
    rows = cfg.prompts_per_step * (1 if cfg.algorithm == "rejection_sampling" else cfg.generation.num_samples)
    epochs = cfg.rejection.epochs if cfg.algorithm == "rejection_sampling" else cfg.ppo.epochs
    return epochs * max(1, rows // cfg.ppo.minibatch_size)


class RLRound:
    def __init__(self, cfg: RoundConfig, inputs: RoundInputs):
        from engines.models import load_tokenizer

        self.cfg, self.inputs = cfg, inputs
        # Cheap checks first: nothing is started if the round cannot run.
        check_resources(cfg)
        self.reward_fn = self._reward_fn()
        self.tokenizer = load_tokenizer(inputs.policy_path)
        self.pad_id = self.tokenizer.pad_token_id
        kl = cfg.kl
        self.kl_ctl = (algos.AdaptiveKLController(kl.coef, kl.target, kl.horizon) if kl.adaptive
                       else algos.FixedKLController(kl.coef))
        self.schedule = Schedule(rows=len(inputs.prompts), batch_size=min(cfg.prompts_per_step, len(inputs.prompts)),
                                 total_steps=cfg.steps, seed=cfg.seed)
        # The latest step's experience and winners, for inspection and tests.
        self.last_experience: dict[str, Any] = {}
        self.last_winners: list[dict[str, Any]] = []
        self.actor = self.critic = self.reference = self.rewarder = None
        self.engines: list = []
        try:
            self._start_actors()
        except BaseException:
            self.shutdown()  # the calling worker process lives on; so would the actors
            raise

    def _start_actors(self) -> None:
        cfg, inputs = self.cfg, self.inputs
        total = cfg.steps * _updates_per_step(cfg)
        self.actor = TrainerGroup(self._spec(cfg.actor, inputs.policy_path, "causal", total), cfg.actor.num_workers)
        self.critic = None
        if cfg.algorithm == "ppo":
            self.critic = TrainerGroup(self._spec(cfg.critic, inputs.reward_path, "scalar", total), cfg.critic.num_workers)
        self._start_scorers()
        self.engines = [
            start_rollout_actor(inputs.rollout_backend, inputs.policy_path, dtype=inputs.dtype, seed=cfg.seed + i,
                                torch_threads=inputs.torch_threads, max_model_len=inputs.max_model_len,
                                num_cpus=cfg.generation.placement.num_cpus, num_gpus=cfg.generation.placement.num_gpus)
            for i in range(cfg.num_rollout_engines)
        ]

    def _spec(self, engine: EngineConfig, path: str, kind: str, total: int) -> EngineSpec:
        return EngineSpec.from_config(engine, model_path=path, kind=kind, total_steps=total,
                                      global_batch=self.cfg.ppo.minibatch_size, dtype=self.inputs.dtype,
                                      torch_threads=self.inputs.torch_threads, seed_offset=self.cfg.seed)

    def _start_scorers(self) -> None:
        p = self.cfg.scorer_placement
        actor = ray.remote(num_cpus=p.num_cpus, num_gpus=p.num_gpus)(ScorerActor)
        reward = self.inputs.reward_path if self.cfg.reward.source == "model" else None
        if self.cfg.colocate_reference_and_reward:
            self.reference = self.rewarder = actor.remote(self.inputs.reference_path, reward, self.inputs.dtype,
                                                          self.inputs.torch_threads)
        else:
            self.reference = actor.remote(self.inputs.reference_path, None, self.inputs.dtype, self.inputs.torch_threads)
            self.rewarder = actor.remote(None, reward, self.inputs.dtype, self.inputs.torch_threads) if reward else None

    def _reward_fn(self) -> Callable[[list[ScoredText]], list[float]] | None:
        r = self.cfg.reward
        if r.source == "rule":
            return RuleReward(r.rule)
        if r.source == "remote":
            return RemoteReward(r.url, r.timeout_s, r.max_retries)
        return None

    # ---- phases ------------------------------------------------------------------

    def generate(self, prompt_ids: list[list[int]]) -> list[Rollout]:
        g = self.cfg.generation
        sampling = Sampling(n=g.num_samples, temperature=g.temperature, top_p=g.top_p, max_new_tokens=g.max_new_tokens)
        k = len(self.engines)
        chunks = [list(range(i, len(prompt_ids), k)) for i in range(k)]  # prompts spread across engines
        results = ray.get([e.generate.remote([prompt_ids[j] for j in c], sampling) for e, c in zip(self.engines, chunks)])
        by_prompt: dict[int, list[Rollout]] = {}
        for chunk, rollouts in zip(chunks, results):
            for r in rollouts:
                orig = chunk[r.prompt_index]
                by_prompt.setdefault(orig, []).append(
                    Rollout(orig, r.prompt_ids, r.token_ids, r.text, r.logprobs, r.finished))
        return [r for i in range(len(prompt_ids)) for r in by_prompt[i]]  # groups contiguous

    def score(self, rollouts: list[Rollout], records: list[dict], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.reward_fn is None:
            rewards = ray.get(self.rewarder.rewards.remote(batch))
        else:
            items = [ScoredText(self.tokenizer.decode(r.prompt_ids, skip_special_tokens=True), r.text,
                                records[r.prompt_index].get("answer")) for r in rollouts]
            rewards = torch.tensor(self.reward_fn(items), dtype=torch.float32)
        r = self.cfg.reward
        if r.overlong_buffer:
            lengths = batch["action_mask"].sum(-1)
            rewards = rewards + algos.overlong_penalty(
                lengths, max_len=self.cfg.generation.max_new_tokens, buffer_len=r.overlong_buffer,
                penalty_factor=r.overlong_penalty)
        return rewards

    def sync(self) -> None:
        blob = ray.put(self.actor.weights_bytes())  # one copy in the object store for every engine
        ray.get([e.update_weights.remote(blob) for e in self.engines])

    # ---- one step -----------------------------------------------------------------

    def step(self, step: int) -> dict[str, float]:
        times: dict[str, float] = {}
        clock = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            times[f"time/{name}"] = now - clock
            clock = now

        picked = [self.inputs.prompts[i] for i in self.schedule.indices(step).tolist()]
        prompt_ids, records = [p for p, _ in picked], [r for _, r in picked]
        rollouts = self.generate(prompt_ids)
        lap("generate")
        n_tokens = sum(len(r.token_ids) for r in rollouts)
        batch = rollout_batch(rollouts, self.pad_id)
        rewards = self.score(rollouts, records, batch)
        lap("score")
        if self.cfg.algorithm == "rejection_sampling":
            metrics = self._rejection_update(rollouts, records, rewards)
            lap("train")
        else:
            metrics = self._policy_update(batch, rewards, lap)
        self.sync()
        lap("sync")
        self.last_experience = {"batch": batch, "rewards": rewards, "rollouts": rollouts}
        mask = batch["action_mask"]
        metrics.update({
            "reward/mean": rewards.mean().item(), "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
            "response_length": mask.sum(-1).mean().item(),
            "tokens_per_s": n_tokens / max(times["time/generate"], 1e-9),
            "kl_coef": self.kl_ctl.value, **times,
        })
        return metrics

    def _policy_update(self, batch: dict[str, torch.Tensor], rewards: torch.Tensor, lap) -> dict[str, float]:
        cfg, mask = self.cfg, batch["action_mask"]
        batch["ref_logprobs"] = ray.get(self.reference.ref_logprobs.remote(batch))
        batch["old_logprobs"] = self.actor.evaluate(batch, objectives.response_logprobs)
        lap("reference")
        values = self.critic.evaluate(batch, objectives.token_values) if self.critic else None
        lap("critic")
        kl_in_reward = cfg.kl.coef if cfg.kl.apply_as == "reward" else 0.0
        token_rewards = algos.kl_penalized_rewards(
            rewards, batch["old_logprobs"], batch["ref_logprobs"], mask,
            kl_coef=self.kl_ctl.value if kl_in_reward else 0.0, kind=cfg.kl.estimator, clamp=cfg.kl.clamp)
        estimator = algos.get_advantage_estimator("gae" if cfg.algorithm == "ppo" else cfg.algorithm)
        adv = estimator(token_rewards=token_rewards, action_mask=mask, values=values,
                        group_size=cfg.generation.num_samples, gamma=cfg.ppo.gamma, lam=cfg.ppo.lam, eps=1e-6)
        advantages = algos.masked_whiten(adv.advantages, mask) if cfg.algorithm == "ppo" else adv.advantages
        batch.update(advantages=advantages, returns=adv.returns)
        if values is not None:
            batch["values"] = values
        seq_kl = algos.kl_estimate(batch["old_logprobs"], batch["ref_logprobs"], kind="k1").mul(mask).sum(-1)

        rows = torch.arange(len(rewards))
        dropped = 0
        if cfg.ppo.dynamic_sampling:
            keep, dropped = algos.dynamic_sampling_filter(rewards, cfg.generation.num_samples)
            rows = rows[keep]
        metrics = self._ppo_epochs(batch, rows) if len(rows) else {}
        lap("train")
        self.kl_ctl.update(seq_kl.mean().item(), n_steps=len(rewards))
        metrics.update({"kl": seq_kl.mean().item(), "dynamic_sampling/dropped_groups": float(dropped),
                        "advantage/mean": algos.masked_mean(advantages, mask).item()})
        return metrics

    def _ppo_epochs(self, batch: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, float]:
        cfg = self.cfg
        p = cfg.ppo
        policy_obj = functools.partial(
            objectives.policy_objective, clip_low=p.clip_low, clip_high=p.clip_high, dual_clip=p.dual_clip,
            agg=p.loss_agg, entropy_coef=p.entropy_coef,
            kl_loss_coef=self.kl_ctl.value if cfg.kl.apply_as == "loss" else 0.0,
            kl_estimator=cfg.kl.estimator, kl_clamp=cfg.kl.clamp, tis_cap=p.tis_cap)
        value_obj = functools.partial(objectives.value_objective, clip_eps=p.value_clip, agg=p.loss_agg)
        gen = torch.Generator().manual_seed(cfg.seed)
        ranks = math.lcm(self.actor.world_size, self.critic.world_size if self.critic else 1)
        sums: dict[str, float] = {}
        n = 0
        for _ in range(p.epochs):
            for mb in minibatches(len(rows), p.minibatch_size, gen):
                mb = mb[: len(mb) - len(mb) % ranks]  # rows split evenly across every group's ranks
                if not len(mb):
                    continue
                part = select(batch, rows[mb])
                m = self.actor.train_step(batches.shard(part, self.actor.world_size), policy_obj)
                if self.critic:
                    m.update(self.critic.train_step(batches.shard(part, self.critic.world_size), value_obj))
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + v
                n += 1
        return {k: v / n for k, v in sums.items()}

    def _rejection_update(self, rollouts: list[Rollout], records: list[dict], rewards: torch.Tensor) -> dict[str, float]:
        """Keep the best finished response per prompt (>= threshold); SFT on those."""
        best: dict[int, int] = {}
        for i, r in enumerate(rollouts):
            if not r.finished:
                continue
            if r.prompt_index not in best or rewards[i] > rewards[best[r.prompt_index]]:
                best[r.prompt_index] = i
        threshold = self.cfg.rejection.threshold
        winners = [i for i in best.values() if threshold is None or rewards[i].item() >= threshold]
        self.last_winners = [{"prompt_index": rollouts[i].prompt_index, "text": rollouts[i].text,
                              "reward": rewards[i].item()} for i in winners]
        metrics = {"rs/winners": float(len(winners)), "rs/winner_reward": (
            sum(rewards[i].item() for i in winners) / len(winners) if winners else 0.0)}
        if not winners:
            return metrics
        seqs = [rollouts[i].prompt_ids + rollouts[i].token_ids for i in winners]
        masks = [[0] * len(rollouts[i].prompt_ids) + [1] * len(rollouts[i].token_ids) for i in winners]
        data = {**batches.right_padded(seqs, self.pad_id), "loss_mask": batches.pad_right(masks, 0)}
        gen = torch.Generator().manual_seed(self.cfg.seed)
        sums, n = {}, 0
        w = self.actor.world_size
        for _ in range(self.cfg.rejection.epochs):
            for mb in minibatches(len(winners), self.cfg.ppo.minibatch_size, gen):
                mb = mb[: len(mb) - len(mb) % w] if len(mb) >= w else mb
                if len(mb) < w:
                    continue
                m = self.actor.train_step(batches.shard(select(data, mb), w), objectives.causal_lm_objective)
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + v
                n += 1
        metrics.update({f"sft_{k}": v / n for k, v in sums.items()} if n else {})
        return metrics

    # ---- state ------------------------------------------------------------------

    def save_state(self, directory: str, step: int) -> None:
        d = Path(directory)
        self.actor.save_state(str(d / "actor"), {"step": step})
        if self.critic:
            self.critic.save_state(str(d / "critic"), {"step": step})
        (d / "round.json").write_text(json.dumps({"step": step, "kl_coef": self.kl_ctl.value}))

    def load_state(self, directory: str) -> int:
        d = Path(directory)
        self.actor.load_state(str(d / "actor"))
        if self.critic:
            self.critic.load_state(str(d / "critic"))
        state = json.loads((d / "round.json").read_text())
        self.kl_ctl.value = state["kl_coef"]
        self.sync()  # the engines started from the round's initial policy
        return int(state["step"])

    def save_policy(self, directory: str) -> None:
        self.actor.save_hf(directory)

    def shutdown(self) -> None:
        for group in (self.actor, self.critic):
            if group is not None:
                group.shutdown()
        for a in {id(x): x for x in (self.reference, self.rewarder, *self.engines) if x is not None}.values():
            ray.kill(a)
