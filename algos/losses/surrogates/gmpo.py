"""GMPO: the geometric mean of the token ratios, clipped per token in log space, in place of their arithmetic mean."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..importance import LOG_RATIO_CLAMP, token_ratios
from ..policy import PolicyLossOutput, weighted_policy_loss


def gmpo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    *,
    clip_low: float = 0.4,
    clip_high: float = 0.4,
    dual_clip: Optional[float] = None,
    agg: str = "seq_mean_token_mean",
    loss_scale_constant: Optional[float] = None,
    rollout_logprobs: Optional[Tensor] = None,
    tis_cap: Optional[float] = None,
    tis_low: Optional[float] = None,
    tis_mode: str = "truncate",
    tis_level: str = "token",
    tis_veto: Optional[float] = None,
) -> PolicyLossOutput:
    """Geometric-Mean Policy Optimization loss (GMPO-token form).

    Formula, per valid token, ``x_t = log pi - log pi_old`` and its clip in
    log space ``c_t = clip(x_t, -clip_low, clip_high)`` (the paper's range
    ``(e^-0.4, e^0.4)`` by default): the pessimistic term is
    ``l_t = min(x_t, c_t)`` where ``A_t >= 0`` and ``max(x_t, c_t)`` where
    ``A_t < 0``; the row's geometric-mean ratio is
    ``g_i = exp(clamp((1/|y_i|) sum_t l_t, -20, 20))``. The paper's sequence
    objective ``A_i g_i`` (``|A_i| prod_t |min(r_t A_i, clip(r_t) A_i)|^(1/|y_i|)
    sgn(A_i)``) is written per token as
    ``loss_t = -A_t sg[g_i] exp(l_t - sg[l_t])``: the value ``-A_t g_i``, the
    gradient ``-A_t g_i grad l_t``, so that with ``agg="seq_mean_token_mean"``
    and one advantage per row the loss is ``-(1/G) sum_i A_i g_i`` in value
    and gradient. A token past its clip (``l_t = c_t``) gives no gradient,
    and the mean in log space keeps one extreme token ratio from swinging the
    whole sequence's. With ``rollout_logprobs``: ``loss_t *= w_tis`` as in
    :func:`algos.losses.policy.ppo_policy_loss`. ``dual_clip`` has no meaning
    here and is refused. Metrics as PPO's; ``clip_fraction`` is the share of
    valid tokens whose clip bit, ``ratio_mean`` the token-weighted ``g_i``.

    Shapes: ``logprobs``, ``old_logprobs``, ``advantages``, ``action_mask``
    and ``rollout_logprobs`` ``(B, T)``; returns :class:`PolicyLossOutput`.

    Reference: Zhao et al. 2025, "Geometric-Mean Policy Optimization",
    arXiv 2507.20673 (GMPO).
    """
    if dual_clip is not None:
        raise ValueError("dual_clip caps PPO's clipped surrogate; GMPO clips each token's log-ratio instead")
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low/clip_high must be >= 0, got {clip_low}, {clip_high}")
    t = token_ratios(logprobs, old_logprobs, advantages, action_mask)
    mask, log_ratio, adv, zeros = t.mask, t.log_ratio, t.advantages, torch.zeros_like(t.log_ratio)
    clipped = log_ratio.clamp(-clip_low, clip_high)
    positive = adv >= 0
    # 0 at padding: the log-ratio is 0 there, and so its clip (both bounds are >= 0)
    pessimistic = torch.where(positive, torch.minimum(log_ratio, clipped), torch.maximum(log_ratio, clipped))
    lengths = mask.sum(dim=-1).clamp(min=1).to(log_ratio.dtype)
    geo = torch.exp((pessimistic.sum(dim=-1) / lengths).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).unsqueeze(-1)
    loss = -adv * geo.detach() * torch.exp(pessimistic - pessimistic.detach())
    clip_active = torch.where(positive, log_ratio > clip_high, log_ratio < -clip_low) & mask
    return weighted_policy_loss(loss, torch.where(mask, geo.detach().expand_as(loss), zeros), log_ratio.detach(),
                                action_mask, t.old_logprobs, clip_active, torch.zeros_like(mask), agg=agg,
                                loss_scale_constant=loss_scale_constant, rollout_logprobs=rollout_logprobs,
                                tis_cap=tis_cap, tis_low=tis_low, tis_mode=tis_mode,
                                tis_level=tis_level, tis_veto=tis_veto)
