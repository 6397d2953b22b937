"""Clip-Cov and KL-Cov: PPO's surrogate with the few tokens whose log-prob and advantage covary most held back.

Policy entropy falls as the covariance of a token's log-prob and its advantage: tokens both likely and
advantaged (or unlikely and disadvantaged) sharpen the distribution. Acting on a small share of those
tokens keeps the entropy up without damping the rest of the update.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from ..importance import token_ratios
from ..policy import PolicyLossOutput, clipped_token_loss, weighted_policy_loss
from ...masked import _bool_mask, _check_same_shape, masked_mean, top_k_mask, top_share

#: The paper's settings (Qwen2.5-7B): Clip-Cov's share and covariance bounds; KL-Cov's share and penalty weight.
CLIP_COV_FRACTION, CLIP_COV_BOUNDS, KL_COV_FRACTION, KL_COV_COEF = 2e-4, (1.0, 5.0), 2e-3, 1.0


def token_covariance(logprobs: Tensor, advantages: Tensor, action_mask: Tensor) -> Tensor:
    """Each token's centred product of its log-prob and advantage, over the batch's valid tokens.

    Formula: ``cov_t = (log pi_t - mean(log pi)) (A_t - mean(A))`` with the means over the valid tokens;
    0 at padding. Detached: it chooses tokens, it is no loss.

    Shapes: ``(B, T)`` each; returns ``(B, T)``.

    Reference: Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
    Models", arXiv 2505.22617, eq. (11).
    """
    _check_same_shape(logprobs=logprobs, advantages=advantages, action_mask=action_mask)
    mask = _bool_mask(action_mask)
    fmask = mask.to(torch.float32)
    lp, adv = logprobs.detach().float(), advantages.detach().float()
    cov = (lp - masked_mean(lp, fmask)) * (adv - masked_mean(adv, fmask))
    return torch.where(mask, cov, torch.zeros_like(cov))


def clip_cov_policy_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, action_mask: Tensor, *,
    clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: Optional[float] = None, agg: str = "token_mean",
    loss_scale_constant: Optional[float] = None, rollout_logprobs: Optional[Tensor] = None,
    tis_cap: Optional[float] = None, tis_low: Optional[float] = None, tis_mode: str = "truncate",
    tis_level: str = "token", tis_veto: Optional[float] = None, fraction: float = CLIP_COV_FRACTION,
    bounds: tuple[float, float] = CLIP_COV_BOUNDS,
    generator: Optional[torch.Generator] = None,
) -> PolicyLossOutput:
    """Clip-Cov: PPO's clipped surrogate, with a random few high-covariance tokens' gradients cut.

    Formula: ``l_t`` as :func:`algos.losses.policy.ppo_policy_loss` (clip, dual clip, TIS). Of the valid
    tokens the clip left alone whose :func:`token_covariance` lies in ``(bounds[0], bounds[1])``,
    ``k = max(floor(fraction * n_valid), 1)`` chosen uniformly at random (from ``generator``, on the tensors'
    device; None: torch's own, which a trainer seeds and keeps in its resume state) get ``l_t = 0``: no
    gradient, still counted by ``agg``'s denominators; none where no token lies in the bounds.
    ``cov_fraction``: the share of valid tokens cut.

    Shapes: as :func:`algos.losses.policy.ppo_policy_loss`; returns :class:`PolicyLossOutput`.

    Reference: Cui et al. 2025, arXiv 2505.22617, sec. 4 (Clip-Cov; ``r = 2e-4``, bounds ``(1, 5)``).
    """
    if not 0 < fraction <= 1 or bounds[0] >= bounds[1]:
        raise ValueError(f"clip_cov needs 0 < fraction <= 1 and bounds low < high, got {fraction}, {bounds}")
    t = token_ratios(logprobs, old_logprobs, advantages, action_mask)
    loss, clip_active, dual_active = clipped_token_loss(t.ratio, advantages, action_mask, clip_low=clip_low,
                                                        clip_high=clip_high, dual_clip=dual_clip)
    cov = token_covariance(t.logprobs, advantages, action_mask)
    eligible = t.mask & ~clip_active & ~dual_active & (cov > bounds[0]) & (cov < bounds[1])
    draws = torch.rand(cov.shape, generator=generator, device=cov.device)
    cut = top_k_mask(draws, eligible, top_share(action_mask, fraction))
    loss = torch.where(cut, torch.zeros_like(loss), loss)
    out = weighted_policy_loss(loss, t.ratio, t.log_ratio, action_mask, t.old_logprobs, clip_active, dual_active,
                               agg=agg, loss_scale_constant=loss_scale_constant, rollout_logprobs=rollout_logprobs,
                               tis_cap=tis_cap, tis_low=tis_low, tis_mode=tis_mode,
                               tis_level=tis_level, tis_veto=tis_veto)
    return dataclasses.replace(out, cov_fraction=masked_mean(cut.to(t.ratio.dtype), t.mask.to(t.ratio.dtype)))


def kl_cov_policy_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, action_mask: Tensor, *,
    agg: str = "token_mean", loss_scale_constant: Optional[float] = None,
    rollout_logprobs: Optional[Tensor] = None, tis_cap: Optional[float] = None, tis_low: Optional[float] = None,
    tis_mode: str = "truncate", tis_level: str = "token", tis_veto: Optional[float] = None,
    fraction: float = KL_COV_FRACTION, kl_coef: float = KL_COV_COEF,
) -> PolicyLossOutput:
    """KL-Cov: the unclipped policy gradient, with a KL penalty on the tokens of highest covariance.

    Formula, ``x_t = clamp(log pi - log pi_old, -20, 20)``, ``r_t = exp(x_t)``: ``l_t = -A_t r_t``, plus
    ``kl_coef |x_t|`` on the ``k = max(floor(fraction * n_valid), 1)`` valid tokens of highest
    :func:`token_covariance` (exactly k). No clip: the penalty on the tokens that drive
    the entropy down takes its place. TIS (``l_t *= w_tis``) and ``agg`` as PPO's. ``cov_fraction``: the
    share of valid tokens penalised; ``clip_fraction`` is 0.

    Shapes: as :func:`algos.losses.policy.ppo_policy_loss`; returns :class:`PolicyLossOutput`.

    Reference: Cui et al. 2025, arXiv 2505.22617, sec. 4 (KL-Cov; ``k = 2e-3``, ``beta = 1`` for 7B).
    """
    if not 0 < fraction <= 1 or kl_coef < 0:
        raise ValueError(f"kl_cov needs 0 < fraction <= 1 and kl_coef >= 0, got {fraction}, {kl_coef}")
    t = token_ratios(logprobs, old_logprobs, advantages, action_mask)
    cov = token_covariance(t.logprobs, advantages, action_mask)
    penalised = top_k_mask(cov, t.mask, top_share(action_mask, fraction))
    penalty = torch.where(penalised, kl_coef * t.log_ratio.abs(), torch.zeros_like(t.log_ratio))
    loss = -t.advantages * t.ratio + penalty
    none = torch.zeros_like(t.mask)
    out = weighted_policy_loss(loss, t.ratio, t.log_ratio, action_mask, t.old_logprobs, none, none, agg=agg,
                               loss_scale_constant=loss_scale_constant, rollout_logprobs=rollout_logprobs,
                               tis_cap=tis_cap, tis_low=tis_low, tis_mode=tis_mode,
                               tis_level=tis_level, tis_veto=tis_veto)
    fmask = t.mask.to(t.ratio.dtype)
    return dataclasses.replace(out, cov_fraction=masked_mean(penalised.to(t.ratio.dtype), fmask))
