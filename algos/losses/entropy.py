"""Token entropy of the policy and the entropy-bonus loss term."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .aggregate import aggregate_loss


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution defined by ``logits``.

    Formula: ``H = -sum_v p_v log p_v`` with ``log p = log_softmax(logits)``
    (computed in log space, so large logits are safe; ``-inf`` logits, i.e.
    banned tokens, contribute exactly 0 and give no NaN gradient).

    Shapes: ``logits`` ``(B, T, V)``; returns ``(B, T)`` in the dtype of
    ``logits`` (upcast bf16 logits to float32 first for accuracy).

    Reference: entropy bonus of A3C/PPO, Mnih et al. 2016, arXiv 1602.01783;
    Schulman et al. 2017, arXiv 1707.06347.
    """
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    safe_logp = logp.clamp(min=torch.finfo(logp.dtype).min)
    return -(p * safe_logp).sum(dim=-1)


def entropy_bonus_loss(
    entropy: Tensor,
    action_mask: Tensor,
    *,
    entropy_coef: float,
    agg: str = "token_mean",
    loss_scale_constant: Optional[float] = None,
) -> Tensor:
    """Loss term that rewards entropy: ADD it to the policy loss.

    Formula: ``L_ent = -entropy_coef * agg(H)`` where ``agg`` is
    :func:`algos.losses.aggregate.aggregate_loss` over the valid tokens
    (minimising ``L_ent`` raises the entropy when ``entropy_coef > 0``).

    Shapes: ``entropy``, ``action_mask`` ``(B, T)``; returns a 0-d tensor.

    Reference: Mnih et al. 2016, arXiv 1602.01783; Schulman et al. 2017,
    arXiv 1707.06347 (the ``c2 S`` term of the PPO objective).
    """
    return -entropy_coef * aggregate_loss(
        entropy, action_mask, agg=agg, loss_scale_constant=loss_scale_constant
    )
