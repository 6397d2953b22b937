"""Backward recursions over the token axis: GAE and discounted returns.

Masked positions are *skipped*, not treated as steps: the recursion at a
valid token ``t`` looks at the next valid token after ``t`` (or at a
terminal state with value 0 when there is none). For the usual layout
(valid prefix, padding after EOS) this means the last valid token is
terminal. Masked-out tokens in the middle of a row (e.g. tool output in a
multi-turn rollout) are transparent. Every masked position is 0 in the
outputs, and garbage in masked positions never reaches a valid one.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from ..masked import _bool_mask, _check_same_shape


def compute_gae(
    token_rewards: Tensor,
    values: Tensor,
    action_mask: Tensor,
    *,
    gamma: float,
    lam: float,
) -> Tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation with a learned critic.

    Formula, over the valid tokens of a row (``t'`` = next valid token,
    ``V(t') = 0`` and ``A(t') = 0`` past the last valid token):
    ``delta_t = r_t + gamma * V(t') - V(t)``;
    ``A_t = delta_t + gamma * lam * A(t')``; ``R_t = A_t + V(t)``.

    Shapes: ``token_rewards``, ``values``, ``action_mask`` ``(B, T)``;
    returns ``(advantages, returns)``, both ``(B, T)``, 0 at padding, detached
    (they are regression/policy targets, not graph nodes).

    Reference: Schulman et al. 2015, "High-Dimensional Continuous Control
    Using Generalized Advantage Estimation", arXiv 1506.02438.
    """
    _check_same_shape(token_rewards=token_rewards, values=values, action_mask=action_mask)
    mask = _bool_mask(action_mask)
    rewards = torch.where(mask, token_rewards, torch.zeros_like(token_rewards)).detach()
    vals = torch.where(mask, values, torch.zeros_like(values)).detach().to(rewards.dtype)
    batch, length = rewards.shape
    next_value = rewards.new_zeros(batch)
    next_adv = rewards.new_zeros(batch)
    advantages = torch.zeros_like(rewards)
    for t in range(length - 1, -1, -1):
        valid = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = torch.where(valid, adv, torch.zeros_like(adv))
        next_value = torch.where(valid, vals[:, t], next_value)
        next_adv = torch.where(valid, adv, next_adv)
    returns = torch.where(mask, advantages + vals, torch.zeros_like(advantages))
    return advantages, returns


def discounted_returns(
    token_rewards: Tensor, action_mask: Tensor, *, gamma: float
) -> Tensor:
    """Discounted return-to-go of the token rewards.

    Formula: ``G_t = r_t + gamma * G(t')`` over valid tokens (``t'`` = next
    valid token, ``G = 0`` past the last one). With a contiguous mask this is
    ``G_t = sum_{k >= t} gamma^{k - t} r_k``; masked tokens inside a row do
    not count as steps.

    Shapes: ``token_rewards``, ``action_mask`` ``(B, T)``; returns ``(B, T)``,
    0 at padding.

    Reference: REINFORCE (Williams 1992); as used by REINFORCE++, Hu 2025,
    arXiv 2501.03262.
    """
    _check_same_shape(token_rewards=token_rewards, action_mask=action_mask)
    mask = _bool_mask(action_mask)
    rewards = torch.where(mask, token_rewards, torch.zeros_like(token_rewards)).detach()
    batch, length = rewards.shape
    running = rewards.new_zeros(batch)
    out = torch.zeros_like(rewards)
    for t in range(length - 1, -1, -1):
        valid = mask[:, t]
        g = rewards[:, t] + gamma * running
        out[:, t] = torch.where(valid, g, torch.zeros_like(g))
        running = torch.where(valid, g, running)
    return out
