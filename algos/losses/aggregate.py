"""Reduction of a per-token loss to a scalar (token / sequence averaging)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..masked import _bool_mask, _check_same_shape, masked_mean, masked_sum

LOSS_AGGREGATIONS = ("seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm", "token_mean")


def aggregate_loss(
    token_loss: Tensor,
    action_mask: Tensor,
    *,
    agg: str = "token_mean",
    loss_scale_constant: Optional[float] = None,
) -> Tensor:
    """Reduce a ``(B, T)`` per-token loss to a scalar.

    Formulas (``m`` = mask, ``l`` = token loss, ``B`` rows, ``T`` columns):

    * ``"token_mean"``: ``sum_{b,t} m l / sum_{b,t} m`` (every valid token of
      the batch weighs the same; DAPO, Yu et al. 2025, arXiv 2503.14476);
    * ``"seq_mean_token_mean"``: ``mean_b (sum_t m l / sum_t m)`` over rows
      with at least one valid token (GRPO, Shao et al. 2024,
      arXiv 2402.03300);
    * ``"seq_mean_token_sum"``: ``mean_b sum_t m l`` over rows with at least
      one valid token (each response's summed loss, the REINFORCE estimate of
      the sequence objective; verl's seq-mean-token-sum);
    * ``"seq_mean_token_sum_norm"``: ``(1/B) sum_b sum_t m l / C`` with
      ``C = loss_scale_constant`` (default ``T``), mean over ALL rows (Dr.
      GRPO, Liu et al. 2025, arXiv 2503.20783).

    An all-masked batch gives 0. ``loss_scale_constant`` is used only by
    ``"seq_mean_token_sum_norm"`` and ignored otherwise.

    Shapes: ``token_loss``, ``action_mask`` ``(B, T)``; returns a 0-d tensor.
    """
    _check_same_shape(token_loss=token_loss, action_mask=action_mask)
    if agg == "token_mean":
        return masked_mean(token_loss, action_mask)
    if agg == "seq_mean_token_mean":
        per_row = masked_mean(token_loss, action_mask, dim=-1)
        has_tokens = _bool_mask(action_mask).any(dim=-1)
        return masked_mean(per_row, has_tokens)
    if agg == "seq_mean_token_sum":
        return masked_mean(masked_sum(token_loss, action_mask, dim=-1), _bool_mask(action_mask).any(dim=-1))
    if agg == "seq_mean_token_sum_norm":
        const = float(token_loss.shape[-1]) if loss_scale_constant is None else loss_scale_constant
        if const <= 0:
            raise ValueError(f"loss_scale_constant must be > 0, got {const}")
        return (masked_sum(token_loss, action_mask, dim=-1) / const).mean()
    raise ValueError(f"unknown loss aggregation {agg!r}; valid: {', '.join(LOSS_AGGREGATIONS)}")


def aggregate_weight(action_mask: Tensor, *, agg: str = "token_mean") -> Tensor:
    """What ``aggregate_loss`` averages over: the weight of a part of a batch
    when the parts' losses are combined into the whole batch's.

    Formulas (``m`` = mask, ``B`` rows):

    * ``"token_mean"``: ``w = sum_{b,t} m`` (the valid tokens);
    * ``"seq_mean_token_mean"``, ``"seq_mean_token_sum"``: ``w = sum_b
      [sum_t m_b > 0]`` (the rows with a valid token);
    * ``"seq_mean_token_sum_norm"``: ``w = B``.

    For a batch cut into parts ``p`` (micro-batches, ranks), with the same
    ``loss_scale_constant`` throughout:
    ``aggregate_loss(batch) = sum_p (w_p / sum_q w_q) * aggregate_loss(p)``,
    exactly; a part of weight 0 has loss 0 and drops out. Weighting by rows
    instead is exact only for the sequence means: under ``"token_mean"`` it
    gives a part of short responses the weight of one of long ones (the
    aggregations are those of DAPO, Yu et al. 2025, arXiv 2503.14476, and
    Dr. GRPO, Liu et al. 2025, arXiv 2503.20783).

    Shapes: ``action_mask`` ``(B, T)``; returns a 0-d float tensor.
    """
    mask = _bool_mask(action_mask)
    if agg == "token_mean":
        return masked_sum(torch.ones(mask.shape, device=mask.device), action_mask)
    if agg in ("seq_mean_token_mean", "seq_mean_token_sum"):
        return mask.any(dim=-1).sum().float()
    if agg == "seq_mean_token_sum_norm":
        return torch.tensor(float(mask.shape[0]), device=mask.device)
    raise ValueError(f"unknown loss aggregation {agg!r}; valid: {', '.join(LOSS_AGGREGATIONS)}")
