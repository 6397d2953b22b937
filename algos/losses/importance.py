"""Importance weights between the rollout engine and the trainer (TIS, IcePop).

The rollout engine (vLLM) samples with its own kernels and precision, so its
log-probabilities of the sampled tokens differ from the trainer's even for
the same weights, and more so when rollouts run one update behind. The
weights here correct (truncate) or drop (mask) the tokens on which the two
disagree. Same conventions as :mod:`algos.losses.policy`: ``(B, T)`` tensors,
log-ratios clamped to ``[-20, 20]`` before ``exp``, padding ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..masked import _bool_mask, _check_same_shape, full_precision

#: Modes of :func:`rollout_importance_weights`.
TIS_MODES = ("truncate", "mask")
#: Levels of :func:`rollout_importance_weights`: what one ratio is taken over.
TIS_LEVELS = ("token", "sequence", "geometric")
#: Log-ratios are clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before exp (finite ratios).
LOG_RATIO_CLAMP = 20.0


def rollout_importance_weights(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    action_mask: Tensor,
    *,
    cap: float,
    low: Optional[float] = None,
    mode: str = "truncate",
    level: str = "token",
    veto: Optional[float] = None,
) -> Tuple[Tensor, Tensor]:
    """Importance weights between the trainer and the rollout engine, truncated or masked.

    Formula, with ``d_t = old_logprobs - rollout_logprobs`` on the valid tokens (the log of the trainer's
    over the sampler's probability of the sampled token), ``rho = exp(clamp(x, -20, 20))`` of

    * ``level="token"``: ``x_t = d_t``, one ratio per token;
    * ``level="sequence"``: ``x = sum_t d_t``, the response's own ratio, on each of its tokens;
    * ``level="geometric"``: ``x = mean_t d_t``, its geometric mean per token, on each of its tokens
      (length-independent, where a long response's sequence ratio leaves any range);

    then:

    * ``mode="truncate"`` (TIS): ``w_t = min(rho_t, cap)``, and
      ``w_t = max(w_t, low)`` when ``low`` is given;
    * ``mode="mask"`` (IcePop): ``w_t = rho_t`` if ``low <= rho_t <= cap``
      else ``0`` (``low`` None: no lower bound), i.e. tokens whose engines
      disagree too much are masked out of the loss; they stay in the loss
      aggregation's denominator, as in the IcePop objective.

    At the sequence levels the mask mode drops or keeps a response whole. With ``veto``, a response in which
    any valid token's own ratio ``exp(d_t)`` lies below it is dropped whole, at any level and mode (weights 0,
    counted as masked): one token the sampler found far likelier than the trainer does marks a response the
    engines disagree on too much to correct. Returns ``(weights, masked)``:
    detached weights (1 at padding) and the bool flags of the valid tokens the mask mode or the veto zeroed
    (in ``"truncate"`` mode, the veto's alone).

    Shapes: ``old_logprobs``, ``rollout_logprobs``, ``action_mask`` ``(B, T)``;
    returns two ``(B, T)`` tensors.

    Reference: TIS, Yao et al. 2025, "Your Efficient RL Framework Secretly
    Brings You Off-Policy RL Training" (blog); IcePop, Ling Team 2025,
    "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale
    Thinking Model", arXiv 2510.18855; the sequence and geometric levels as in
    verl's rollout correction (its rollout_is_level).
    """
    _check_same_shape(old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs, action_mask=action_mask)
    if mode not in TIS_MODES:
        raise ValueError(f"unknown TIS mode {mode!r}; valid: {', '.join(TIS_MODES)}")
    if level not in TIS_LEVELS:
        raise ValueError(f"unknown TIS level {level!r}; valid: {', '.join(TIS_LEVELS)}")
    if cap <= 0:
        raise ValueError(f"tis_cap must be > 0, got {cap}")
    if low is not None and not 0 <= low < cap:
        raise ValueError(f"tis_low must satisfy 0 <= tis_low < tis_cap, got {low} and {cap}")
    if veto is not None and not 0 < veto < 1:
        raise ValueError(f"tis_veto must lie in (0, 1), got {veto}")
    mask = _bool_mask(action_mask)
    zeros = torch.zeros_like(old_logprobs)
    diff = torch.where(mask, old_logprobs - rollout_logprobs, zeros).detach()
    vetoed = torch.zeros_like(mask)
    if veto is not None:  # on each token's own ratio, before any level's aggregation
        vetoed = ((diff < math.log(veto)) & mask).any(dim=-1, keepdim=True) & mask
    if level != "token":
        total = diff.sum(dim=-1, keepdim=True)
        if level == "geometric":
            total = total / mask.sum(dim=-1, keepdim=True).clamp(min=1)
        diff = torch.where(mask, total.expand_as(diff), zeros)
    rho = torch.exp(diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if mode == "truncate":
        weight, masked = rho.clamp(min=low, max=cap), vetoed
    else:
        masked = (((rho > cap) | (rho < (0.0 if low is None else low))) & mask) | vetoed
        weight = rho
    weight = torch.where(masked, zeros, weight)
    return torch.where(mask, weight, torch.ones_like(weight)), masked


def weights_if_rollout(like: Tensor, old_logprobs: Tensor, rollout_logprobs: Optional[Tensor], action_mask: Tensor, *,
                       tis_cap: Optional[float], tis_low: Optional[float], tis_mode: str,
                       tis_level: str = "token", tis_veto: Optional[float] = None) -> Tuple[Tensor, Tensor]:
    """A policy loss's TIS step: :func:`rollout_importance_weights` where ``rollout_logprobs`` are given
    (``tis_cap`` then required), else weights of 1 and nothing masked, shaped and typed as ``like`` (B, T)."""
    if rollout_logprobs is None:
        return torch.ones_like(like), torch.zeros_like(_bool_mask(action_mask))
    if tis_cap is None:
        raise ValueError("tis_cap is required when rollout_logprobs is given")
    _check_same_shape(ratio=like, rollout_logprobs=rollout_logprobs)
    return rollout_importance_weights(old_logprobs.detach(), rollout_logprobs, action_mask, cap=tis_cap, low=tis_low,
                                      mode=tis_mode, level=tis_level, veto=tis_veto)


@dataclass(frozen=True)
class TokenRatios:
    """A token surrogate's inputs, at full precision: ``mask`` (bool), ``logprobs``, ``old_logprobs``,
    ``log_ratio = clamp(log pi - sg(log pi_old), -20, 20)`` (0 at padding; its gradient flows through
    ``logprobs``), ``ratio = exp(log_ratio)`` and ``advantages`` (detached, 0 at padding); each ``(B, T)``."""

    mask: Tensor
    logprobs: Tensor
    old_logprobs: Tensor
    log_ratio: Tensor
    ratio: Tensor
    advantages: Tensor

    def score(self) -> Tensor:
        """``exp(log pi - sg(log pi))`` on the valid tokens (1 at padding, no gradient there): value 1, gradient
        ``grad log pi``, so that ``-w A score()`` is a policy gradient weighted by ``w`` on the surrogates'
        scale (CISPO's, the plain one's)."""
        lp = torch.where(self.mask, self.logprobs, torch.zeros_like(self.logprobs))
        return torch.exp(lp - lp.detach())


def token_ratios(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, action_mask: Tensor) -> TokenRatios:
    """What every token-ratio surrogate starts from (:class:`TokenRatios`): shapes checked, fp16 and bf16 taken to
    fp32 (fp16's exp overflows at 11, inside the clamp; bf16's ratios step by 0.4 % near 1), padding zeroed."""
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, action_mask=action_mask)
    mask = _bool_mask(action_mask)
    logprobs, old_logprobs = full_precision(logprobs), full_precision(old_logprobs)
    zeros = torch.zeros_like(logprobs)
    log_ratio = torch.where(mask, logprobs - old_logprobs.detach(), zeros).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    adv = torch.where(mask, advantages.detach().to(logprobs.dtype), zeros)
    return TokenRatios(mask, logprobs, old_logprobs, log_ratio, torch.exp(log_ratio), adv)
