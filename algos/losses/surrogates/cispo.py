"""CISPO: a policy gradient weighted by a clipped, detached importance weight (no token loses its gradient)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..importance import token_ratios
from ..policy import PolicyLossOutput, weighted_policy_loss


def cispo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    *,
    clip_low: float = 1.0,
    clip_high: float = 5.0,
    dual_clip: Optional[float] = None,
    agg: str = "token_mean",
    loss_scale_constant: Optional[float] = None,
    rollout_logprobs: Optional[Tensor] = None,
    tis_cap: Optional[float] = None,
    tis_low: Optional[float] = None,
    tis_mode: str = "truncate",
    tis_level: str = "token",
    tis_veto: Optional[float] = None,
) -> PolicyLossOutput:
    """Clipped IS-weight Policy Optimization loss.

    Formula, per valid token, ``rho = exp(clamp(logprobs - old_logprobs, -20,
    20))`` and the detached weight ``w = sg(clip(rho, 1 - clip_low, 1 +
    clip_high))``: the paper's objective ``w A log pi`` has the gradient
    ``w A grad log pi``. It is written here as ``l = -w A exp(log pi -
    sg(log pi))``, with the same gradient and the value ``-w A``, on the
    clipped surrogate's scale; the ratio's clamp touches the weight's value
    only, never the gradient. Unlike PPO's clip, a token whose ratio leaves
    the range keeps its gradient, weighted by the bound.
    With ``rollout_logprobs``: ``l *= w_tis`` as in
    :func:`algos.losses.policy.ppo_policy_loss`. Reduced by ``agg``
    (:func:`aggregate_loss`). Defaults ``clip_low = 1`` (no lower bound:
    ``w >= 0``) and ``clip_high = 5`` (``w <= 6``), NeMo-RL's. ``dual_clip``
    has no meaning here and is refused. Metrics as PPO's: ``clip_fraction``
    is the share of valid tokens whose weight was clipped.

    Shapes: ``logprobs``, ``old_logprobs``, ``advantages``, ``action_mask``
    and ``rollout_logprobs`` ``(B, T)``; returns :class:`PolicyLossOutput`.

    Reference: MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute
    Efficiently with Lightning Attention", arXiv 2506.13585 (CISPO).
    """
    if dual_clip is not None:
        raise ValueError("dual_clip caps PPO's clipped surrogate; CISPO has none to cap")
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low/clip_high must be >= 0, got {clip_low}, {clip_high}")
    t = token_ratios(logprobs, old_logprobs, advantages, action_mask)
    weight = t.ratio.detach().clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = -(weight * t.advantages) * t.score()  # value -w A, gradient -w A grad log pi
    return weighted_policy_loss(loss, t.ratio, t.log_ratio, action_mask, t.old_logprobs, weight != t.ratio,
                                torch.zeros_like(t.mask), agg=agg, loss_scale_constant=loss_scale_constant,
                                rollout_logprobs=rollout_logprobs, tis_cap=tis_cap, tis_low=tis_low, tis_mode=tis_mode,
                                tis_level=tis_level, tis_veto=tis_veto)
