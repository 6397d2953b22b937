"""How a round's policy update is shaped: KL toward the reference, the PPO-style update settings and the entropy's
covariance control."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from alignflow.algorithms import KLEstimator, KLPlacement, LossAggregation
from alignflow.config.base import Section


class KLConfig(Section):
    """KL regularisation toward the reference policy (SFT, or the base model without SFT)."""

    estimator: KLEstimator | None = Field(None, description="k1 | k2 | k3; None: the algorithm's default")
    apply_as: KLPlacement | None = Field(
        None, description="reward (PPO-style penalty) | loss (GRPO-style); None: the algorithm's default")
    coef: float | None = Field(None, ge=0, description="KL coefficient (adaptive: its start); 0: no KL term; None: "
                               "the algorithm's default (0.05; gpg 0, no reference model started)")
    adaptive: bool = Field(False, description="adapt coef to keep the KL near target")
    target: float = Field(1.0, gt=0, description="adaptive controller target KL (Ziegler et al. 2019)")
    horizon: int = Field(10000, ge=1, description="adaptive controller's horizon, in rollouts")
    clamp: float | None = Field(10.0, gt=0, description="log-ratio clamp [-clamp, clamp] in KL estimates; None: off")
    budget: float = Field(3.0, gt=0, description="max acceptable held-out KL to SFT (the evaluation's reference, "
                          "or the base model without SFT), whatever the round's reference")

    @model_validator(mode="after")
    def _adaptive_from_a_start(self) -> KLConfig:
        # The controller multiplies the coefficient (algos/kl.py AdaptiveKLController): from 0 it stays 0.
        if self.adaptive and self.coef == 0:
            raise ValueError("kl.adaptive scales kl.coef by (1 + error x steps / horizon) each step, so from "
                             "kl.coef: 0 it stays 0 and the round has no KL term: give the start (e.g. 0.05), or "
                             "adaptive: false for none")
        return self


# The covariance controls' settings in Cui et al. 2025 (Qwen2.5-7B): the share of tokens each acts on.
COVARIANCE_FRACTION = {"clip_cov": 2e-4, "kl_cov": 2e-3}


class CovarianceConfig(Section):
    """Clip-Cov / KL-Cov (Cui et al. 2025, arXiv 2505.22617): keep the policy's entropy from collapsing by acting
    on the few tokens whose log-prob and advantage covary most (algos/losses/surrogates/covariance.py)."""

    method: Literal["clip_cov", "kl_cov"] = Field(
        description="clip_cov: PPO's clip, and a random few such tokens lose their gradient; kl_cov: no clip, and "
        "the top few get a |log ratio| penalty")
    fraction: float | None = Field(
        None, gt=0, le=1, description="share of a micro-batch's valid tokens it acts on (at least one); None: the "
        "paper's, 2e-4 for clip_cov and 2e-3 for kl_cov")
    bounds: tuple[float, float] = Field((1.0, 5.0), description="clip_cov: the covariance range of the tokens it "
                                        "may cut")
    kl_coef: float = Field(1.0, ge=0, description="kl_cov: the penalty's weight")

    share = property(lambda self: self.fraction or COVARIANCE_FRACTION[self.method], doc="fraction, or its default")

    @model_validator(mode="after")
    def _settings_of_the_method(self) -> CovarianceConfig:
        if self.bounds[0] >= self.bounds[1]:
            raise ValueError(f"ppo.covariance.bounds must be [low, high] with low < high, got {list(self.bounds)}")
        unread = {"clip_cov": "kl_coef", "kl_cov": "bounds"}[self.method]
        if getattr(self, unread) != type(self).model_fields[unread].default:
            raise ValueError(f"ppo.covariance.{unread} is not read by {self.method}: leave it out")
        return self


class PPOConfig(Section):
    """Update settings: PPO epochs over minibatches, clipping, value loss."""

    epochs: int = Field(2, ge=1, description="passes over a step's rollouts")
    minibatch_size: int = Field(64, ge=1, description="rollouts per optimizer step")
    clip_low: float | None = Field(
        None, gt=0, description="None: the algorithm's default (0.2; gspo 3e-4; cispo 1: its weight has no lower bound)")
    clip_high: float | None = Field(
        None, gt=0, description="> clip_low: DAPO clip-higher; None: the algorithm's default (0.2; gspo 4e-4; cispo 5)")
    dual_clip: float | None = Field(None, gt=1, description="dual-clip c: A < 0 loss capped at -c·A; None: off")
    value_clip: float | None = Field(0.2, gt=0, description="clip of critic values around their old values; None: off")
    gamma: float = Field(1.0, ge=0, le=1, description="discount (GAE, REINFORCE++ returns)")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda (algorithms with a critic)")
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus weight; 0: off")
    loss_agg: LossAggregation | None = Field(None, description="None: the algorithm's default")
    sapo_temperatures: tuple[float, float] = Field(
        (1.0, 1.05), description="sapo: its gate's temperatures for positive and negative advantages (the larger "
        "damps faster)")
    covariance: CovarianceConfig | None = Field(
        None, description="Clip-Cov or KL-Cov on PPO's token surrogate, against entropy collapse; None: off")
    high_entropy_fraction: float | None = Field(
        None, gt=0, le=1, description="the policy gradient only on this share of each micro-batch's tokens, those "
        "of highest entropy (0.2: the 80/20 rule of Wang et al. 2025, arXiv 2506.01939); the KL and entropy terms "
        "keep every token; None: every token")
    tis_cap: float | None = Field(
        2.0, gt=0, description="importance sampling between the rollout engine's and the trainer's logprobs: the "
        "upper bound of the ratio exp(old - rollout); None: off")
    tis_mode: Literal["truncate", "mask"] = Field(
        "truncate", description="truncate: weight min(ratio, tis_cap) (TIS, floored at tis_low when set); mask: "
        "IcePop, tokens whose ratio lies outside [tis_low, tis_cap] are masked out of the loss (counted in "
        "tis_masked_fraction)")
    tis_low: float | None = Field(
        None, gt=0, description="lower bound of the ratio (IcePop uses 0.5 with tis_cap 5); None: none")
    tis_level: Literal["token", "sequence", "geometric"] = Field(
        "token", description="what one ratio is taken over: token: each token's own; sequence: the response's "
        "(the product of its tokens' ratios) on every token of it; geometric: their geometric mean, on every token "
        "of it (a length-free sequence ratio); with mask, sequence and geometric drop or keep a response whole")
    tis_veto: float | None = Field(
        None, gt=0, lt=1, description="drop a response whole where any of its tokens' own ratio exp(old - rollout) "
        "lies below this (verl's rollout_is_veto_threshold, e.g. 1e-4), whatever tis_level and tis_mode; counted "
        "in tis_masked_fraction; None: off")
    advantage_std_norm: bool | None = Field(
        None, description="divide group advantages by the group std (grpo: true, dr_grpo: false); None: the "
        "algorithm's default; only for algorithms with group-normalised advantages")
    dynamic_sampling: bool = Field(False, description="DAPO: drop groups whose task rewards (before normalising, clip "
                                   "and penalties, as DAPO reads accuracy) are all equal")
    dynamic_sampling_mean_range: tuple[float, float] | None = Field(
        None, description="[low, high]: train only on groups whose mean task reward (before reward.normalize, "
        "clip and penalties) lies in it (e.g. pass rate [0.1, 0.9]), beside dynamic_sampling; dropped groups "
        "are counted; None: off")

    @model_validator(mode="after")
    def _importance_sampling(self) -> PPOConfig:
        if self.tis_cap is None and (self.tis_mode != "truncate" or self.tis_low is not None
                                     or self.tis_level != "token" or self.tis_veto is not None):
            raise ValueError("ppo.tis_mode / ppo.tis_low / ppo.tis_level / ppo.tis_veto need ppo.tis_cap (importance "
                             "sampling is off without it)")
        if self.tis_low is not None and self.tis_cap is not None and self.tis_low >= self.tis_cap:
            raise ValueError(f"ppo.tis_low ({self.tis_low}) must be < ppo.tis_cap ({self.tis_cap})")
        if min(self.sapo_temperatures) <= 0:
            raise ValueError(f"ppo.sapo_temperatures must be > 0, got {list(self.sapo_temperatures)}")
        r = self.dynamic_sampling_mean_range
        if r is not None and r[0] > r[1]:
            raise ValueError(f"ppo.dynamic_sampling_mean_range must be [low, high] with low <= high, got {list(r)}")
        return self
