"""How a round's policy learns from one step's experience: one class per `AlgorithmSpec.update`.

An update takes the step's Experience (rollouts and rewards in), completes
it through the pure phases of engines/rl/experience.py, trains on it, and
returns the completed Experience, the rows it trained on and its metrics.
The orchestrator never looks inside.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

import algos
from alignflow.config import RoundConfig
from alignflow.seeds import derive_seed
from engines.batches import minibatches, rows_per_pass, shard, split_pairs
from engines.rl import experience
from engines.rl.experience import Experience
from engines.rl.round_models import RoundModels
from engines.train import objectives
from engines.train.group import TrainerGroup

Lap = Callable[[str], None]  # records the time of the phase that just ended


def is_trainer_metric(name: str) -> bool:
    """A metric a training engine reports of itself, not of its objective: lr, grad_norm, lora/*."""
    return name in ("lr", "grad_norm") or name.startswith("lora/")


@dataclass(frozen=True)
class Trained:
    experience: Experience
    rows: torch.Tensor  # the rows of `experience` the update trained on
    metrics: dict[str, float]
    actor_trained: bool  # False: the policy is unchanged, the engines need no new weights


def train_minibatches(batch: dict[str, torch.Tensor], chunks, steps: list[tuple[TrainerGroup, Callable, Callable]], *,
                      pairs: int | None = None) -> dict[str, float]:
    """One optimizer step per chunk of rows for every (trainer group, objective, weigh: what it averages
    over, engines/train/objectives.py); mean metrics. A value model's own trainer metrics (lr, grad_norm, lora/*:
    `is_trainer_metric`) are logged as `critic/<name>`.
    `pairs`: the batch is [chosen..., rejected...] of that many pairs and the chunks index pairs."""
    sums: dict[str, float] = {}
    n = 0
    paired = pairs is not None
    for rows in chunks:
        part = split_pairs(batch, rows, pairs) if paired else {k: v[rows] for k, v in batch.items()}
        for group, objective, weigh in steps:
            critic = group.spec.kind == "scalar"
            for k, v in group.train_step(shard(part, group.world_size, paired=paired), objective,
                                         paired=paired, weigh=weigh).items():
                key = f"critic/{k}" if critic and is_trainer_metric(k) else k
                sums[key] = sums.get(key, 0.0) + v
        n += 1
    return {k: v / n for k, v in sums.items()}


def schedules_on(groups, planned: int, taken: int) -> None:
    """The learning-rate schedules of `groups` moved on by the updates a round step did not take: they are
    sized for `planned` a step (updates_per_step), and a step with fewer rows than a full one (groups dropped by
    dynamic sampling, prompts without a winner, tied groups without a pair) takes fewer; without this the
    schedule would lag the round and never reach its floor."""
    for group in groups:
        group.skip_updates(planned - taken)


class PolicyGradientUpdate:
    """Advantages (KL in the reward or in the loss), then clipped-surrogate epochs over minibatches
    for the actor, and value regression for the critic when the spec has one."""

    reference_on_batch = True  # the reference's log-probs of the whole step (scored ahead where rollouts are async)

    def __init__(self, cfg: RoundConfig, models: RoundModels, seed: int):
        self.cfg, self.models, self.seed = cfg, models, seed
        kl = cfg.kl
        self.kl_ctl = (algos.AdaptiveKLController(kl.coef, kl.target, kl.horizon) if kl.adaptive
                       else algos.FixedKLController(kl.coef))

    @staticmethod
    def rows_per_update(cfg: RoundConfig) -> int:
        """Rows of one optimizer step (the engines' global batch)."""
        return cfg.ppo.minibatch_size

    @staticmethod
    def updates_per_step(cfg: RoundConfig) -> int:
        """Optimizer steps per round step (sizes the learning-rate schedule)."""
        return cfg.ppo.epochs * max(1, cfg.prompts_per_step * cfg.generation.num_samples // cfg.ppo.minibatch_size)

    @staticmethod
    def on_policy(cfg: RoundConfig) -> bool:
        """The batch serves exactly one optimizer step and the KL is not in the reward: the old
        log-probs are then the training forward's own (detached), and no separate forward runs. Not for an
        asynchronous distillation round: its teacher's pull is taken at the student's log-probs before the
        step (engines/rl/experience.py), and its sampler's are up to max_staleness versions older."""
        return (PolicyGradientUpdate.updates_per_step(cfg) == 1 and cfg.kl.apply_as != "reward"
                and not (cfg.spec.teacher and cfg.async_rollouts))

    def __call__(self, exp: Experience, step: int, lap: Lap) -> Trained:
        cfg, spec, m = self.cfg, self.cfg.spec, self.models
        if m.has_reference:
            if exp.ref_logprobs is None:  # else scored ahead, beside the previous step (engines/rl/scoring.py)
                exp = exp.with_(ref_logprobs=m.ref_logprobs(exp.tensors(), cfg.generation.logprob_temperature))
            lap("reference")
        frozen = step < cfg.actor.freeze_steps  # only the critic trains (actor.freeze_steps)
        if not self.on_policy(cfg) or frozen:  # frozen: no actor forward in training measures them
            exp = exp.with_(old_logprobs=m.actor.evaluate_rows(exp.tensors(), functools.partial(
                objectives.response_logprobs, temperature=cfg.generation.logprob_temperature)))
            lap("old_logprobs")
        if m.critic is not None:
            exp = exp.with_(values=m.critic.evaluate_rows(exp.tensors(), objectives.token_values))
            lap("critic")
        kl_in_reward = cfg.kl.apply_as == "reward"
        # The filters first: a whitened estimator's statistics are those of the rows trained on (DAPO's order).
        rows, filtered = experience.kept_rows(exp.rewards, cfg, task_rewards=exp.task_rewards)
        exp = experience.with_advantages(
            exp, estimator=spec.advantage, whiten=spec.whiten, group_size=cfg.generation.num_samples,
            gamma=cfg.ppo.gamma, lam=cfg.ppo.lam, kl_coef=self.kl_ctl.value if kl_in_reward else 0.0,
            kl_estimator=cfg.kl.estimator, kl_clamp=cfg.kl.clamp, std_norm=cfg.ppo.advantage_std_norm,
            teacher=spec.teacher, rows=rows)
        metrics = self._train(exp.select(rows), step, frozen) if len(rows) else {}
        trained_by = [g for g, *_ in self.objectives(frozen)]
        updates = metrics.pop("updates", 0)  # none where the kept rows are fewer than a minibatch's ranks
        schedules_on(trained_by, self.updates_per_step(cfg), updates)
        lap("train")
        # On policy, the KL of the trained rows as the training forward measured it; with none trained, the
        # sampler's (the policy's) against the reference, not a 0 the adaptive controller would act on.
        seq_kl = (metrics["sequence_kl"] if exp.old_logprobs is None and "sequence_kl" in metrics
                  else experience.sequence_kl(exp).mean().item())
        self.kl_ctl.update(seq_kl, n_steps=len(exp))
        trained = exp.select(rows)
        metrics.update({"kl": seq_kl, "kl_coef": self.kl_ctl.value, **filtered, "actor_frozen": float(frozen),
                        "advantage/mean": algos.masked_mean(trained.advantages, trained.action_mask).item()})
        if spec.teacher:  # per token, as the signal is taken: the sampled reverse KL to the teacher
            metrics["distill/reverse_kl_per_token"] = -metrics["advantage/mean"]
        return Trained(exp, rows, metrics, actor_trained=bool(updates) and not frozen)

    def objectives(self, frozen: bool = False) -> list[tuple[TrainerGroup, Callable, Callable]]:
        """(trainer group, objective, weigh) of one minibatch step, with this step's KL coefficient;
        `frozen`: the critic's alone."""
        cfg, p, m = self.cfg, self.cfg.ppo, self.models
        weigh = functools.partial(objectives.aggregated, agg=p.loss_agg)
        constant = float(cfg.max_response_tokens)  # Dr. GRPO's C (seq_mean_token_sum_norm alone uses it)
        steps = [] if frozen else [(m.actor, functools.partial(
            objectives.policy_objective, **self.surrogate_options(), agg=p.loss_agg, entropy_coef=p.entropy_coef,
            kl_loss_coef=self.kl_ctl.value if cfg.kl.apply_as == "loss" else 0.0,
            kl_estimator=cfg.kl.estimator, kl_clamp=cfg.kl.clamp, tis_cap=p.tis_cap, tis_low=p.tis_low,
            tis_mode=p.tis_mode, tis_level=p.tis_level, tis_veto=p.tis_veto, on_policy=self.on_policy(cfg),
            loss_scale_constant=constant, temperature=cfg.generation.logprob_temperature), weigh)]
        if m.critic is not None:
            steps.append((m.critic, functools.partial(objectives.value_objective, clip_eps=p.value_clip,
                                                      agg=p.loss_agg, loss_scale_constant=constant), weigh))
        return steps

    def surrogate_options(self) -> dict:
        """The policy objective's surrogate (engines/train/objectives.py SURROGATES, with SAPO's temperatures, or
        the covariance control's), its clip (None where the surrogate has none) and its share of tokens."""
        p, cov = self.cfg.ppo, self.cfg.ppo.covariance
        options = dict(clip_low=p.clip_low, clip_high=p.clip_high, dual_clip=p.dual_clip,  # None: sapo, kl_cov
                       entropy_fraction=p.high_entropy_fraction)
        surrogate = objectives.SURROGATES[self.cfg.spec.policy_loss]
        if self.cfg.spec.policy_loss == "sapo_gate":
            surrogate = functools.partial(surrogate, tau_positive=p.sapo_temperatures[0],
                                          tau_negative=p.sapo_temperatures[1])
        if cov is None:
            return dict(options, surrogate=surrogate)
        if cov.method == "kl_cov":
            return dict(options, surrogate=functools.partial(algos.kl_cov_policy_loss, fraction=cov.share,
                                                          kl_coef=cov.kl_coef))
        return dict(options, surrogate=functools.partial(algos.clip_cov_policy_loss, fraction=cov.share,
                                                      bounds=cov.bounds))

    def _train(self, exp: Experience, step: int, frozen: bool) -> dict[str, float]:
        p, steps = self.cfg.ppo, self.objectives(frozen)
        ranks = math.lcm(*(g.world_size for g, *_ in steps))  # rows split evenly across every group's ranks
        gen = torch.Generator().manual_seed(derive_seed(self.seed, f"minibatches/{step}"))
        chunks = list(minibatches(len(exp), p.minibatch_size, epochs=p.epochs, generator=gen, multiple_of=ranks))
        # Each pass's remainder (and each chunk's cut to the ranks) is left out of it: counted, as rs/ and dpo/ do.
        left_out = float(len(exp) - rows_per_pass(len(exp), p.minibatch_size, ranks))
        return {**train_minibatches(exp.tensors(), chunks, steps), "rows_left_out": left_out, "updates": len(chunks)}

    def state(self) -> dict[str, float]:
        return {"kl_coef": self.kl_ctl.value}

    def load(self, state: dict[str, float]) -> None:
        self.kl_ctl.value = state["kl_coef"]


class BestOfNSFTUpdate:
    """Rejection sampling: per prompt the best finished response above the threshold, then SFT on those."""

    reference_on_batch = False  # no reference

    def __init__(self, cfg: RoundConfig, models: RoundModels, seed: int):
        self.cfg, self.models, self.seed = cfg, models, seed

    rows_per_update = PolicyGradientUpdate.rows_per_update

    @staticmethod
    def updates_per_step(cfg: RoundConfig) -> int:
        return cfg.rejection.epochs * max(1, cfg.prompts_per_step // cfg.ppo.minibatch_size)

    def __call__(self, exp: Experience, step: int, lap: Lap) -> Trained:
        winners = experience.best_of_n(exp, self.cfg.rejection.threshold)
        rewards = exp.rewards[winners]
        prompts, finished = exp.prompt_index.unique(), exp.prompt_index[exp.finished.bool()].unique()
        metrics = {"rs/winners": float(len(winners)), "rs/winner_reward": rewards.mean().item() if len(winners) else 0.0,
                   "rs/winners_left_out": 0.0,  # what best_of_n leaves out, prompt by prompt:
                   "rs/prompts_unfinished": float(len(prompts) - len(finished)),  # no sample ended before the limit
                   "rs/below_threshold": float(len(finished) - len(winners))}  # the best short of the threshold
        actor, chunks = self.models.actor, []
        if len(winners):
            gen = torch.Generator().manual_seed(derive_seed(self.seed, f"minibatches/{step}"))
            size = self.cfg.ppo.minibatch_size
            # Each pass's remainder (and each chunk's cut to the actor's ranks) is left out of it: counted.
            metrics["rs/winners_left_out"] = float(len(winners) - rows_per_pass(len(winners), size, actor.world_size))
            chunks = list(minibatches(len(winners), size, epochs=self.cfg.rejection.epochs,
                                      generator=gen, multiple_of=actor.world_size))
            sft = train_minibatches(experience.sft_batch(exp.select(winners)), chunks,
                                    [(actor, objectives.causal_lm_objective, objectives.response_tokens)])
            metrics.update({f"sft_{k}": v for k, v in sft.items()})
        schedules_on([actor], self.updates_per_step(self.cfg), len(chunks))
        lap("train")
        return Trained(exp, winners, metrics, actor_trained=bool(chunks))

    def state(self) -> dict[str, float]:
        return {}

    def load(self, state: dict[str, float]) -> None:
        pass


class OnlineDPOUpdate:
    """Online DPO: per prompt the best sample against the worst (tied groups give no pair and are counted),
    the reference's sequence log-probabilities of those rows, then DPO steps on the pairs
    (engines/train/preference.py: dpo_objective on rollout rows). The rollout engines get the new weights after
    the step like every round's."""

    reference_on_batch = False  # the reference scores the pairs alone, once they are chosen

    def __init__(self, cfg: RoundConfig, models: RoundModels, seed: int):
        self.cfg, self.models, self.seed = cfg, models, seed

    @staticmethod
    def rows_per_update(cfg: RoundConfig) -> int:
        """Two rows (chosen, rejected) per pair of an optimizer step."""
        return 2 * (cfg.dpo.pairs_per_update or cfg.prompts_per_step)

    @staticmethod
    def updates_per_step(cfg: RoundConfig) -> int:
        """At most one pair per prompt: the learning-rate schedule's count when no group ties."""
        d = cfg.dpo
        return d.epochs * max(1, cfg.prompts_per_step // (d.pairs_per_update or cfg.prompts_per_step))

    def __call__(self, exp: Experience, step: int, lap: Lap) -> Trained:
        from alignflow.config.preference import DPO_LOSS_TYPE
        from engines.train.preference import dpo_objective

        d, actor = self.cfg.dpo, self.models.actor
        chosen, rejected, tied = algos.best_worst_pairs(exp.rewards, self.cfg.generation.num_samples)
        rows, n = torch.cat([chosen, rejected]), len(chosen)
        metrics = {"dpo/pairs": float(n), "dpo/tied_groups": float(tied),
                   "dpo/reward_gap": (exp.rewards[chosen] - exp.rewards[rejected]).mean().item() if n else 0.0}
        n -= n % actor.world_size  # pairs split evenly across the actor's ranks
        metrics["dpo/pairs_left_out"] = float(len(chosen) - n)
        chunks = []
        if n:
            rows = torch.cat([chosen[:n], rejected[:n]])
            pairs = exp.select(rows)
            ref = self.models.ref_logprobs(pairs.tensors(), 1.0)  # DPO's: of the model itself, as its policy's
            lap("reference")
            batch = {k: getattr(pairs, k) for k in ("input_ids", "attention_mask", "response_index", "action_mask")}
            batch["ref_logps"] = algos.masked_sum(ref, pairs.action_mask, dim=-1)
            objective = functools.partial(dpo_objective, loss_type=DPO_LOSS_TYPE[d.loss], beta=d.beta,
                                          label_smoothing=d.label_smoothing, rollouts=True, rpo_alpha=d.rpo_alpha)
            gen = torch.Generator().manual_seed(derive_seed(self.seed, f"minibatches/{step}"))
            size = d.pairs_per_update or n
            # minibatches drops each pass's remainder when a pass makes more than one chunk: counted.
            metrics["dpo/pairs_left_out"] += float(n - rows_per_pass(n, size, actor.world_size))
            chunks = list(minibatches(n, size, epochs=d.epochs, generator=gen, multiple_of=actor.world_size))
            trained = train_minibatches(batch, chunks, [(actor, objective, objectives.per_row)], pairs=n)
            metrics.update({f"dpo/{k}": v for k, v in trained.items()})
        schedules_on([actor], self.updates_per_step(self.cfg), len(chunks))
        lap("train")
        return Trained(exp, rows[: 2 * n], metrics, actor_trained=bool(chunks))

    def state(self) -> dict[str, float]:
        return {}

    def load(self, state: dict[str, float]) -> None:
        pass


UPDATES = {"policy_gradient": PolicyGradientUpdate, "best_of_n_sft": BestOfNSFTUpdate, "online_dpo": OnlineDPOUpdate}
