"""GSPO: the clipped surrogate with a sequence-level importance ratio."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..importance import LOG_RATIO_CLAMP
from ...masked import _bool_mask, _check_same_shape, full_precision
from ..policy import PolicyLossOutput, clipped_surrogate


def gspo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
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
    """Group Sequence Policy Optimization loss (GSPO-token form).

    Formula: the sequence ratio is the length-normalised likelihood ratio
    ``s_i = exp(clamp((1/|y_i|) sum_t (logprobs - old_logprobs), -20, 20))``
    over the valid tokens of row ``i``; each token uses
    ``s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]`` (``sg`` = stop-gradient),
    whose value is ``s_i`` and whose gradient is ``s_i * grad log pi(y_t)``;
    then the clipped surrogate of :func:`algos.losses.policy.ppo_policy_loss`:
    ``l_{i,t} = -min(s_{i,t} A_{i,t}, clip(s_{i,t}, 1 - clip_low, 1 + clip_high) A_{i,t})``
    (whole sequences are clipped together), optional dual clip and rollout
    importance weights (``tis_*``: per token, or per response with
    ``tis_level``), reduced by ``agg``. With
    ``agg="seq_mean_token_mean"`` (the paper's ``1/G sum_i 1/|y_i| sum_t``)
    and sequence-level advantages this equals GSPO's sequence objective
    ``-1/G sum_i min(s_i A_i, clip(s_i) A_i)`` in value and gradient.
    Default clip range ``[1 - 3e-4, 1 + 4e-4]`` as in the paper: ratios of
    whole sequences stay much closer to 1 than token ratios. ``approx_kl``
    uses the token log-ratios; ``ratio_mean`` the sequence ratios (token
    weighted).

    Shapes: ``logprobs``, ``old_logprobs``, ``advantages``, ``action_mask``
    and ``rollout_logprobs`` ``(B, T)``; returns :class:`PolicyLossOutput`.

    Reference: Zheng et al. 2025, "Group Sequence Policy Optimization",
    arXiv 2507.18071 (GSPO and its GSPO-token variant).
    """
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs,
                      advantages=advantages, action_mask=action_mask)
    mask = _bool_mask(action_mask)
    # bf16's ratios step by 0.4 % near 1, past GSPO's clip range
    logprobs, old_logprobs = full_precision(logprobs), full_precision(old_logprobs)
    zeros = torch.zeros_like(logprobs)
    token_log_ratio = torch.where(mask, logprobs - old_logprobs.detach(), zeros)
    lengths = mask.sum(dim=-1).clamp(min=1).to(logprobs.dtype)
    seq_log_ratio = (token_log_ratio.sum(dim=-1) / lengths).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    lp = torch.where(mask, logprobs, zeros)
    # value exactly s_i (x - sg[x] is exactly 0), gradient s_i * grad log pi
    log_ratio = torch.where(mask, seq_log_ratio.detach().unsqueeze(-1) + (lp - lp.detach()), zeros)
    return clipped_surrogate(
        torch.exp(log_ratio), token_log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), advantages,
        action_mask, old_logprobs, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, agg=agg,
        loss_scale_constant=loss_scale_constant, rollout_logprobs=rollout_logprobs, tis_cap=tis_cap,
        tis_low=tis_low, tis_mode=tis_mode, tis_level=tis_level, tis_veto=tis_veto)
