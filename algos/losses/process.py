"""Process supervision: a reward model scored at the end of every step of a solution.

A process reward model (PRM) gives each step its own score, the logit that the
solution is still right after that step; the labels are per step. The loss is
binary cross-entropy over the labelled steps, and a solution's score
aggregates its steps' scores.

Metrics in the returned dataclass are detached 0-d tensors (``float(x)``
gives the number); ``loss`` is the differentiable 0-d mean over steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

STEP_AGGREGATIONS = ("min", "last", "mean")


@dataclass(frozen=True)
class StepwiseLossOutput:
    loss: Tensor
    accuracy: Tensor  # share of steps whose score has the label's sign
    positive_fraction: Tensor  # share of steps labelled correct


def stepwise_reward_loss(step_scores: Tensor, labels: Tensor) -> StepwiseLossOutput:
    """Binary cross-entropy of per-step scores (logits) against per-step labels.

    Formula: ``L = -mean_i [ y_i log sigma(s_i) + (1 - y_i) log(1 - sigma(s_i)) ]``
    over every labelled step ``i`` of the batch, ``y_i`` in {0, 1} (soft labels in
    [0, 1], Math-Shepherd's estimated correctness, are taken as they are).
    A step counts as right when ``s_i > 0`` and ``y_i >= 0.5`` or ``s_i <= 0``
    and ``y_i < 0.5``.

    Shapes: ``step_scores``, ``labels`` ``(N,)``: the batch's steps, flattened; N >= 1.

    Reference: process supervision, Lightman et al. 2023, "Let's Verify Step by
    Step", arXiv 2305.20050; Wang et al. 2023, Math-Shepherd, arXiv 2312.08935.
    """
    if step_scores.dim() != 1 or step_scores.shape != labels.shape:
        raise ValueError(f"step_scores and labels must be 1-D of one shape, got {tuple(step_scores.shape)} "
                         f"and {tuple(labels.shape)}")
    if step_scores.numel() == 0:
        raise ValueError("stepwise_reward_loss: no labelled step")
    y = labels.to(step_scores.dtype)
    loss = F.binary_cross_entropy_with_logits(step_scores, y)
    s = step_scores.detach()
    right = (s > 0) == (y >= 0.5)
    return StepwiseLossOutput(loss=loss, accuracy=right.to(s.dtype).mean(),
                              positive_fraction=(y >= 0.5).to(s.dtype).mean())


def solution_scores(step_scores: Tensor, step_mask: Tensor, how: str = "min") -> Tensor:
    """A solution's score from its steps' scores.

    Formula, over the steps ``k`` a row's mask marks: ``min``: ``min_k s_k`` (the
    weakest step: a solution is as good as its first mistake); ``last``: the
    last step's ``s_K``; ``mean``: ``(1/K) sum_k s_k``. A row without a step
    scores 0.

    Shapes: ``step_scores``, ``step_mask`` ``(B, S)``; returns ``(B,)``.

    Reference: the min and last-step aggregations of Lightman et al. 2023,
    arXiv 2305.20050 (sec. 3) and Wang et al. 2023, arXiv 2312.08935.
    """
    if how not in STEP_AGGREGATIONS:
        raise ValueError(f"how must be one of {STEP_AGGREGATIONS}, got {how!r}")
    if step_scores.shape != step_mask.shape or step_scores.dim() != 2:
        raise ValueError(f"step_scores and step_mask must be (B, S) of one shape, got {tuple(step_scores.shape)} "
                         f"and {tuple(step_mask.shape)}")
    mask = step_mask > 0
    count = mask.sum(-1)
    if how == "min":
        out = step_scores.masked_fill(~mask, float("inf")).amin(-1)
    elif how == "mean":
        out = (step_scores * mask).sum(-1) / count.clamp(min=1)
    else:
        last = (torch.arange(mask.shape[1], device=mask.device) * mask).argmax(-1)
        out = step_scores.gather(1, last[:, None]).squeeze(1)
    return torch.where(count > 0, out, torch.zeros_like(out))


def first_error_steps(step_correct: Tensor, step_mask: Tensor) -> Tensor:
    """The index of each row's first step judged wrong, or -1 where none is.

    Formula: ``min {k : mask_k and not correct_k}``, counting only masked steps
    (their order along S), else ``-1``. Comparing the first error a PRM finds
    with the labelled one is ProcessBench's measure.

    Shapes: ``step_correct`` (bool), ``step_mask`` ``(B, S)``; returns ``(B,)`` int64.

    Reference: Zheng et al. 2024, ProcessBench, arXiv 2412.06559.
    """
    mask = step_mask > 0
    wrong = mask & ~step_correct.bool()
    ordinal = mask.long().cumsum(-1) - 1  # the k-th masked step of its row
    big = torch.iinfo(torch.long).max
    first = torch.where(wrong, ordinal, torch.full_like(ordinal, big)).amin(-1)
    return torch.where(first == big, torch.full_like(first, -1), first)
