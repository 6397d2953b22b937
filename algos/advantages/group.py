"""Group baselines over sequence-level scores.

The batch holds ``n_prompts * group_size`` rows, the samples of one prompt
contiguous (rows ``[i*g:(i+1)*g]``). All functions take ``(B,)`` scores and
return ``(B,)``. Groups whose scores are all exactly equal (including every
group of size 1) get advantage exactly 0: without that guard a rounding
error of one ulp in the group mean, divided by ``std + eps``, would give
noise of order ``ulp / eps``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _grouped(scores: Tensor, group_size: int) -> Tensor:
    """View ``(B,)`` scores as ``(B // group_size, group_size)``."""
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D (B,), got shape {tuple(scores.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if scores.shape[0] % group_size != 0:
        raise ValueError(
            f"batch size {scores.shape[0]} is not a multiple of group_size {group_size}"
        )
    return scores.reshape(-1, group_size)


def constant_groups(scores: Tensor, group_size: int) -> Tensor:
    """Per-row flag: is every score of this row's group equal?

    Formula: ``c_i = [max_{j in G(i)} s_j == min_{j in G(i)} s_j]``.

    Shapes: ``scores`` ``(B,)``; returns ``(B,)`` bool.

    Reference: the zero-advantage groups that DAPO's dynamic sampling drops,
    Yu et al. 2025, arXiv 2503.14476.
    """
    g = _grouped(scores, group_size)
    const = g.max(dim=1).values == g.min(dim=1).values
    return const.repeat_interleave(group_size)


def group_mean(scores: Tensor, group_size: int) -> Tensor:
    """Mean score of each row's group, broadcast back to the rows.

    Formula: ``m_i = (1/g) sum_{j in G(i)} s_j``.

    Shapes: ``scores`` ``(B,)``; returns ``(B,)``.

    Reference: group baseline of GRPO, Shao et al. 2024, arXiv 2402.03300.
    """
    g = _grouped(scores, group_size)
    return g.mean(dim=1).repeat_interleave(group_size)


def group_normalized_advantages(scores: Tensor, group_size: int, *, eps: float) -> Tensor:
    """GRPO outcome advantage: score standardised within its group.

    Formula: ``A_i = (s_i - mean_G) / (std_G + eps)`` with the UNBIASED
    (Bessel, ``n - 1``) standard deviation, as ``torch.std`` computes it.
    ``A_i = 0`` when the group is constant, which covers ``group_size == 1``.

    Shapes: ``scores`` ``(B,)``; returns ``(B,)``.

    Reference: Shao et al. 2024, "DeepSeekMath", arXiv 2402.03300, sec. 4.1.2.
    """
    g = _grouped(scores, group_size)
    mean = g.mean(dim=1, keepdim=True)
    if group_size > 1:
        std = g.std(dim=1, keepdim=True, correction=1)
    else:
        std = torch.zeros_like(mean)
    adv = ((g - mean) / (std + eps)).reshape(-1)
    return torch.where(constant_groups(scores, group_size), torch.zeros_like(adv), adv)


def group_centered_advantages(scores: Tensor, group_size: int) -> Tensor:
    """Dr. GRPO advantage: score minus its group mean, no std division.

    Formula: ``A_i = s_i - mean_G`` (0 for constant groups).

    Shapes: ``scores`` ``(B,)``; returns ``(B,)``.

    Reference: Liu et al. 2025, "Understanding R1-Zero-Like Training: A
    Critical Perspective", arXiv 2503.20783.
    """
    adv = scores - group_mean(scores, group_size)
    return torch.where(constant_groups(scores, group_size), torch.zeros_like(adv), adv)


def leave_one_out_advantages(scores: Tensor, group_size: int) -> Tensor:
    """RLOO advantage: score minus the mean of the OTHER samples of its group.

    Formula: ``A_i = s_i - (1/(g-1)) sum_{j in G(i), j != i} s_j``
    (0 for constant groups and for ``g == 1``).

    Shapes: ``scores`` ``(B,)``; returns ``(B,)``.

    Reference: Ahmadian et al. 2024, "Back to Basics: Revisiting
    REINFORCE-Style Optimization for Learning from Human Feedback in LLMs",
    arXiv 2402.14740 (after Kool et al. 2019).
    """
    g = _grouped(scores, group_size)
    if group_size == 1:
        return torch.zeros_like(scores)
    others = (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
    adv = (g - others).reshape(-1)
    return torch.where(constant_groups(scores, group_size), torch.zeros_like(adv), adv)


def length_weighted_advantages(scores: Tensor, lengths: Tensor, group_size: int) -> Tensor:
    """OPO advantage: score minus its group's mean weighted by the responses' lengths.

    Formula: ``A_i = s_i - sum_{j in G(i)} l_j s_j / sum_{j in G(i)} l_j`` (0 for constant groups; a group
    whose lengths are all 0 takes the plain mean). The baseline that minimises the policy gradient's
    variance where each token's gradient is about as large and as independent as another's, so that a
    response's squared gradient norm grows with its length.

    Shapes: ``scores``, ``lengths`` ``(B,)``; returns ``(B,)``.

    Reference: Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline", arXiv 2505.23585.
    """
    s, w = _grouped(scores, group_size), _grouped(lengths.to(scores.dtype), group_size)
    total = w.sum(dim=1, keepdim=True)
    weighted = (w * s).sum(dim=1, keepdim=True) / total.clamp(min=torch.finfo(s.dtype).tiny)
    baseline = torch.where(total > 0, weighted, s.mean(dim=1, keepdim=True))
    adv = (s - baseline).reshape(-1)
    return torch.where(constant_groups(scores, group_size), torch.zeros_like(adv), adv)
