"""OPO's estimator: the group baseline weighted by response length (the variance-optimal one)."""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from .estimators import (AdvantageOutput, _no_std_norm, _plus_process, _sequence_output, register_advantage_estimator,
                         sequence_scores)
from .group import length_weighted_advantages
from .process import StepRewards
from ..masked import _bool_mask, _check_same_shape


@register_advantage_estimator("opo")
def opo_estimator(*, token_rewards: Tensor, action_mask: Tensor, values: Optional[Tensor],
                  group_size: int, gamma: float, lam: float, eps: float,
                  std_norm: Optional[bool] = None, steps: Optional[StepRewards] = None) -> AdvantageOutput:
    """OPO advantage, broadcast to every valid token.

    Formula: ``A_{i,t} = s_i - sum_{j in G(i)} l_j s_j / sum_{j in G(i)} l_j`` with ``l_j`` row j's valid
    tokens (:func:`algos.advantages.group.length_weighted_advantages`); no std division. With dense step
    rewards, their process advantage without std (as Dr. GRPO's). ``returns == advantages``.

    Shapes: ``token_rewards``, ``action_mask`` ``(B, T)``, ``B = n * group_size``.

    Reference: Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline", arXiv 2505.23585.
    """
    _no_std_norm("opo", std_norm)
    _check_same_shape(token_rewards=token_rewards, action_mask=action_mask)
    s = sequence_scores(token_rewards, action_mask).detach()
    lengths = _bool_mask(action_mask).sum(dim=-1)
    out = _sequence_output(length_weighted_advantages(s, lengths, group_size), action_mask, token_rewards)
    return _plus_process(out, steps, action_mask, group_size, eps, False)
