"""DAPO helpers: dynamic sampling filters (constant groups, group mean range) and soft overlong punishment."""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor


def _check_groups(sequence_rewards: Tensor, group_size: int) -> None:
    if sequence_rewards.dim() != 1:
        raise ValueError(
            f"sequence_rewards must be 1-D (B,), got shape {tuple(sequence_rewards.shape)}"
        )
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if sequence_rewards.shape[0] % group_size != 0:
        raise ValueError(
            f"batch size {sequence_rewards.shape[0]} is not a multiple of "
            f"group_size {group_size}"
        )


def dynamic_sampling_filter(
    sequence_rewards: Tensor, group_size: int, *, atol: float = 0.0
) -> Tuple[Tensor, int]:
    """Drop prompt groups whose rewards are all equal (zero group advantage).

    Formula: keep group ``G`` iff ``max_{i in G} r_i - min_{i in G} r_i > atol``
    (``atol = 0``: keep iff not all exactly equal). A group of size 1 is
    always dropped (it is trivially constant).

    Shapes: ``sequence_rewards`` ``(B,)`` with ``B = n_prompts * group_size``
    and each group contiguous; returns ``(keep_mask (B,) bool,
    n_groups_dropped int)``.

    Reference: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement
    Learning System at Scale", arXiv 2503.14476, sec. 3.2 (dynamic sampling).
    """
    _check_groups(sequence_rewards, group_size)
    if atol < 0:
        raise ValueError(f"atol must be >= 0, got {atol}")
    g = sequence_rewards.reshape(-1, group_size)
    spread = g.max(dim=1).values - g.min(dim=1).values
    keep_group = spread > atol
    n_dropped = int((~keep_group).sum().item())
    return keep_group.repeat_interleave(group_size), n_dropped


def overlong_penalty(
    response_lengths: Tensor,
    *,
    max_len: int,
    buffer_len: int,
    penalty_factor: float = 1.0,
) -> Tensor:
    """Soft overlong punishment added to the reward of too-long responses.

    Formula, with ``L = max_len`` and ``C = buffer_len``:
    ``p(len) = 0`` if ``len <= L - C``;
    ``p(len) = ((L - C) - len) / C * penalty_factor`` if ``L - C < len <= L``;
    ``p(len) = -penalty_factor`` if ``len > L``. (``C = 0``: only the hard
    step beyond ``L``.)

    Shapes: ``response_lengths`` ``(B,)`` (int or float); returns ``(B,)``
    float32 (or the input dtype when it is floating point).

    Reference: Yu et al. 2025, DAPO, arXiv 2503.14476, eq. (13)
    (soft overlong punishment).
    """
    if buffer_len < 0 or buffer_len > max_len:
        raise ValueError(f"need 0 <= buffer_len <= max_len, got {buffer_len}, {max_len}")
    dtype = response_lengths.dtype if response_lengths.is_floating_point() else torch.float32
    length = response_lengths.to(dtype)
    start = float(max_len - buffer_len)
    zeros = torch.zeros_like(length)
    if buffer_len > 0:
        soft = (start - length) / float(buffer_len) * penalty_factor
    else:
        soft = zeros
    out = torch.where(length <= start, zeros, soft)
    return torch.where(length > max_len, torch.full_like(length, -penalty_factor), out)


def group_mean_filter(
    sequence_rewards: Tensor, group_size: int, *, low: float, high: float
) -> Tuple[Tensor, int]:
    """Keep prompt groups whose mean reward lies in ``[low, high]``.

    Formula: keep group ``G`` iff ``low <= (1/g) sum_{i in G} r_i <= high``
    (with 0/1 rewards: the prompt's pass rate, so too easy and too hard
    prompts are dropped).

    Shapes: ``sequence_rewards`` ``(B,)`` with ``B = n_prompts * group_size``
    and each group contiguous; returns ``(keep_mask (B,) bool,
    n_groups_dropped int)``.

    Reference: online prompt filtering by accuracy range, Cui et al. 2025,
    "Process Reinforcement through Implicit Rewards" (PRIME), arXiv
    2502.01456; a generalisation of DAPO's dynamic sampling, arXiv 2503.14476.
    """
    _check_groups(sequence_rewards, group_size)
    if low > high:
        raise ValueError(f"need low <= high, got [{low}, {high}]")
    means = sequence_rewards.reshape(-1, group_size).mean(dim=1)
    keep_group = (means >= low) & (means <= high)
    n_dropped = int((~keep_group).sum().item())
    return keep_group.repeat_interleave(group_size), n_dropped
