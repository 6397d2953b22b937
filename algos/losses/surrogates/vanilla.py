"""The plain policy gradient: no ratio in the objective, no clip (GPG's loss)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..importance import token_ratios
from ..policy import PolicyLossOutput, weighted_policy_loss


def vanilla_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    *,
    agg: str = "token_mean",
    loss_scale_constant: Optional[float] = None,
    rollout_logprobs: Optional[Tensor] = None,
    tis_cap: Optional[float] = None,
    tis_low: Optional[float] = None,
    tis_mode: str = "truncate",
    tis_level: str = "token",
    tis_veto: Optional[float] = None,
) -> PolicyLossOutput:
    """Policy-gradient loss with no surrogate: the objective is ``A log pi`` itself.

    Formula, per valid token: ``l = -A exp(log pi - sg(log pi))``, whose value is ``-A`` (the clipped
    surrogate's value on policy, so the losses of every surrogate read alike) and whose gradient is
    ``-A grad log pi``, the REINFORCE estimator. The ratio to ``old_logprobs`` is not in the objective:
    after the first optimizer step on a batch the gradient is no longer importance-corrected, which is
    why GPG trains exactly on policy (``ppo.epochs 1``, one minibatch a step); ``ratio_mean`` and
    ``approx_kl`` still report how far the policy moved. With ``rollout_logprobs``: ``l *= w_tis`` as in
    :func:`algos.losses.policy.ppo_policy_loss` (the engines' mismatch). Reduced by ``agg``;
    ``clip_fraction`` is 0, there being no clip.

    Shapes: ``logprobs``, ``old_logprobs``, ``advantages``, ``action_mask`` and ``rollout_logprobs``
    ``(B, T)``; returns :class:`PolicyLossOutput`.

    Reference: Williams 1992 (REINFORCE); Chu et al. 2025, "GPG: A Simple and Strong Reinforcement
    Learning Baseline for Model Reasoning", arXiv 2504.02546 (GPG's loss).
    """
    t = token_ratios(logprobs, old_logprobs, advantages, action_mask)
    loss = -t.advantages * t.score()  # value -A, gradient -A grad log pi
    none = torch.zeros_like(t.mask)
    return weighted_policy_loss(loss, t.ratio, t.log_ratio, action_mask, t.old_logprobs, none, none, agg=agg,
                                loss_scale_constant=loss_scale_constant, rollout_logprobs=rollout_logprobs,
                                tis_cap=tis_cap, tis_low=tis_low, tis_mode=tis_mode,
                                tis_level=tis_level, tis_veto=tis_veto)
