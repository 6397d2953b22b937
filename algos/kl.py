"""KL estimators, KL-penalised token rewards and KL-coefficient controllers."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from .masked import _bool_mask, _check_same_shape, place_at_last_token

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    kind: str = "k1",
    clamp: Optional[float] = None,
) -> Tensor:
    """Per-token Monte-Carlo estimate of KL(pi || pi_ref) from sampled tokens.

    Formula, with ``d = logprobs - ref_logprobs`` (optionally clamped to
    ``[-clamp, clamp]`` first):

    * ``k1 = d`` (unbiased, high variance, can be negative);
    * ``k2 = d^2 / 2`` (biased, low variance, >= 0);
    * ``k3 = exp(-d) - 1 + d`` (unbiased, >= 0).

    ``clamp`` keeps ``k3`` finite for extreme ratios (``exp(50)`` would
    overflow float32 for ``d = -50`` before the subtraction).

    Shapes: ``logprobs`` and ``ref_logprobs`` ``(B, T)``; returns ``(B, T)``.
    No masking is applied (see :func:`kl_penalized_rewards`).

    Reference: J. Schulman, 2020, "Approximating KL Divergence" (blog post);
    k3 as the GRPO KL term, Shao et al. 2024, arXiv 2402.03300.
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(
            f"unknown KL estimator kind {kind!r}; valid kinds: {', '.join(KL_ESTIMATORS)}"
        )
    _check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    d = logprobs - ref_logprobs
    if clamp is not None:
        if clamp <= 0:
            raise ValueError(f"clamp must be > 0, got {clamp}")
        d = d.clamp(min=-clamp, max=clamp)
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    return torch.expm1(-d) + d


def sequence_k1(logprobs: Tensor, ref_logprobs: Tensor, action_mask: Tensor) -> Tensor:
    """The sampled (k1) KL of each response to the reference, summed over its tokens.

    Formula: ``kl_i = sum_t m_it * (logprobs_it - ref_logprobs_it)`` (:func:`kl_estimate`, ``kind="k1"``,
    masked by ``action_mask`` m): a Monte-Carlo estimate of the sequence-level KL(pi || pi_ref),
    the figure a KL budget and the ``sequence_kl`` metric read.

    Shapes: ``logprobs``, ``ref_logprobs`` and ``action_mask`` ``(B, T)``; returns ``(B,)``.

    Reference: J. Schulman, 2020, "Approximating KL Divergence"; the sequence KL of RLHF as in
    Ouyang et al. 2022, arXiv 2203.02155.
    """
    return kl_estimate(logprobs, ref_logprobs, kind="k1").mul(action_mask).sum(-1)


def kl_penalized_rewards(
    sequence_rewards: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    action_mask: Tensor,
    *,
    kl_coef: float,
    kind: str = "k1",
    clamp: Optional[float] = None,
) -> Tensor:
    """Token rewards: per-token KL penalty plus the sequence reward at the end.

    Formula: ``r[b, t] = -kl_coef * kl[b, t] * mask[b, t]
    + sequence_rewards[b] * [t == last_b]`` where ``kl`` is
    :func:`kl_estimate` (``kind``, ``clamp``) and ``last_b`` the last valid
    token of row ``b``. Rows with no valid token are all 0; padding is 0.

    Shapes: ``sequence_rewards`` ``(B,)``; ``logprobs``, ``ref_logprobs``,
    ``action_mask`` ``(B, T)``; returns ``(B, T)`` in the dtype of
    ``logprobs``.

    Reference: Ziegler et al. 2019, "Fine-Tuning Language Models from Human
    Preferences", arXiv 1909.08593; Ouyang et al. 2022, arXiv 2203.02155.
    """
    _check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs, action_mask=action_mask)
    if sequence_rewards.shape != logprobs.shape[:1]:
        raise ValueError(
            f"sequence_rewards must have shape ({logprobs.shape[0]},), "
            f"got {tuple(sequence_rewards.shape)}"
        )
    mask = _bool_mask(action_mask)
    kl = kl_estimate(logprobs, ref_logprobs, kind=kind, clamp=clamp)
    zeros = torch.zeros_like(logprobs)
    rewards = torch.where(mask, -kl_coef * kl, zeros)
    return rewards + place_at_last_token(sequence_rewards.to(logprobs.dtype), action_mask)


class FixedKLController:
    """Constant KL coefficient; ``update`` is a no-op.

    Reference: Ziegler et al. 2019, arXiv 1909.08593 (fixed-beta baseline).
    """

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: Union[float, Tensor], n_steps: int) -> float:
        """Return the (unchanged) coefficient; arguments are ignored."""
        return self.value


class AdaptiveKLController:
    """Proportional controller that steers the observed KL towards a target.

    Formula: ``e = clip(current_kl / target - 1, -0.2, 0.2)``;
    ``coef <- coef * (1 + e * n_steps / horizon)``.

    Reference: Ziegler et al. 2019, "Fine-Tuning Language Models from Human
    Preferences", arXiv 1909.08593, section 2.2.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        if target <= 0:
            raise ValueError(f"target must be > 0, got {target}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: Union[float, Tensor], n_steps: int) -> float:
        """Update and return the coefficient (see the class docstring)."""
        error = float(current_kl) / self.target - 1.0
        error = min(max(error, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value
