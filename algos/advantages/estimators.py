"""Registry of advantage estimators sharing one keyword-only signature.

Every estimator is called as::

    fn(*, token_rewards, action_mask, values, group_size, gamma, lam, eps, std_norm=None, steps=None)
        -> AdvantageOutput(advantages (B, T), returns (B, T))

``token_rewards`` already hold the sequence reward at the last valid token
plus any per-token KL penalty (see :func:`algos.kl.kl_penalized_rewards`),
so sequence-level estimators use the score
``s_b = sum_t mask[b, t] * token_rewards[b, t]``. ``values`` may be None
for every estimator except "gae". Outputs are 0 at padding and detached.
Arguments an estimator does not need (e.g. ``lam`` for "grpo") are accepted
and ignored so that callers can dispatch on the name alone. ``std_norm``
switches the group standard-deviation division of the group estimators
("grpo": default True, "dr_grpo": default False); None keeps the
estimator's own behaviour, and the others, which have no group std to
switch, reject any other value rather than ignore it. ``steps`` (a
:class:`algos.advantages.process.StepRewards`) are dense process rewards:
the estimators with returns add them to the token rewards, the group ones
add :func:`algos.advantages.process.process_group_advantages` (with their own
std switch) to the outcome advantage; "per_token" refuses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Dict, Optional

import torch
from torch import Tensor

from .group import (
    group_centered_advantages,
    group_normalized_advantages,
    leave_one_out_advantages,
)
from ..masked import (
    _bool_mask,
    _check_same_shape,
    masked_sum,
    masked_whiten,
    place_at_last_token,
)
from .process import StepRewards, process_group_advantages, with_step_rewards
from .returns import compute_gae, discounted_returns


@dataclass(frozen=True)
class AdvantageOutput:
    """Result of an advantage estimator: both fields ``(B, T)``, 0 at padding."""

    advantages: Tensor
    returns: Tensor


AdvantageEstimator = Callable[..., AdvantageOutput]
_REGISTRY: Dict[str, AdvantageEstimator] = {}
#: Read-only live view ``name -> estimator`` of the registry.
ADVANTAGE_ESTIMATORS = MappingProxyType(_REGISTRY)


class UnknownAdvantageEstimatorError(KeyError, ValueError):
    """Unknown estimator name; catchable as KeyError or ValueError."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def register_advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator registering ``fn`` under ``name`` (duplicate -> ValueError)."""

    def decorator(fn: AdvantageEstimator) -> AdvantageEstimator:
        if name in _REGISTRY:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return decorator


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """Look up an estimator; unknown names raise an error listing valid ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        valid = ", ".join(sorted(_REGISTRY))
        raise UnknownAdvantageEstimatorError(
            f"unknown advantage estimator {name!r}; valid names: {valid}"
        ) from None


def sequence_scores(token_rewards: Tensor, action_mask: Tensor) -> Tensor:
    """Sequence score: token rewards summed over the valid tokens.

    Formula: ``s_b = sum_t mask[b, t] * r[b, t]``.

    Shapes: ``token_rewards``, ``action_mask`` ``(B, T)``; returns ``(B,)``
    (0 for a fully masked row).

    Reference: outcome supervision in GRPO, Shao et al. 2024, arXiv 2402.03300.
    """
    return masked_sum(token_rewards, action_mask, dim=-1)


def _broadcast(seq_adv: Tensor, action_mask: Tensor, like: Tensor) -> Tensor:
    """Copy ``(B,)`` values onto every valid token of ``(B, T)``; 0 elsewhere."""
    full = seq_adv.to(like.dtype).unsqueeze(1).expand_as(like)
    return torch.where(_bool_mask(action_mask), full, torch.zeros_like(like))


def _sequence_output(adv: Tensor, action_mask: Tensor, like: Tensor) -> AdvantageOutput:
    tok = _broadcast(adv, action_mask, like).detach()
    return AdvantageOutput(advantages=tok, returns=tok)


def _plus_process(out: AdvantageOutput, steps: Optional[StepRewards], action_mask: Tensor, group_size: int,
                  eps: float, std_norm: bool) -> AdvantageOutput:
    """A group estimator's outcome advantage plus, with dense step rewards, their process advantage."""
    if steps is None:
        return out
    adv = out.advantages + process_group_advantages(steps, action_mask, group_size, eps=eps, std_norm=std_norm)
    return AdvantageOutput(advantages=adv, returns=adv)


def _group_output(token_rewards: Tensor, action_mask: Tensor, group_size: int, eps: float,
                  std_norm: bool, steps: Optional[StepRewards]) -> AdvantageOutput:
    """Group-mean baseline, divided by the group std when ``std_norm`` (GRPO) or not (Dr. GRPO); plus the
    step rewards' process advantage, normalised the same way."""
    _check_same_shape(token_rewards=token_rewards, action_mask=action_mask)
    s = sequence_scores(token_rewards, action_mask).detach()
    adv = (group_normalized_advantages(s, group_size, eps=eps) if std_norm
           else group_centered_advantages(s, group_size))
    return _plus_process(_sequence_output(adv, action_mask, token_rewards), steps, action_mask, group_size, eps,
                         std_norm)


