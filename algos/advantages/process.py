"""Dense process rewards: a reward at the last token of every step of a response.

A process reward model scores each step of a sampled solution. Given densely,
those scores are rewards of their own, each at its step's last token
(``step_ends`` counts the steps ending there, usually 1; a reward may be 0, so
the count, not the value, says where one is; where several steps end at one
token, ``step_rewards`` holds their sum). Estimators with returns (GAE, REINFORCE++) add them to the token
rewards; group estimators (GRPO, Dr. GRPO, RLOO) add the process-supervision
advantage below to their outcome one.

Shapes: ``step_rewards``, ``step_ends``, ``action_mask`` ``(B, T)``; the batch
holds ``n_prompts * group_size`` rows, a prompt's samples contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..masked import _bool_mask, _check_same_shape


@dataclass(frozen=True)
class StepRewards:
    """A batch's dense step rewards: ``rewards`` (summed) at the tokens where ``ends`` counts steps, both ``(B, T)``."""

    rewards: Tensor
    ends: Tensor

    def at_ends(self, like: Tensor) -> Tensor:
        """The rewards where a step ends, 0 elsewhere, in ``like``'s dtype: ``(B, T)``."""
        _check_same_shape(step_rewards=self.rewards, step_ends=self.ends, token_rewards=like)
        return torch.where(_bool_mask(self.ends), self.rewards.to(like.dtype), torch.zeros_like(like)).detach()


def with_step_rewards(token_rewards: Tensor, steps: StepRewards | None) -> Tensor:
    """Token rewards with each step's reward added at its last token (none given: unchanged).

    Formula: ``r'_{b,t} = r_{b,t} + [e_{b,t}] * s_{b,t}``, ``e`` the step ends, ``s`` the step rewards.

    Shapes: ``token_rewards`` and the steps' tensors ``(B, T)``; returns ``(B, T)``.

    Reference: dense per-step rewards in PPO, Lightman et al. 2023, arXiv 2305.20050; Wang et al. 2023,
    Math-Shepherd, arXiv 2312.08935 (sec. 3.3, step-by-step PPO).
    """
    return token_rewards if steps is None else token_rewards + steps.at_ends(token_rewards)


def process_group_advantages(steps: StepRewards, action_mask: Tensor, group_size: int, *, eps: float,
                             std_norm: bool = True) -> Tensor:
    """GRPO's process supervision: step rewards normalised within their group, summed from each token on.

    Formula: for a group ``G`` (a prompt's samples), ``R_G`` is the set of every step reward of every
    sample; ``r~_{i,k} = (r_{i,k} - mean(R_G)) / (std(R_G) + eps)`` (``std_norm``; else
    ``r_{i,k} - mean(R_G)``), with the unbiased (``n - 1``) std; then
    ``A_{i,t} = sum_{k : end_{i,k} >= t} r~_{i,k}`` on valid tokens, 0 at padding. A group whose step
    rewards are all equal, or that has fewer than two, gives 0 (as the outcome estimators' constant groups).
    Where ``c > 1`` steps end at one token (their rewards summed to ``s``), the mean and each step's
    ``r - mean`` stay exact (the token gets ``s - c * mean``); the std takes them as ``c`` steps of ``s / c``.

    Shapes: ``steps`` and ``action_mask`` ``(B, T)``, ``B = n * group_size``; returns ``(B, T)``, detached.

    Reference: Shao et al. 2024, "DeepSeekMath", arXiv 2402.03300, sec. 4.1.3 (process supervision RL with GRPO).
    """
    _check_same_shape(step_rewards=steps.rewards, step_ends=steps.ends, action_mask=action_mask)
    if group_size < 1 or steps.rewards.shape[0] % group_size:
        raise ValueError(f"batch size {steps.rewards.shape[0]} is not a multiple of group_size {group_size}")
    ends = _bool_mask(steps.ends)
    n = torch.where(ends, steps.ends.float(), torch.zeros_like(steps.ends, dtype=torch.float32))  # steps per token
    r = torch.where(ends, steps.rewards.float(), torch.zeros_like(n)).detach()
    B, T = r.shape
    g_r, g_n = r.reshape(B // group_size, group_size * T), n.reshape(B // group_size, group_size * T)
    g_m = g_n > 0
    count = g_n.sum(-1, keepdim=True)
    mean = g_r.sum(-1, keepdim=True) / count.clamp(min=1)
    centred = torch.where(g_m, g_r - g_n * mean, torch.zeros_like(g_r))  # sum over the token's steps of r - mean
    each = torch.where(g_m, g_r / g_n.clamp(min=1), torch.zeros_like(g_r))  # a token's steps, each at their mean
    if std_norm:
        var = (g_n * (each - mean).pow(2)).sum(-1, keepdim=True) / (count - 1).clamp(min=1)
        centred = centred / (var.sqrt() + eps)
    high = each.masked_fill(~g_m, -float("inf")).amax(-1, keepdim=True)
    low = each.masked_fill(~g_m, float("inf")).amin(-1, keepdim=True)
    constant = (count < 2) | (high == low)
    normed = torch.where(constant, torch.zeros_like(centred), centred).reshape(B, T)
    to_go = normed.flip(-1).cumsum(-1).flip(-1)  # sum over the steps ending at t or after
    return torch.where(_bool_mask(action_mask), to_go, torch.zeros_like(to_go)).to(steps.rewards.dtype)
