"""One RL round: its algorithm (a spec in alignflow/algorithms.py), rewards, KL, updates, actors."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationError, model_validator

from alignflow.algorithms import ALGORITHMS, AlgorithmSpec, get_algorithm
from alignflow.config.base import EngineConfig, GenerationConfig, Placement, Section
from alignflow.config.preference import DPO_FAMILY_HELP, DPOLoss, check_smoothing
from alignflow.config.round.agent import EnvironmentConfig
from alignflow.config.round.reward import RewardConfig
from alignflow.config.round.checks import check_round
from alignflow.config.round.updates import KLConfig, PPOConfig

AlgorithmName = Literal[tuple(ALGORITHMS)]  # type: ignore[valid-type]  (the registry's names)


class OnlineDPOConfig(Section):
    """algorithm: online_dpo. Each step pairs, per prompt, the best sample with the worst (groups whose
    rewards are all equal give no pair, counted) and takes DPO steps against the round's reference."""

    loss: DPOLoss = Field("dpo", description=DPO_FAMILY_HELP)
    beta: float = Field(0.1, gt=0, description="strength of the pull toward the round's reference")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="cdpo's and robust's share of flipped labels (> 0)")
    rpo_alpha: float = Field(0.0, ge=0, description="the weight of the chosen samples' per-token NLL added to the "
                             "loss (RPO, Pang et al. 2024; the reference stays the round's); 0: off")
    epochs: int = Field(1, ge=1, description="passes over a step's pairs")
    pairs_per_update: int | None = Field(None, ge=1, description="pairs per optimizer step; None: all of a step's")

    @model_validator(mode="after")
    def _smoothing(self) -> OnlineDPOConfig:
        check_smoothing("dpo", self.loss, self.label_smoothing)
        return self


class RejectionSamplingConfig(Section):
    """Keep the best of n per prompt (above a threshold) and fine-tune on them."""

    threshold: float | None = Field(None, description="minimum task reward of a winner (the reward source's value, "
                                    "before normalising, clipping and the overlong penalty)")
    epochs: int = Field(1, ge=1, description="passes over a step's winners")


# Round-specific defaults live on classes of their own: a default given as an
# instance (`actor: EngineConfig = EngineConfig(learning_rate=2e-4)`) is lost as
# soon as a user sets any one field of that section.


class ActorConfig(EngineConfig):
    """The policy's training engine in an RL round."""

    learning_rate: float = Field(2e-4, gt=0, description="peak AdamW learning rate")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear learning-rate warmup; 0: none")
    freeze_steps: int = Field(
        0, ge=0, description="round steps at the start in which only the critic trains: the actor and the "
        "rollout engines keep the round's starting policy while a critic started from the reward model learns "
        "values, before its advantages move the policy (OpenRLHF's freezing_actor_steps, verl's "
        "critic_warmup); algorithms with a critic only")


class CriticConfig(EngineConfig):
    """The critic's training engine (algorithms with a critic)."""

    learning_rate: float = Field(1e-3, gt=0, description="peak AdamW learning rate")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear learning-rate warmup; 0: none")
    init: Literal["reward_model", "policy"] = Field(
        "reward_model", description="start from the reward model, or the policy with a fresh (zero) value head")


class RolloutConfig(GenerationConfig):
    """Sampling during an RL round: n samples per prompt form its group."""

    max_new_tokens: int = Field(8, ge=1, description="at most this many tokens per response (longer ones are cut)")