def _no_std_norm(name: str, std_norm: Optional[bool]) -> None:
    if std_norm is not None:
        raise ValueError(f"advantage estimator {name!r} has no group std normalisation to switch "
                         f"(std_norm={std_norm}); leave it None")


@register_advantage_estimator("gae")
def gae_estimator(*, token_rewards: Tensor, action_mask: Tensor, values: Optional[Tensor],
                  group_size: int, gamma: float, lam: float, eps: float,
                  std_norm: Optional[bool] = None, steps: Optional[StepRewards] = None) -> AdvantageOutput:
    """GAE(gamma, lam) with a critic; see :func:`algos.advantages.returns.compute_gae`.

    Formula: ``delta_t = r_t + gamma V_{t+1} - V_t``,
    ``A_t = delta_t + gamma lam A_{t+1}``, ``returns = A + V``; the last
    valid token is terminal (``V = 0`` after it). Advantages are NOT
    whitened (apply :func:`algos.masked.masked_whiten` if wanted), so
    ``returns == advantages + values`` holds exactly on valid tokens.

    Shapes: ``token_rewards``, ``values``, ``action_mask`` ``(B, T)``.

    Reference: Schulman et al. 2015, arXiv 1506.02438.
    """
    _no_std_norm("gae", std_norm)
    if values is None:
        raise ValueError("advantage estimator 'gae' requires critic `values` (B, T); got None")
    adv, ret = compute_gae(with_step_rewards(token_rewards, steps), values, action_mask, gamma=gamma, lam=lam)
    return AdvantageOutput(advantages=adv, returns=ret)


@register_advantage_estimator("grpo")
def grpo_estimator(*, token_rewards: Tensor, action_mask: Tensor, values: Optional[Tensor],
                   group_size: int, gamma: float, lam: float, eps: float,
                   std_norm: Optional[bool] = None, steps: Optional[StepRewards] = None) -> AdvantageOutput:
    """GRPO outcome advantage, broadcast to every valid token.

    Formula: ``A_{b,t} = (s_b - mean_G(s)) / (std_G(s) + eps)``; ``std_G`` is
    the unbiased (n - 1) group standard deviation (as ``torch.std``);
    constant groups and groups of one give 0. ``returns`` equals
    ``advantages``. ``std_norm=False``: ``A_{b,t} = s_b - mean_G(s)`` (no
    std division, as "dr_grpo"); None or True: with it.

    Shapes: ``token_rewards``, ``action_mask`` ``(B, T)``, ``B = n * group_size``.

    Reference: Shao et al. 2024, arXiv 2402.03300; without the std: Liu et
    al. 2025, arXiv 2503.20783.
    """
    return _group_output(token_rewards, action_mask, group_size, eps, std_norm is not False, steps)


@register_advantage_estimator("dr_grpo")
def dr_grpo_estimator(*, token_rewards: Tensor, action_mask: Tensor, values: Optional[Tensor],
                      group_size: int, gamma: float, lam: float, eps: float,
                      std_norm: Optional[bool] = None, steps: Optional[StepRewards] = None) -> AdvantageOutput:
    """Dr. GRPO advantage, broadcast to every valid token.

    Formula: ``A_{b,t} = s_b - mean_G(s)`` (no std division; 0 for constant
    groups). ``std_norm=True``: divided by ``std_G(s) + eps`` (as "grpo").

    Shapes: ``token_rewards``, ``action_mask`` ``(B, T)``. ``returns == advantages``.

    Reference: Liu et al. 2025, arXiv 2503.20783.
    """
    return _group_output(token_rewards, action_mask, group_size, eps, std_norm is True, steps)


@register_advantage_estimator("rloo")
def rloo_estimator(*, token_rewards: Tensor, action_mask: Tensor, values: Optional[Tensor],
                   group_size: int, gamma: float, lam: float, eps: float,
                   std_norm: Optional[bool] = None, steps: Optional[StepRewards] = None) -> AdvantageOutput:
    """RLOO leave-one-out advantage, broadcast to every valid token.

    Formula: ``A_{i,t} = s_i - (1/(g-1)) sum_{j in G(i), j != i} s_j``;
    groups of one give 0. Shapes: ``(B, T)`` in and out. ``returns == advantages``.

    Reference: Ahmadian et al. 2024, arXiv 2402.14740.
    """
    _no_std_norm("rloo", std_norm)
    _check_same_shape(token_rewards=token_rewards, action_mask=action_mask)
    s = sequence_scores(token_rewards, action_mask).detach()
    out = _sequence_output(leave_one_out_advantages(s, group_size), action_mask, token_rewards)
    return _plus_process(out, steps, action_mask, group_size, eps, False)


