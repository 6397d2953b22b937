"""alignflow.algos: the pure-math layer of the RLHF framework.

Pure torch + Python stdlib; no engine, orchestration or tracking imports.
Token-level tensors are ``(batch, response_len)``; ``action_mask`` is 1 on
real response tokens. Group layouts are ``n_prompts * group_size`` rows with
each prompt's samples contiguous.
"""

from .advantages.estimators import (
    ADVANTAGE_ESTIMATORS,
    AdvantageOutput,
    UnknownAdvantageEstimatorError,
    get_advantage_estimator,
    register_advantage_estimator,
    sequence_scores,
)
from .losses.aggregate import LOSS_AGGREGATIONS, aggregate_loss, aggregate_weight
from .advantages.dapo import dynamic_sampling_filter, group_mean_filter, overlong_penalty
from .losses.distill import distillation_token_rewards, reverse_kl_per_token, topk_forward_kl
from .losses.entropy import entropy_bonus_loss, entropy_from_logits, high_entropy_tokens
from .evaluation import (
    MarginBin,
    accuracy_by_margin_bin,
    majority_vote_accuracy,
    normalize_response,
    pass_at_k,
    pass_at_k_curve,
)
from .advantages.group import (
    constant_groups,
    group_centered_advantages,
    group_mean,
    group_normalized_advantages,
    leave_one_out_advantages,
    length_weighted_advantages,
)
from .advantages import optimal as _optimal  # noqa: F401  (registers the "opo" estimator)
from .advantages.gpg import gradient_row_scale  # (and registers the "gpg" estimator)
from .losses.surrogates.cispo import cispo_policy_loss
from .losses.surrogates.covariance import clip_cov_policy_loss, kl_cov_policy_loss, token_covariance
from .losses.surrogates.gmpo import gmpo_policy_loss
from .losses.surrogates.gspo import gspo_policy_loss
from .losses.surrogates.sapo import sapo_policy_loss
from .losses.surrogates.vanilla import vanilla_policy_loss
from .losses.importance import TIS_MODES, rollout_importance_weights
from .kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    kl_penalized_rewards,
    sequence_k1,
)
from .masked import (
    last_valid_index,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    place_at_last_token,
)
from .losses.policy import (
    LOG_RATIO_CLAMP,
    PolicyLossOutput,
    ValueLossOutput,
    ppo_policy_loss,
    value_loss,
)
from .losses.dpo import DPO_LOSS_TYPES, SMOOTHED_LOSS_TYPES, dpo_loss
from .losses.preference import (
    KTOLossOutput,
    PreferenceLossOutput,
    best_worst_pairs,
    kto_loss,
    log_odds,
    orpo_loss,
    pairwise_reward_loss,
    sequence_logprobs,
    simpo_loss,
)
from .losses.process import (STEP_AGGREGATIONS, StepwiseLossOutput, first_error_steps, solution_scores,
                             stepwise_reward_loss)
from .advantages.process import StepRewards, process_group_advantages, with_step_rewards
from .advantages.returns import compute_gae, discounted_returns
from .advantages.shaping import RunningMeanStd, clip_rewards, rewards_at_turns, truncation_penalty

__all__ = [
    "StepRewards",
    "process_group_advantages",
    "with_step_rewards",
    "STEP_AGGREGATIONS",
    "StepwiseLossOutput",
    "first_error_steps",
    "solution_scores",
    "stepwise_reward_loss",
    "best_worst_pairs",
    "ADVANTAGE_ESTIMATORS",
    "AdaptiveKLController",
    "AdvantageOutput",
    "DPO_LOSS_TYPES",
    "SMOOTHED_LOSS_TYPES",
    "FixedKLController",
    "KL_ESTIMATORS",
    "KTOLossOutput",
    "LOG_RATIO_CLAMP",
    "LOSS_AGGREGATIONS",
    "MarginBin",
    "PolicyLossOutput",
    "PreferenceLossOutput",
    "RunningMeanStd",
    "TIS_MODES",
    "UnknownAdvantageEstimatorError",
    "ValueLossOutput",
    "accuracy_by_margin_bin",
    "aggregate_loss",
    "aggregate_weight",
    "cispo_policy_loss",
    "clip_cov_policy_loss",
    "clip_rewards",
    "compute_gae",
    "constant_groups",
    "discounted_returns",
    "distillation_token_rewards",
    "dpo_loss",
    "dynamic_sampling_filter",
    "entropy_bonus_loss",
    "entropy_from_logits",
    "high_entropy_tokens",
    "get_advantage_estimator",
    "group_centered_advantages",
    "group_mean",
    "group_mean_filter",
    "group_normalized_advantages",
    "gmpo_policy_loss",
    "gradient_row_scale",
    "gspo_policy_loss",
    "kl_cov_policy_loss",
    "kl_estimate",
    "kl_penalized_rewards",
    "kto_loss",
    "last_valid_index",
    "log_odds",
    "leave_one_out_advantages",
    "length_weighted_advantages",
    "majority_vote_accuracy",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "normalize_response",
    "orpo_loss",
    "overlong_penalty",
    "pairwise_reward_loss",
    "pass_at_k",
    "pass_at_k_curve",
    "place_at_last_token",
    "ppo_policy_loss",
    "vanilla_policy_loss",
    "register_advantage_estimator",
    "reverse_kl_per_token",
    "rollout_importance_weights",
    "sequence_k1",
    "sequence_logprobs",
    "sequence_scores",
    "sapo_policy_loss",
    "simpo_loss",
    "token_covariance",
    "topk_forward_kl",
    "truncation_penalty",
    "rewards_at_turns",
    "value_loss",
]
