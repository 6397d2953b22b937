"""PPO-style clipped policy loss and value loss.

Also re-exports :func:`aggregate_loss` and the entropy helpers.

Numerical safety: log-ratios are clamped to ``[-LOG_RATIO_CLAMP,
LOG_RATIO_CLAMP]`` (20) before ``exp``, so ratios stay within
``[2e-9, 4.9e8]`` and everything stays finite for logprob differences of
any size. Tokens beyond the clamp get no gradient through the ratio; they
are far outside any sensible clip range anyway. Padding (``action_mask ==
0``) is replaced by 0 before any arithmetic, so garbage there can change
neither the loss nor the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .aggregate import LOSS_AGGREGATIONS, aggregate_loss
from .entropy import entropy_bonus_loss, entropy_from_logits
from .importance import LOG_RATIO_CLAMP, token_ratios, weights_if_rollout
from ..masked import _bool_mask, _check_same_shape, masked_mean

__all__ = [
    "LOG_RATIO_CLAMP",
    "LOSS_AGGREGATIONS",
    "PolicyLossOutput",
    "ValueLossOutput",
    "aggregate_loss",
    "entropy_bonus_loss",
    "entropy_from_logits",
    "clipped_surrogate",
    "ppo_policy_loss",
    "value_loss",
]


@dataclass(frozen=True)
class PolicyLossOutput:
    """PPO loss (differentiable 0-d ``loss``) and detached 0-d metrics.

    ``token_loss`` is the ``(B, T)`` per-token loss (0 at padding, attached).
    ``clip_fraction``: share of valid tokens where the clipped term is the
    active one; ``dual_clip_fraction``: share where the dual-clip cap bites;
    ``approx_kl``: masked mean of ``(ratio - 1) - log ratio`` (k3 estimate of
    KL(pi_old || pi), from the token log-ratios); ``tis_weight_mean``: mean
    rollout importance weight (1 when TIS is off); ``tis_masked_fraction``:
    share of valid tokens whose weight the ``"mask"`` mode or ``tis_veto`` set to 0;
    ``cov_fraction``: the share a covariance control (Clip-Cov, KL-Cov,
    :mod:`algos.losses.surrogates.covariance`) acted on; None without one.
    """

    loss: Tensor
    token_loss: Tensor
    clip_fraction: Tensor
    dual_clip_fraction: Tensor
    approx_kl: Tensor
    ratio_mean: Tensor
    tis_weight_mean: Tensor
    tis_masked_fraction: Tensor
    cov_fraction: Optional[Tensor] = None


def clipped_surrogate(
    ratio: Tensor,
    log_ratio: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    old_logprobs: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: Optional[float],
    agg: str,
    loss_scale_constant: Optional[float],
    rollout_logprobs: Optional[Tensor],
    tis_cap: Optional[float],
    tis_low: Optional[float],
    tis_mode: str,
    tis_level: str = "token",
    tis_veto: Optional[float] = None,
) -> PolicyLossOutput:
    """The clipped surrogate given per-token ratios (shared by PPO and GSPO).

    Formula: ``l = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)``; for
    ``A < 0`` and ``dual_clip = c``: ``l = min(l, -c A)``; with
    ``rollout_logprobs``: ``l *= w`` (:func:`rollout_importance_weights`);
    reduced by :func:`aggregate_loss`. ``log_ratio`` (token-level
    ``log pi - log pi_old``, 0 at padding) feeds the ``approx_kl`` metric.

    Shapes: every tensor ``(B, T)``; returns :class:`PolicyLossOutput`.

    Reference: Schulman et al. 2017, arXiv 1707.06347; Ye et al. 2019,
    arXiv 1912.09729 (dual clip).
    """
    loss, clip_active, dual_active = clipped_token_loss(ratio, advantages, action_mask, clip_low=clip_low,
                                                        clip_high=clip_high, dual_clip=dual_clip)
    return weighted_policy_loss(loss, ratio, log_ratio, action_mask, old_logprobs, clip_active, dual_active,
                                agg=agg, loss_scale_constant=loss_scale_constant, rollout_logprobs=rollout_logprobs,
                                tis_cap=tis_cap, tis_low=tis_low, tis_mode=tis_mode,
                                tis_level=tis_level, tis_veto=tis_veto)


def clipped_token_loss(ratio: Tensor, advantages: Tensor, action_mask: Tensor, *, clip_low: float, clip_high: float,
                       dual_clip: Optional[float]) -> tuple[Tensor, Tensor, Tensor]:
    """Each token's clipped-surrogate loss, before importance weights and reduction, and where each clip bit.

    Formula: ``l = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``; for ``A < 0`` and ``dual_clip = c``:
    ``l = min(l, -c A)``; 0 at padding. ``clip_active``: the clipped term is the larger; ``dual_active``: the cap.

    Shapes: every tensor ``(B, T)``; returns ``(loss, clip_active, dual_active)``, each ``(B, T)``.

    Reference: Schulman et al. 2017, arXiv 1707.06347; Ye et al. 2019, arXiv 1912.09729 (dual clip).
    """
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low/clip_high must be >= 0, got {clip_low}, {clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    mask = _bool_mask(action_mask)
    zeros = torch.zeros_like(ratio)
    adv = torch.where(mask, advantages.detach().to(ratio.dtype), zeros)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = (clipped > unclipped) & mask
    dual_active = torch.zeros_like(mask)
    if dual_clip is not None:
        cap = -dual_clip * adv
        dual_active = (adv < 0) & (loss > cap) & mask
        loss = torch.where(dual_active, cap, loss)
    return loss, clip_active, dual_active


def weighted_policy_loss(loss: Tensor, ratio: Tensor, log_ratio: Tensor, action_mask: Tensor, old_logprobs: Tensor,
                         clip_active: Tensor, dual_active: Tensor, *, agg: str, loss_scale_constant: Optional[float],
                         rollout_logprobs: Optional[Tensor], tis_cap: Optional[float], tis_low: Optional[float],
                         tis_mode: str, tis_level: str = "token",
                         tis_veto: Optional[float] = None) -> PolicyLossOutput:
    """A policy loss's last steps, shared by the surrogates (PPO, GSPO, CISPO): each token's loss ``l`` weighted
    by its rollout importance weight (``l *= w``, :func:`weights_if_rollout`), zeroed at padding, reduced by
    :func:`aggregate_loss`, and the metrics of :class:`PolicyLossOutput` (``clip_active``, ``dual_active``:
    the tokens each clip bit on).

    Shapes: every tensor ``(B, T)``; returns :class:`PolicyLossOutput`."""
    mask = _bool_mask(action_mask)
    weight, tis_masked = weights_if_rollout(ratio, old_logprobs, rollout_logprobs, action_mask, tis_cap=tis_cap,
                                            tis_low=tis_low, tis_mode=tis_mode, tis_level=tis_level, tis_veto=tis_veto)
    token_loss = torch.where(mask, loss * weight.to(loss.dtype), torch.zeros_like(loss))
    scalar = aggregate_loss(token_loss, action_mask, agg=agg,
                            loss_scale_constant=loss_scale_constant)
    with torch.no_grad():
        fmask = mask.to(ratio.dtype)
        return PolicyLossOutput(
            loss=scalar,
            token_loss=token_loss,
            clip_fraction=masked_mean(clip_active.to(ratio.dtype), fmask),
            dual_clip_fraction=masked_mean(dual_active.to(ratio.dtype), fmask),
            approx_kl=masked_mean(torch.expm1(log_ratio) - log_ratio, fmask),
            ratio_mean=masked_mean(ratio, fmask),
            # 1 where nothing is valid; a where, not an `if`, so that the host never waits for the device.
            tis_weight_mean=torch.where(mask.any(), masked_mean(weight.to(ratio.dtype), fmask), 1.0),
            tis_masked_fraction=masked_mean(tis_masked.to(ratio.dtype), fmask),
        )


def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
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
    """Clipped surrogate policy loss with clip-higher, dual-clip and TIS.

    Formula, per valid token, ``rho = exp(clamp(logprobs - old_logprobs,
    -20, 20))``:
    ``l = -min(rho * A, clip(rho, 1 - clip_low, 1 + clip_high) * A)``
    (PPO; Schulman et al. 2017, arXiv 1707.06347; asymmetric ``clip_high``
    = DAPO clip-higher, Yu et al. 2025, arXiv 2503.14476).
    Dual clip (``dual_clip = c > 1``; Ye et al. 2019, arXiv 1912.09729):
    for ``A < 0``, ``l = min(l, -c * A)``.
    Rollout importance sampling (rollout engine vs. trainer mismatch):
    with ``rollout_logprobs`` given, ``l *= w`` with the detached weight
    ``w`` of :func:`rollout_importance_weights` (``tis_mode="truncate"``:
    ``w = min(exp(old_logprobs - rollout_logprobs), tis_cap)``, floored at
    ``tis_low`` when given; ``"mask"``: IcePop, tokens with the ratio
    outside ``[tis_low, tis_cap]`` get ``w = 0``; ``tis_level`` "sequence" or
    "geometric": one ratio per response, its product or geometric mean over
    the tokens). ``tis_cap`` is required
    then; the TIS arguments are ignored without ``rollout_logprobs``. The
    scalar loss is :func:`aggregate_loss` (``agg``, ``loss_scale_constant``).
    ``old_logprobs``, ``advantages`` and ``rollout_logprobs`` are treated as
    constants (detached); the gradient flows through ``logprobs`` only.

    Shapes: ``logprobs``, ``old_logprobs``, ``advantages``, ``action_mask``
    and ``rollout_logprobs`` ``(B, T)``; returns :class:`PolicyLossOutput`.
    """
    t = token_ratios(logprobs, old_logprobs, advantages, action_mask)
    return clipped_surrogate(
        t.ratio, t.log_ratio, advantages, action_mask, t.old_logprobs, clip_low=clip_low,
        clip_high=clip_high, dual_clip=dual_clip, agg=agg, loss_scale_constant=loss_scale_constant,
        rollout_logprobs=rollout_logprobs, tis_cap=tis_cap, tis_low=tis_low, tis_mode=tis_mode,
        tis_level=tis_level, tis_veto=tis_veto)


@dataclass(frozen=True)
class ValueLossOutput:
    """Value loss (differentiable 0-d ``loss``) and detached ``clip_fraction``."""

    loss: Tensor
    clip_fraction: Tensor


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    action_mask: Tensor,
    *,
    clip_eps: Optional[float] = None,
    agg: str = "token_mean",
    loss_scale_constant: Optional[float] = None,
) -> ValueLossOutput:
    """Clipped critic regression loss.

    Formula: ``v_c = old + clamp(v - old, -clip_eps, clip_eps)``;
    ``l = 0.5 * max((v - R)^2, (v_c - R)^2)``; without ``clip_eps``
    ``l = 0.5 * (v - R)^2``. Reduced by :func:`aggregate_loss`.
    ``clip_fraction`` = share of valid tokens where the clipped term wins.

    Shapes: ``values``, ``old_values``, ``returns``, ``action_mask``
    ``(B, T)``; returns :class:`ValueLossOutput`.

    Reference: Schulman et al. 2017, arXiv 1707.06347 (value clipping as in
    the OpenAI baselines PPO2 implementation).
    """
    _check_same_shape(values=values, old_values=old_values, returns=returns,
                      action_mask=action_mask)
    mask = _bool_mask(action_mask)
    zeros = torch.zeros_like(values)
    v = torch.where(mask, values, zeros)
    old = torch.where(mask, old_values.detach().to(values.dtype), zeros)
    ret = torch.where(mask, returns.detach().to(values.dtype), zeros)
    loss = (v - ret) ** 2
    clip_active = torch.zeros_like(mask)
    if clip_eps is not None:
        v_clipped = old + (v - old).clamp(-clip_eps, clip_eps)
        loss_clipped = (v_clipped - ret) ** 2
        clip_active = (loss_clipped > loss) & mask
        loss = torch.maximum(loss, loss_clipped)
    token_loss = torch.where(mask, 0.5 * loss, zeros)
    scalar = aggregate_loss(token_loss, action_mask, agg=agg,
                            loss_scale_constant=loss_scale_constant)
    frac = masked_mean(clip_active.to(values.dtype), mask.to(values.dtype)).detach()
    return ValueLossOutput(loss=scalar, clip_fraction=frac)