@register_advantage_estimator("reinforce_pp")
def reinforce_pp_estimator(*, token_rewards: Tensor, action_mask: Tensor,
                           values: Optional[Tensor], group_size: int, gamma: float,
                           lam: float, eps: float,
                           std_norm: Optional[bool] = None, steps: Optional[StepRewards] = None) -> AdvantageOutput:
    """REINFORCE++: discounted return-to-go, whitened over the whole batch.

    Formula: ``G_t = sum_{k >= t} gamma^{k-t} r_k`` (valid tokens only);
    ``A = (G - mean(G)) / sqrt(var(G) + eps)`` with mean and population
    variance over every valid token of the batch; ``returns = G``.

    Shapes: ``token_rewards``, ``action_mask`` ``(B, T)``.

    Reference: Hu 2025, "REINFORCE++", arXiv 2501.03262.
    """
    _no_std_norm("reinforce_pp", std_norm)
    g = discounted_returns(with_step_rewards(token_rewards, steps), action_mask, gamma=gamma)
    adv = masked_whiten(g, action_mask, shift_mean=True, eps=eps)
    return AdvantageOutput(advantages=adv, returns=g)


@register_advantage_estimator("reinforce_pp_baseline")
def reinforce_pp_baseline_estimator(*, token_rewards: Tensor, action_mask: Tensor,
                                    values: Optional[Tensor], group_size: int, gamma: float,
                                    lam: float, eps: float, std_norm: Optional[bool] = None,
                                    steps: Optional[StepRewards] = None) -> AdvantageOutput:
    """REINFORCE++-baseline: group-mean baseline, return-to-go, global whitening.

    Formula: ``s_i`` = sequence score (task reward + summed per-token KL
    terms); ``c_i = s_i - mean_G(s)`` (0 for constant groups / groups of
    one). The token rewards are shifted by ``c_i - s_i`` at the last valid
    token, so each row keeps its per-token KL terms and its total becomes
    ``c_i``. Then ``G`` = discounted return-to-go (``gamma``) and
    ``A = whiten(G)`` over all valid tokens of the batch; ``returns = G``.
    Note the baseline is taken over the full score (KL included); with
    ``kl_coef = 0`` this is the task-reward group mean.

    Shapes: ``token_rewards``, ``action_mask`` ``(B, T)``, ``B = n * group_size``.

    Reference: Hu 2025, arXiv 2501.03262 (REINFORCE++-baseline variant).
    """
    _no_std_norm("reinforce_pp_baseline", std_norm)
    _check_same_shape(token_rewards=token_rewards, action_mask=action_mask)
    mask = _bool_mask(action_mask)
    token_rewards = with_step_rewards(token_rewards, steps)
    rewards = torch.where(mask, token_rewards, torch.zeros_like(token_rewards)).detach()
    s = sequence_scores(rewards, action_mask)
    shift = (group_centered_advantages(s, group_size) - s).to(rewards.dtype)
    shifted = rewards + place_at_last_token(shift, action_mask)
    g = discounted_returns(shifted, action_mask, gamma=gamma)
    adv = masked_whiten(g, action_mask, shift_mean=True, eps=eps)
    return AdvantageOutput(advantages=adv, returns=g)


@register_advantage_estimator("per_token")
def per_token_estimator(*, token_rewards: Tensor, action_mask: Tensor, values: Optional[Tensor],
                        group_size: int, gamma: float, lam: float, eps: float,
                        std_norm: Optional[bool] = None, steps: Optional[StepRewards] = None) -> AdvantageOutput:
    """Each token's own reward as its advantage: no return-to-go, no baseline (discount 0).

    Formula: ``A_{b,t} = m_{b,t} * r_{b,t}``; ``returns == advantages``. For signals that are already
    per-token credit, such as on-policy distillation's negative reverse KL
    (:func:`algos.losses.distill.distillation_token_rewards`).

    Shapes: ``token_rewards``, ``action_mask`` ``(B, T)``.

    Reference: on-policy distillation with per-token reverse-KL credit, Agarwal et al. 2024, arXiv 2306.13649.
    """
    _no_std_norm("per_token", std_norm)
    if steps is not None:
        raise ValueError("advantage estimator 'per_token' takes each token's own reward as its advantage; it has "
                         "no place for step rewards (steps=None)")
    _check_same_shape(token_rewards=token_rewards, action_mask=action_mask)
    mask = _bool_mask(action_mask)
    adv = torch.where(mask, token_rewards, torch.zeros_like(token_rewards)).detach()
    return AdvantageOutput(advantages=adv, returns=adv)
