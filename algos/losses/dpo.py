"""DPO and the losses of its family: one per pair from the two responses' log-ratios to the reference.

With ``c = log pi(y_c|x) - log ref(y_c|x)`` and ``r = log pi(y_r|x) - log ref(y_r|x)``
(sequence log-probabilities, :func:`algos.losses.preference.sequence_logprobs`),
``h = c - r``, ``beta > 0`` and ``eps`` the label smoothing, each loss type is a
per-pair function of ``(c, r)``; the loss is its batch mean, plus RPO's NLL term
where weighted. Metrics are those of every preference loss (implicit rewards
``beta c`` and ``beta r``).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .preference import PreferenceLossOutput, _check_pair, _metrics


def _sigmoid(c: Tensor, r: Tensor, beta: float, eps: float) -> Tensor:
    h = c - r
    return -(1.0 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)


def _ipo(c: Tensor, r: Tensor, beta: float, eps: float) -> Tensor:
    return (c - r - 1.0 / (2.0 * beta)) ** 2


def _robust(c: Tensor, r: Tensor, beta: float, eps: float) -> Tensor:
    h = c - r
    return (-(1.0 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1.0 - 2.0 * eps)


def _hinge(c: Tensor, r: Tensor, beta: float, eps: float) -> Tensor:
    return torch.relu(1.0 - beta * (c - r))


def _nca_pair(c: Tensor, r: Tensor, beta: float, eps: float) -> Tensor:
    return -F.logsigmoid(beta * c) - 0.5 * F.logsigmoid(-beta * c) - 0.5 * F.logsigmoid(-beta * r)


def _apo_zero(c: Tensor, r: Tensor, beta: float, eps: float) -> Tensor:
    return 1.0 - torch.sigmoid(beta * c) + torch.sigmoid(beta * r)


def _apo_down(c: Tensor, r: Tensor, beta: float, eps: float) -> Tensor:
    return torch.sigmoid(beta * c) + 1.0 - torch.sigmoid(beta * (c - r))


def _sppo_hard(c: Tensor, r: Tensor, beta: float, eps: float) -> Tensor:
    return (c - 1.0 / (2.0 * beta)) ** 2 + (r + 1.0 / (2.0 * beta)) ** 2


#: ``loss_type -> per-pair loss(c, r, beta, label_smoothing)``: the formulas of :func:`dpo_loss`.
DPO_LOSS_TYPES: Dict[str, Callable[[Tensor, Tensor, float, float], Tensor]] = {
    "apo_down": _apo_down,
    "apo_zero": _apo_zero,
    "cdpo": _sigmoid,
    "hinge": _hinge,
    "ipo": _ipo,
    "nca_pair": _nca_pair,
    "robust": _robust,
    "sigmoid": _sigmoid,
    "sppo_hard": _sppo_hard,
}
#: The loss types that read ``label_smoothing`` ("sigmoid" with it is cDPO).
SMOOTHED_LOSS_TYPES = ("sigmoid", "cdpo", "robust")


def dpo_loss(policy_chosen_logps: Tensor, policy_rejected_logps: Tensor,
             ref_chosen_logps: Tensor, ref_rejected_logps: Tensor, *, beta: float,
             loss_type: str = "sigmoid", label_smoothing: float = 0.0, rpo_alpha: float = 0.0,
             chosen_nll: Optional[Tensor] = None) -> PreferenceLossOutput:
    """Direct Preference Optimization and its family, per pair of log-ratios ``c`` (chosen), ``r`` (rejected).

    Formula, ``h = c - r``, ``l(z) = -log sigmoid(z)``, ``eps = label_smoothing``:

    * ``"sigmoid"`` (DPO, Rafailov et al. 2023, arXiv 2305.18290): ``l(beta h)``;
    * ``"cdpo"`` (conservative DPO, Mitchell 2023, "A note on DPO with noisy preferences"):
      ``(1-eps) l(beta h) + eps l(-beta h)`` (``"sigmoid"`` is the same formula: DPO at ``eps = 0``);
    * ``"robust"`` (rDPO, Chowdhury et al. 2024, arXiv 2403.00409): ``((1-eps) l(beta h) - eps l(-beta h)) /
      (1 - 2 eps)``, unbiased under labels flipped with probability ``eps``;
    * ``"ipo"`` (Azar et al. 2023, arXiv 2310.12036): ``(h - 1/(2 beta))^2``;
    * ``"hinge"`` (RSO's hinge, Liu et al. 2023, arXiv 2309.06657, after SLiC, Zhao et al. 2023, arXiv
      2305.10425): ``max(0, 1 - beta h)``, a margin of ``1 / beta`` in ``h``;
    * ``"nca_pair"`` (NCA, Chen et al. 2024, arXiv 2402.05369): ``l(beta c) + (l(-beta c) + l(-beta r)) / 2``;
    * ``"apo_zero"`` (APO, D'Oosterlinck et al. 2024, arXiv 2408.06266): ``1 - sigmoid(beta c) +
      sigmoid(beta r)``: the chosen likelihood up, the rejected down;
    * ``"apo_down"`` (same paper): ``sigmoid(beta c) + 1 - sigmoid(beta h)``: both down, the rejected more;
    * ``"sppo_hard"`` (SPPO with hard labels, Wu et al. 2024, arXiv 2405.00675):
      ``(c - 1/(2 beta))^2 + (r + 1/(2 beta))^2``.

    The loss is the batch mean, plus ``rpo_alpha * mean(chosen_nll)`` where ``rpo_alpha > 0`` (RPO, Pang
    et al. 2024, arXiv 2404.19733: the chosen responses' negative log-likelihood per token). Metrics:
    ``chosen_rewards = mean beta c``, ``rejected_rewards = mean beta r``, ``reward_margin`` their mean
    difference, ``accuracy = mean(beta c > beta r)`` per pair.

    Shapes: all four log-probabilities and ``chosen_nll`` ``(B,)``.
    """
    _check_pair(policy_chosen_logps=policy_chosen_logps,
                policy_rejected_logps=policy_rejected_logps,
                ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps)
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; valid: {', '.join(sorted(DPO_LOSS_TYPES))}")
    if label_smoothing and loss_type not in SMOOTHED_LOSS_TYPES:
        raise ValueError(f"label_smoothing is not defined for loss_type {loss_type!r} (only for "
                         f"{', '.join(SMOOTHED_LOSS_TYPES)})")
    if rpo_alpha < 0 or (rpo_alpha > 0 and chosen_nll is None):
        raise ValueError(f"rpo_alpha must be >= 0 and, above 0, comes with chosen_nll; got {rpo_alpha}, "
                         f"chosen_nll {'given' if chosen_nll is not None else 'None'}")
    c = policy_chosen_logps - ref_chosen_logps
    r = policy_rejected_logps - ref_rejected_logps
    loss = DPO_LOSS_TYPES[loss_type](c, r, beta, label_smoothing).mean()
    if rpo_alpha > 0:
        _check_pair(policy_chosen_logps=policy_chosen_logps, chosen_nll=chosen_nll)
        loss = loss + rpo_alpha * chosen_nll.mean()
    return _metrics(loss, beta * c, beta * r)
