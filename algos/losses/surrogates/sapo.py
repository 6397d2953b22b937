"""SAPO: a soft, sign-dependent sigmoid gate on each token's ratio in place of PPO's hard clip."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..importance import token_ratios
from ..policy import PolicyLossOutput, weighted_policy_loss

#: A token whose gradient weight the gate brought below this counts in ``clip_fraction`` (SAPO has no hard clip).
ATTENUATED = 0.5


def sapo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    *,
    tau_positive: float = 1.0,
    tau_negative: float = 1.05,
    agg: str = "token_mean",
    loss_scale_constant: Optional[float] = None,
    rollout_logprobs: Optional[Tensor] = None,
    tis_cap: Optional[float] = None,
    tis_low: Optional[float] = None,
    tis_mode: str = "truncate",
    tis_level: str = "token",
    tis_veto: Optional[float] = None,
) -> PolicyLossOutput:
    """Soft Adaptive Policy Optimization loss.

    Formula, per valid token, ``r = exp(clamp(log pi - log pi_old, -20, 20))``
    and the temperature ``tau = tau_positive`` where ``A > 0``, else
    ``tau_negative``: ``f(r) = sigmoid(tau (r - 1)) 4 / tau`` and
    ``l = -f(r) A``. Its gradient is ``-w A grad log pi`` with the weight
    ``w = 4 s (1 - s) r``, ``s = sigmoid(tau (r - 1))``: 1 on policy, as
    PPO's, and decaying smoothly as the ratio leaves 1, where PPO's clip
    cuts it off at once. A larger ``tau_negative`` damps negative-advantage
    tokens faster (their updates spread to many other tokens' logits). With
    ``rollout_logprobs``: ``l *= w_tis`` as in
    :func:`algos.losses.policy.ppo_policy_loss`; reduced by ``agg``.
    ``clip_fraction`` is the share of valid tokens whose gate weight
    ``4 s (1 - s)`` fell below ``ATTENUATED`` (0.5).

    Shapes: ``logprobs``, ``old_logprobs``, ``advantages``, ``action_mask``
    and ``rollout_logprobs`` ``(B, T)``; returns :class:`PolicyLossOutput`.

    Reference: Gao et al. 2025, "Soft Adaptive Policy Optimization",
    arXiv 2511.20347 (SAPO).
    """
    if tau_positive <= 0 or tau_negative <= 0:
        raise ValueError(f"SAPO's temperatures must be > 0, got {tau_positive}, {tau_negative}")
    t = token_ratios(logprobs, old_logprobs, advantages, action_mask)
    tau = torch.where(t.advantages > 0, tau_positive, tau_negative).to(t.ratio.dtype)
    gate = torch.sigmoid(tau * (t.ratio - 1.0))
    loss = -(gate * 4.0 / tau) * t.advantages
    attenuated = (4.0 * gate * (1.0 - gate)).detach() < ATTENUATED
    return weighted_policy_loss(loss, t.ratio, t.log_ratio, action_mask, t.old_logprobs, attenuated & t.mask,
                                torch.zeros_like(t.mask), agg=agg, loss_scale_constant=loss_scale_constant,
                                rollout_logprobs=rollout_logprobs, tis_cap=tis_cap, tis_low=tis_low,
                                tis_mode=tis_mode, tis_level=tis_level, tis_veto=tis_veto)
