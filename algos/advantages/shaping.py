"""Sequence-reward transforms: clipping, running normalisation, truncation penalty.

All act on ``(B,)`` sequence rewards, before any advantage estimator, except
:func:`rewards_at_turns`, which places multi-turn episodes' rewards on their
``(B, T)`` token rewards.
:class:`RunningMeanStd` is an immutable value (``update`` returns a new
one) holding plain floats, so a round can store it in its checkpoint
(``to_dict`` / ``from_dict``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Dict, Tuple

import torch
from torch import Tensor

from ..masked import place_at_last_token


def _check_1d(name: str, x: Tensor) -> None:
    if x.dim() != 1:
        raise ValueError(f"{name} must be 1-D (B,), got shape {tuple(x.shape)}")


def clip_rewards(rewards: Tensor, clip: float) -> Tuple[Tensor, int]:
    """Clip sequence rewards to a symmetric range.

    Formula: ``r'_b = min(max(r_b, -c), c)`` with ``c = clip > 0``; the
    count is ``#{b : |r_b| > c}`` (the rewards the clip changed).

    Shapes: ``rewards`` ``(B,)``; returns ``(clipped (B,), n_clipped int)``.

    Reference: reward clipping as in Mnih et al. 2015 (DQN) and the PPO
    reference implementation's reward clipping, Engstrom et al. 2020,
    "Implementation Matters in Deep Policy Gradients", arXiv 2005.12729.
    """
    _check_1d("rewards", rewards)
    if not clip > 0:
        raise ValueError(f"reward clip must be > 0, got {clip}")
    n_clipped = int((rewards.abs() > clip).sum().item())
    return rewards.clamp(-clip, clip), n_clipped


def truncation_penalty(finished: Tensor, penalty: float) -> Tensor:
    """Penalty for responses cut by the length limit (no EOS / stop string).

    Formula: ``p_b = -penalty`` if response ``b`` did not finish, else ``0``;
    added to the sequence reward.

    Shapes: ``finished`` ``(B,)`` bool; returns ``(B,)`` float32.

    Reference: the punitive reward for truncated samples discussed in DAPO,
    Yu et al. 2025, arXiv 2503.14476, sec. 3.4 (overlong reward shaping).
    """
    _check_1d("finished", finished)
    if penalty < 0:
        raise ValueError(f"truncation penalty must be >= 0, got {penalty}")
    unfinished = ~finished.to(torch.bool)
    zeros = torch.zeros(finished.shape, device=finished.device)
    return torch.where(unfinished, zeros - float(penalty), zeros)


@dataclass(frozen=True)
class RunningMeanStd:
    """Running mean and (population) variance of every value seen, merged batch by batch.

    Formula (Chan et al.'s parallel form of Welford's update): for a batch
    ``x`` of ``n_b`` values with mean ``m_b`` and sum of squared deviations
    ``M_b``, and ``delta = m_b - mean``, ``n = count + n_b``:
    ``mean' = mean + delta * n_b / n``,
    ``m2' = m2 + M_b + delta^2 * count * n_b / n``, ``count' = n``;
    ``var = m2 / count`` (0 before any value). :meth:`normalize` gives
    ``(x - mean) / sqrt(var + eps)``. Statistics are float64 Python floats.

    Shapes: :meth:`update` and :meth:`normalize` take ``(B,)`` (any shape
    for ``normalize``, returned alike).

    Reference: Welford 1962; Chan, Golub and LeVeque 1979; running reward
    normalisation as in Engstrom et al. 2020, arXiv 2005.12729.
    """

    count: float = 0.0
    mean: float = 0.0
    m2: float = 0.0

    @property
    def var(self) -> float:
        return self.m2 / self.count if self.count > 0 else 0.0

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def update(self, x: Tensor) -> RunningMeanStd:
        """These statistics with the values of ``x`` (``(B,)``) merged in; a new object."""
        _check_1d("x", x)
        if x.numel() == 0:
            return self
        xb = x.detach().to(torch.float64)
        n_b = float(xb.numel())
        mean_b = float(xb.mean().item())
        m2_b = float(((xb - mean_b) ** 2).sum().item())
        n = self.count + n_b
        delta = mean_b - self.mean
        return RunningMeanStd(count=n, mean=self.mean + delta * n_b / n,
                              m2=self.m2 + m2_b + delta * delta * self.count * n_b / n)

    def normalize(self, x: Tensor, eps: float = 1e-8) -> Tensor:
        """``(x - mean) / sqrt(var + eps)``, in the dtype of ``x``."""
        return ((x.to(torch.float64) - self.mean) / math.sqrt(self.var + eps)).to(x.dtype)

    def to_dict(self) -> Dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, state: Dict[str, float]) -> RunningMeanStd:
        unknown = set(state) - {"count", "mean", "m2"}
        if unknown:
            raise ValueError(f"unknown RunningMeanStd state keys: {sorted(unknown)}")
        return cls(**{k: float(v) for k, v in state.items()})


def rewards_at_turns(token_rewards: Tensor, turn_rewards: Tensor, action_mask: Tensor) -> Tensor:
    """Token rewards of multi-turn episodes: each environment reward moved from the end to its turn.

    Formula: ``r'[b, t] = r[b, t] + turn[b, t] - [t == last_b] * sum_t' turn[b, t']``, with ``last_b``
    the last valid (sampled) token of row ``b``. The sequence reward (placed at ``last_b``) already holds
    the episode's return, so each row's sum is unchanged: outcome estimators (GRPO, RLOO) see the same
    score, and GAE sees each reward where its turn ended. Rows without a valid token are unchanged. (The
    moved rewards are the environment's own: with reward.normalize, clip or other components the row's
    end holds the shaped sequence reward minus their raw sum.)

    Shapes: ``token_rewards``, ``turn_rewards``, ``action_mask`` ``(B, T)``; returns ``(B, T)``.

    Reference: turn-level rewards of multi-turn language agents, Zhou et al. 2024, "ArCHer: Training
    Language Model Agents via Hierarchical Multi-Turn RL", arXiv 2402.19446.
    """
    if not token_rewards.shape == turn_rewards.shape == action_mask.shape:
        raise ValueError(f"shapes differ: token_rewards {tuple(token_rewards.shape)}, turn_rewards "
                         f"{tuple(turn_rewards.shape)}, action_mask {tuple(action_mask.shape)}")
    turns = turn_rewards.to(token_rewards.dtype)
    moved = turns - place_at_last_token(turns.sum(-1), action_mask)
    has_token = action_mask.bool().any(-1, keepdim=True)
    return token_rewards + torch.where(has_token, moved, torch.zeros_like(moved))