class RoundConfig(Section):
    """One RL round; it starts from the previous round's policy (or SFT, or the base model)."""

    algorithm: AlgorithmName = Field("ppo", description="a name in alignflow/algorithms.py's registry")
    steps: int = Field(20, ge=1, description="round steps: generate, score, update")
    prompts_per_step: int = Field(32, ge=1, description="prompts per step, each sampled generation.num_samples times")
    generation: RolloutConfig = Field(default_factory=RolloutConfig, description="rollout sampling")
    reward: RewardConfig = Field(RewardConfig(), description="rewards and their shaping")
    kl: KLConfig = Field(KLConfig(), description="KL regularisation toward the reference")
    ppo: PPOConfig = Field(PPOConfig(), description="update settings (every algorithm but online_dpo)")
    rejection: RejectionSamplingConfig = Field(RejectionSamplingConfig(), description="rejection_sampling's settings")
    dpo: OnlineDPOConfig = Field(OnlineDPOConfig(), description="online_dpo's settings")
    actor: ActorConfig = Field(default_factory=ActorConfig, description="the policy's training engine")
    critic: CriticConfig = Field(default_factory=CriticConfig, description="the critic's training engine")
    num_rollout_engines: int = Field(1, ge=1, description="rollout engines; a step's prompts are split across them")
    colocate_reference_and_reward: bool = Field(True, description="reference and reward model in one scorer actor")
    colocate_all: bool = Field(
        False, description="actor, critic, reference, reward model and rollout engines share the same "
        "devices (one Ray placement group, fractional shares); rollout engines sleep while the models "
        "train, and the actor's optimizer state leaves the GPU while they generate")
    colocate_offload: Literal["auto", "always", "never"] = Field(
        "auto", description="colocate_all on GPUs: always: engines sleep and training state leaves the GPU "
        "every step; never: everything stays; auto: stays from the first update on where it all fits at once")
    async_rollouts: bool = Field(
        False, description="generate the next steps' rollouts while this step scores and trains: the "
        "engines then sample from a policy up to max_staleness updates behind the one that trains on them "
        "(corrected by ppo.tis_cap's truncated importance sampling); the reference and reward model score "
        "each generation as soon as it ends, beside the step that trains. Stale samples reused over several "
        "ppo.epochs destabilised one seed of six on the default task: the README's Speed section measures both")
    max_staleness: int = Field(
        1, ge=1, description="async_rollouts: generation runs up to this many policy versions ahead of the "
        "update, and the update publishes its weights without waiting for the engines, which take them "
        "between generations; every sample records its version, and one older than this is refused")
    partial_rollouts: bool = Field(
        False, description="async_rollouts: generate in pieces of partial_tokens new tokens, and take an update "
        "published meanwhile between two pieces, so that it reaches responses still being written; each token "
        "keeps the log-prob of the weights that sampled it, which ppo.tis_cap's correction uses")
    partial_tokens: int = Field(16, ge=1, description="partial_rollouts: new tokens per piece")
    teacher: str | None = Field(
        None, description="algorithm distill: the teacher whose log-probs of the student's samples pull it, a "
        "policy of this pipeline before the round (sft, a preference loss's name, round_k) or a model directory "
        "or hub id (its tokenizer must be the student's)")
    teacher_revision: str | None = Field(
        None, description="the hub teacher's branch, tag or commit (as model.revision); a policy of this "
        "pipeline or a directory has none")
    start_from: str | None = Field(
        None, description="the policy the round starts from, a policy of this pipeline before it (base, sft, a "
        "preference loss's name, round_k); None: the previous round's (or the preference policy, SFT, or the "
        "base model)")
    reference: str | None = Field(
        None, description="the policy the round's KL term (online DPO: its loss) pulls toward: a policy of this "
        "pipeline before the round (base, sft, a preference loss's name, round_k), or start: the policy the round "
        "starts from (ProRL's reference reset, anew each round); None: the policy the rounds started from (the "
        "preference policy, SFT, or the base model)")
    environment: EnvironmentConfig | None = Field(
        None, description="episodes over several turns in an environment (with its tools); reward.source "
        "environment rewards their returns; None: one response per prompt")
    scorer_placement: Placement = Field(default_factory=Placement, description="reference / reward / teacher actors")
    checkpoint_every: int = Field(10, ge=1, description="steps between resumable checkpoints")

    spec = property(lambda self: get_algorithm(self.algorithm), doc="the algorithm's AlgorithmSpec")

    @property
    def max_response_tokens(self) -> int:
        """The most sampled tokens one row can hold: generation.max_new_tokens; in an environment (or an
        agent's endpoint, which keeps to the same limits) an episode's, min(max_turns * per-turn tokens,
        max_episode_tokens). DAPO's overlong shaping and Dr. GRPO's constant read it."""
        new = self.generation.max_new_tokens
        return new if self.environment is None else self.environment.episode_tokens(new)

    @property
    def clip_replaced_by(self) -> str | None:
        """What takes the clip's place in this round's surrogate (SAPO's gate, KL-Cov's penalty); None: it has a
        clip. resolved() fills in no clip range then, and check_round refuses one given."""
        if self.spec.policy_loss == "sapo_gate":
            return "its soft gate takes the clip's place (ppo.sapo_temperatures)"
        if self.spec.policy_loss == "vanilla":
            return "its plain policy gradient has no ratio to clip"
        if self.ppo.covariance is not None and self.ppo.covariance.method == "kl_cov":
            return "ppo.covariance kl_cov takes the clip's place (its penalty)"
        return None

    @property
    def kl_coef(self) -> float:
        """The KL coefficient the round runs with: kl.coef, or the algorithm's default (0.05; GPG's 0); a teacher's
        round has none (resolved() sets 0)."""
        return self.spec.kl_coef if self.kl.coef is None else self.kl.coef

    @property
    def uses_reference(self) -> bool:
        """The spec has a reference and its update reads it (online DPO), or a KL term needs it (a coefficient
        > 0; the adaptive controller starts from one), or a teacher sits where it would. Otherwise no
        reference model is started or run."""
        s = self.spec
        return s.teacher or (s.reference and (s.reference_in_update or self.kl_coef > 0))

    @property
    def needs_reward_model(self) -> bool:
        """Scores with the reward model, or starts its critic from it."""
        return self.reward.uses_model or (self.spec.critic and self.critic.init == "reward_model")

    def resolved(self) -> RoundConfig:
        """This round with the algorithm's defaults filled in (what a round runs and is keyed by)."""
        s = self.spec
        kl = self.kl.model_copy(update={"apply_as": self.kl.apply_as or s.kl_apply_as,
                                        "estimator": self.kl.estimator or s.kl_estimator, "coef": self.kl_coef})
        p = self.ppo
        clipped = self.clip_replaced_by is None
        ppo = p.model_copy(update={
            "loss_agg": p.loss_agg or s.loss_agg,
            "clip_low": s.clip_low if p.clip_low is None and clipped else p.clip_low,
            "clip_high": s.clip_high if p.clip_high is None and clipped else p.clip_high,
            "advantage_std_norm": s.group_std_norm if p.advantage_std_norm is None else p.advantage_std_norm})
        if s.teacher:  # the teacher's pull is the signal; no KL term to a reference besides it
            kl = kl.model_copy(update={"coef": 0.0, "adaptive": False})
        return self.model_copy(update={"kl": kl, "ppo": ppo})

    @model_validator(mode="before")
    @classmethod
    def _sections_of_the_algorithm(cls, data):
        """As the user wrote it (a resolved round fills kl and ppo in itself): sections the update ignores are
        errors, not silently unused."""
        if not isinstance(data, dict):
            return data
        algorithm = data.get("algorithm", cls.model_fields["algorithm"].default)
        dpo_update = algorithm in ALGORITHMS and ALGORITHMS[algorithm].update == "online_dpo"

        def changed(key: str, section: type[Section], allowed: tuple[str, ...] = ()) -> bool:
            """The section differs from its defaults (an invalid one is left to its own field's error)."""
            value = data.get(key)
            if value is None:
                return False
            try:
                given = section.model_validate(value).model_dump(exclude=set(allowed))
            except ValidationError:
                return False
            return given != section().model_dump(exclude=set(allowed))

        distill = algorithm in ALGORITHMS and ALGORITHMS[algorithm].teacher
        if distill and changed("kl", KLConfig, ("budget",)):
            raise ValueError(f"{algorithm}'s pull is its teacher's (each token's reverse KL to it): there is no "
                             f"separate KL term; leave out kl (kl.budget, the held-out KL to SFT it must stay "
                             f"within, is the one field it reads)")
        # Updates that read neither kl nor ppo (but kl.budget, and the ppo fields named): (the algorithm that
        # has it, its own section, the ppo fields it reads, what it does instead).
        update = ALGORITHMS[algorithm].update if algorithm in ALGORITHMS else None
        unread = {"online_dpo": ("online_dpo", "dpo", OnlineDPOConfig, (), "takes DPO steps: its pull toward the "
                                 "reference is dpo.beta and its updates dpo.epochs / dpo.pairs_per_update"),
                  "best_of_n_sft": ("rejection_sampling", "rejection", RejectionSamplingConfig, ("minibatch_size",),
                                    "fine-tunes on its winners, with no reference and no policy-gradient loss (it "
                                    "reads ppo.minibatch_size, the rows of an update)")}
        for name, (owner, own, section, reads, does) in unread.items():
            if update == name:
                ignored = [k for k, s, ok in (("kl", KLConfig, ("budget",)), ("ppo", PPOConfig, reads))
                           if changed(k, s, ok)]
                if ignored:
                    raise ValueError(f"{algorithm} {does}; leave out {' and '.join(ignored)} (kl.budget, the "
                                     f"held-out KL it must stay within, is the one kl field it reads)")
            elif changed(own, section):
                raise ValueError(f"the {own} section is {owner}'s; this round's algorithm is {algorithm}")
        return data

    @model_validator(mode="after")
    def _consistent(self) -> RoundConfig:
        check_round(self)
        return self
