"""GPG's estimator: the group-centred advantage scaled up by the share of rows that carry a gradient."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .estimators import AdvantageOutput, _group_output, register_advantage_estimator
from .process import StepRewards
from ..masked import _bool_mask


def gradient_row_scale(advantages: Tensor, action_mask: Tensor) -> Tensor:
    """GPG's correction ``alpha``: the rows with a valid token over those whose advantage is not 0 at one.

    Formula: ``alpha = B / max(B - M, 1)`` with ``B`` the rows that have a valid token (a row with none
    counts in no loss mean) and ``M`` those of them whose advantage is 0 at every valid token: rows that add
    nothing to the gradient, but count in a token or row mean's denominator all the same. For 0/1 rewards
    with nothing added to them (no KL in the reward, no length penalty) these are exactly the paper's
    invalid samples, those of groups all right or all wrong. Detached; a 0-d tensor on the advantages'
    device, computed there (no host sync).

    Shapes: ``advantages``, ``action_mask`` ``(B, T)``; returns ``()``.

    Reference: Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
    Reasoning", arXiv 2504.02546, eq. for the corrected advantage.
    """
    mask = _bool_mask(action_mask)
    carries = ((advantages != 0) & mask).any(dim=-1).sum().to(advantages.dtype)
    return (mask.any(dim=-1).sum().to(advantages.dtype) / carries.clamp(min=1.0)).detach()


@register_advantage_estimator("gpg")
def gpg_estimator(*, token_rewards: Tensor, action_mask: Tensor, values: Optional[Tensor],
                  group_size: int, gamma: float, lam: float, eps: float,
                  std_norm: Optional[bool] = None, steps: Optional[StepRewards] = None) -> AdvantageOutput:
    """GPG advantage, broadcast to every valid token.

    Formula: ``A_{i,t} = alpha (s_i - mean_{G(i)} s) / F`` with ``F = 1`` (``std_norm`` True: the group's
    std plus ``eps``, as GRPO's) and ``alpha = B / (B - M)`` (:func:`gradient_row_scale`, over the rows
    handed in: one step's, every one of which it trains on, on policy in the paper). With dense step rewards
    their process advantage is added before ``alpha`` is taken, so that a row counts as carrying a gradient
    when either part is non-zero. ``returns == advantages``.

    Shapes: ``token_rewards``, ``action_mask`` ``(B, T)``, ``B = n * group_size``.

    Reference: Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
    Reasoning", arXiv 2504.02546.
    """
    out = _group_output(token_rewards, action_mask, group_size, eps, bool(std_norm), steps)
    adv = out.advantages * gradient_row_scale(out.advantages, action_mask)
    return AdvantageOutput(advantages=adv, returns=adv)
