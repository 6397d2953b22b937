"""alignflow.algos: the pure-math layer of the RLHF framework.

Pure torch + Python stdlib; no engine, orchestration or tracking imports.
Token-level tensors are ``(batch, response_len)``; ``action_mask`` is 1 on
real response tokens. Group layouts are ``n_prompts * group_size`` rows with
each prompt's samples contiguous.
"""

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageOutput,
    UnknownAdvantageEstimatorError,
    get_advantage_estimator,
    register_advantage_estimator,
    sequence_scores,
)
from .aggregate import LOSS_AGGREGATIONS, aggregate_loss
from .dapo import dynamic_sampling_filter, overlong_penalty
from .entropy import entropy_bonus_loss, entropy_from_logits
from .group import (
    constant_groups,
    group_centered_advantages,
    group_mean,
    group_normalized_advantages,
    leave_one_out_advantages,
)
from .kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    kl_penalized_rewards,
)
from .masked import (
    last_valid_index,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    place_at_last_token,
)
from .policy_loss import (
    LOG_RATIO_CLAMP,
    PolicyLossOutput,
    ValueLossOutput,
    ppo_policy_loss,
    value_loss,
)
from .preference import (
    DPO_LOSS_TYPES,
    KTOLossOutput,
    PreferenceLossOutput,
    dpo_loss,
    kto_loss,
    pairwise_reward_loss,
    sequence_logprobs,
)
from .returns import compute_gae, discounted_returns

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdaptiveKLController",
    "AdvantageOutput",
    "DPO_LOSS_TYPES",
    "FixedKLController",
    "KL_ESTIMATORS",
    "KTOLossOutput",
    "LOG_RATIO_CLAMP",
    "LOSS_AGGREGATIONS",
    "PolicyLossOutput",
    "PreferenceLossOutput",
    "UnknownAdvantageEstimatorError",
    "ValueLossOutput",
    "aggregate_loss",
    "compute_gae",
    "constant_groups",
    "discounted_returns",
    "dpo_loss",
    "dynamic_sampling_filter",
    "entropy_bonus_loss",
    "entropy_from_logits",
    "get_advantage_estimator",
    "group_centered_advantages",
    "group_mean",
    "group_normalized_advantages",
    "kl_estimate",
    "kl_penalized_rewards",
    "kto_loss",
    "last_valid_index",
    "leave_one_out_advantages",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "pairwise_reward_loss",
    "place_at_last_token",
    "ppo_policy_loss",
    "register_advantage_estimator",
    "sequence_logprobs",
    "sequence_scores",
    "value_loss",
]
