"""Masked reductions over token-level tensors.

Every function here treats positions where ``mask == 0`` as absent: their
values never reach the result, even when they hold huge, infinite or NaN
garbage (masking is done with ``torch.where``, not by multiplying by 0, so
``inf * 0 = nan`` cannot leak in).

Shapes follow the package convention: token-level tensors are
``(batch, response_len)``; ``mask`` has the same shape (bool or float,
1 = real response token).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def _check_same_shape(**tensors: Tensor) -> None:
    """Raise ValueError unless every given tensor has the same shape."""
    items = list(tensors.items())
    name0, t0 = items[0]
    for name, t in items[1:]:
        if t.shape != t0.shape:
            raise ValueError(
                f"shape mismatch: {name0} has shape {tuple(t0.shape)} but "
                f"{name} has shape {tuple(t.shape)}"
            )


def _bool_mask(mask: Tensor) -> Tensor:
    """Mask as bool (float masks: nonzero = valid)."""
    return mask if mask.dtype == torch.bool else mask != 0


def full_precision(x: Tensor) -> Tensor:
    """``x`` in float32 where it is half precision (fp16, bf16); as it is otherwise (float64 stays)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def masked_sum(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Sum of ``x`` over the positions where ``mask`` is 1.

    Formula: ``sum_i mask_i * x_i`` (masked entries contribute exactly 0,
    whatever they hold). Half-precision ``x`` is summed in float32 (and the
    result is float32): an fp16 sum overflows past 65504 and bf16 counts
    round past 256, so means and variances of long batches would be wrong.

    Shapes: ``x`` and ``mask`` of the same shape, e.g. ``(B, T)``; result is a
    0-d tensor when ``dim`` is None, else ``x`` with ``dim`` reduced
    (``(B,)`` for ``dim=-1``).

    Reference: standard masked reduction as used in RLHF code for PPO
    (Schulman et al. 2017, arXiv 1707.06347).
    """
    _check_same_shape(x=x, mask=mask)
    x = full_precision(x)  # fp16 overflows past 65504, bf16 rounds counts past 256
    m = mask.to(x.dtype)
    xm = torch.where(_bool_mask(mask), x * m, torch.zeros_like(x))
    return xm.sum() if dim is None else xm.sum(dim=dim)


def masked_mean(
    x: Tensor, mask: Tensor, dim: Optional[int] = None, eps: float = 1e-8
) -> Tensor:
    """Mean of ``x`` over the positions where ``mask`` is 1.

    Formula: ``sum_i m_i x_i / max(sum_i m_i, eps)``. With 0/1 masks this is
    the exact mean of the valid entries; a slice with no valid entry gives 0
    (not NaN) because its numerator is exactly 0.

    Shapes: ``x`` and ``mask`` of the same shape, e.g. ``(B, T)``; result is
    0-d when ``dim`` is None, else reduced along ``dim`` (``(B,)`` for
    ``dim=-1``).

    Reference: masked token mean of PPO-style RLHF losses (Schulman et al.
    2017, arXiv 1707.06347).
    """
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    total = masked_sum(x, mask, dim)
    count = masked_sum(torch.ones_like(x), mask, dim)
    return total / count.clamp(min=eps)


def masked_var(
    x: Tensor,
    mask: Tensor,
    dim: Optional[int] = None,
    *,
    unbiased: bool = False,
    eps: float = 1e-8,
) -> Tensor:
    """Variance of ``x`` over the positions where ``mask`` is 1.

    Formula: ``mu = masked_mean(x)``; ``var = sum_i m_i (x_i - mu)^2 / n``
    with ``n = sum_i m_i`` (population variance, the default), or divided by
    ``n - 1`` when ``unbiased=True`` (Bessel). Slices with ``n == 0`` give 0;
    with ``unbiased=True`` slices with ``n <= 1`` give 0 as well (instead of
    NaN/inf).

    Shapes: as :func:`masked_mean`.

    Reference: used for advantage whitening in PPO (Schulman et al. 2017,
    arXiv 1707.06347).
    """
    mu = masked_mean(x, mask, dim, eps)
    if dim is not None:
        mu = mu.unsqueeze(dim)
    centered = torch.where(_bool_mask(mask), x - mu, torch.zeros_like(x))
    sq = masked_sum(centered * centered, mask, dim)
    count = masked_sum(torch.ones_like(x), mask, dim)
    if unbiased:
        denom = count - 1
        return torch.where(denom > 0, sq / denom.clamp(min=eps), torch.zeros_like(sq))
    return sq / count.clamp(min=eps)


def masked_whiten(
    x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> Tensor:
    """Whiten ``x`` using the statistics of its valid entries only.

    Formula (global over every valid entry of the tensor):
    ``mu = masked_mean(x)``, ``var = masked_var(x)`` (population variance),
    ``y = (x - mu) / sqrt(var + eps)``; with ``shift_mean=False`` the mean is
    added back: ``y = (x - mu) / sqrt(var + eps) + mu``. Padding positions
    are exactly 0 in the output, and padding never affects ``mu``/``var``.

    Shapes: ``x`` and ``mask`` ``(B, T)`` (any equal shapes work); output has
    the shape of ``x``.

    Reference: advantage normalisation in PPO (Schulman et al. 2017,
    arXiv 1707.06347); global batch whitening in REINFORCE++ (Hu 2025,
    arXiv 2501.03262).
    """
    mu = masked_mean(x, mask, None, eps)
    var = masked_var(x, mask, None, eps=eps)
    y = (x - mu) * torch.rsqrt(var + eps)
    if not shift_mean:
        y = y + mu
    return torch.where(_bool_mask(mask), y, torch.zeros_like(y))


def last_valid_index(action_mask: Tensor) -> Tensor:
    """Index of the last valid token of each row, -1 for rows with none.

    Formula: ``last_b = max{t : mask[b, t] = 1}`` (``-1`` if the set is empty).

    Shapes: ``action_mask`` ``(B, T)``; returns ``(B,)`` int64.

    Reference: the sequence reward sits on the final response token in RLHF
    with PPO (Ziegler et al. 2019, arXiv 1909.08593).
    """
    mask = _bool_mask(action_mask)
    pos = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask, pos, torch.full_like(pos, -1)).max(dim=-1).values


def place_at_last_token(seq_values: Tensor, action_mask: Tensor) -> Tensor:
    """Put one value per row on that row's last valid token, 0 elsewhere.

    Formula: ``out[b, t] = seq_values[b] * [t == last_b]``; rows with no
    valid token are all 0.

    Shapes: ``seq_values`` ``(B,)``, ``action_mask`` ``(B, T)``; returns
    ``(B, T)`` in the dtype of ``seq_values``.

    Reference: sparse end-of-sequence reward of RLHF (Ziegler et al. 2019,
    arXiv 1909.08593).
    """
    if seq_values.dim() != 1 or seq_values.shape[0] != action_mask.shape[0]:
        raise ValueError(
            f"seq_values must have shape ({action_mask.shape[0]},), "
            f"got {tuple(seq_values.shape)}"
        )
    last = last_valid_index(action_mask)
    pos = torch.arange(action_mask.shape[-1], device=action_mask.device)
    at_end = (pos.unsqueeze(0) == last.unsqueeze(1)) & (last >= 0).unsqueeze(1)
    full = seq_values.unsqueeze(1).expand(-1, action_mask.shape[-1])
    return torch.where(at_end, full, torch.zeros_like(full))


def top_share(action_mask: Tensor, fraction: float) -> Tensor:
    """``max(floor(fraction * n_valid), 1)``: how many of the valid tokens a share takes, as a 0-d tensor (no
    host sync)."""
    return (_bool_mask(action_mask).sum() * fraction).floor().long().clamp(min=1)


def top_k_mask(scores: Tensor, eligible: Tensor, k: Tensor) -> Tensor:
    """Exactly ``k`` eligible entries, those of highest score (every eligible one where fewer; among equal
    scores the first in row-major order). ``k``: a 0-d integer tensor, read on the device.

    Shapes: ``scores``, ``eligible`` ``(B, T)``; returns a bool ``(B, T)``."""
    order = torch.where(eligible, scores, float("-inf")).flatten().argsort(descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return eligible & (rank < k).reshape(eligible.shape)
