"""Preference losses: Bradley-Terry reward model, KTO, and the reference-free SimPO and ORPO (DPO's family: dpo.py).

Metrics in the returned dataclasses are detached 0-d tensors (``float(x)``
gives the number); ``loss`` is the differentiable 0-d batch mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ..masked import masked_mean, masked_sum


@dataclass(frozen=True)
class PreferenceLossOutput:
    """Loss plus means of the implicit rewards of the chosen/rejected sides."""

    loss: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor
    reward_margin: Tensor
    accuracy: Tensor


def _check_pair(**tensors: Tensor) -> None:
    items = list(tensors.items())
    for name, t in items:
        if t.dim() != 1 or t.shape != items[0][1].shape:
            raise ValueError(f"{name} must be 1-D with the same shape as {items[0][0]}, "
                             f"got {tuple(t.shape)}")


def _metrics(loss: Tensor, chosen: Tensor, rejected: Tensor) -> PreferenceLossOutput:
    c, r = chosen.detach(), rejected.detach()
    return PreferenceLossOutput(loss=loss, chosen_rewards=c.mean(), rejected_rewards=r.mean(),
                                reward_margin=(c - r).mean(), accuracy=(c > r).to(c.dtype).mean())


def sequence_logprobs(logprobs: Tensor, action_mask: Tensor, *, average: bool = False) -> Tensor:
    """Log-probability of each response: token logprobs summed over valid tokens.

    Formula: ``log pi(y|x) = sum_t mask_t * logprobs_t``; with
    ``average=True`` divided by the number of valid tokens (0 for empty rows).

    Shapes: ``logprobs``, ``action_mask`` ``(B, T)``; returns ``(B,)``.

    Reference: the sequence log-likelihoods of DPO, Rafailov et al. 2023,
    arXiv 2305.18290.
    """
    if average:
        return masked_mean(logprobs, action_mask, dim=-1)
    return masked_sum(logprobs, action_mask, dim=-1)


def pairwise_reward_loss(chosen_scores: Tensor, rejected_scores: Tensor, *,
                         margin: Optional[Tensor] = None) -> PreferenceLossOutput:
    """Bradley-Terry pairwise loss for reward-model training.

    Formula: ``L = mean_b -log sigmoid(c_b - r_b - m_b)`` (``m = 0`` without
    margin); metrics use the raw scores; ``accuracy = mean(c > r)``.

    Shapes: ``chosen_scores``, ``rejected_scores``, ``margin`` ``(B,)``.

    Reference: Ouyang et al. 2022, arXiv 2203.02155 (pairwise RM loss);
    margin term as in Llama 2, Touvron et al. 2023, arXiv 2307.09288.
    """
    _check_pair(chosen_scores=chosen_scores, rejected_scores=rejected_scores)
    diff = chosen_scores - rejected_scores
    if margin is not None:
        _check_pair(chosen_scores=chosen_scores, margin=margin)
        diff = diff - margin.to(diff.dtype)
    return _metrics(-F.logsigmoid(diff).mean(), chosen_scores, rejected_scores)


def simpo_loss(chosen_avg_logps: Tensor, rejected_avg_logps: Tensor, *, beta: float,
               gamma: float) -> PreferenceLossOutput:
    """Simple Preference Optimization: a length-normalised margin with no reference model.

    Formula, with ``a_c``, ``a_r`` the responses' mean token log-probs
    (``sequence_logprobs(..., average=True)``), per pair:
    ``-log sigmoid(beta a_c - beta a_r - gamma)``; the loss is the batch mean.

    Metrics: ``chosen_rewards = mean beta a_c``, ``rejected_rewards = mean
    beta a_r`` (SimPO's implicit rewards), ``reward_margin`` their mean
    difference, ``accuracy = mean(a_c > a_r)``.

    Shapes: both inputs ``(B,)``.

    Reference: Meng, Xia and Chen 2024, "SimPO: Simple Preference
    Optimization with a Reference-Free Reward", arXiv 2405.14734.
    """
    _check_pair(chosen_avg_logps=chosen_avg_logps, rejected_avg_logps=rejected_avg_logps)
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    chosen, rejected = beta * chosen_avg_logps, beta * rejected_avg_logps
    return _metrics(-F.logsigmoid(chosen - rejected - gamma).mean(), chosen, rejected)


def log_odds(avg_logps: Tensor) -> Tensor:
    """The log odds of a response's mean token probability, ORPO's odds.

    Formula: ``log(p / (1 - p))`` of ``p = exp(a)``, ``a = avg_logps``: ``a - log(1 - exp(a))``, computed as
    ``a - log(-expm1(a))``. ``a`` is a mean token log-probability, so ``a <= 0``; at ``a = 0`` (every token
    certain) the odds are infinite, so ``a`` is capped at ``-1e-6`` (odds of about 1e6) to keep the loss finite.

    Shapes: any; returns the same shape.

    Reference: Hong, Lee and Thorne 2024, arXiv 2403.07691.
    """
    a = avg_logps.clamp(max=-1e-6)
    return a - torch.log(-torch.expm1(a))


def orpo_loss(chosen_avg_logps: Tensor, rejected_avg_logps: Tensor, *, lam: float) -> PreferenceLossOutput:
    """Odds Ratio Preference Optimization: SFT on the chosen responses plus an odds-ratio term, no reference.

    Formula, with ``a_c``, ``a_r`` the responses' mean token log-probs and
    ``log_odds(a) = a - log(1 - exp(a))``, per pair:
    ``-a_c + lam * -log sigmoid(log_odds(a_c) - log_odds(a_r))``; the loss
    is the batch mean (the SFT term is each chosen response's mean token
    NLL, averaged over pairs).

    Metrics: ``chosen_rewards = mean lam a_c``, ``rejected_rewards = mean
    lam a_r``, ``reward_margin`` their mean difference, ``accuracy = mean(a_c
    > a_r)``.

    Shapes: both inputs ``(B,)``.

    Reference: Hong, Lee and Thorne 2024, "ORPO: Monolithic Preference
    Optimization without Reference Model", arXiv 2403.07691.
    """
    _check_pair(chosen_avg_logps=chosen_avg_logps, rejected_avg_logps=rejected_avg_logps)
    if lam <= 0:
        raise ValueError(f"lam must be > 0, got {lam}")
    ratio = log_odds(chosen_avg_logps) - log_odds(rejected_avg_logps)
    loss = (-chosen_avg_logps - lam * F.logsigmoid(ratio)).mean()
    return _metrics(loss, lam * chosen_avg_logps, lam * rejected_avg_logps)


@dataclass(frozen=True)
class KTOLossOutput(PreferenceLossOutput):
    """KTO loss and metrics; ``kl`` is the reference point ``z0`` used; the example counts are 0-d long
    tensors on the inputs' device (no host sync per call)."""

    kl: Tensor
    n_desirable: Tensor
    n_undesirable: Tensor


def kto_loss(policy_logps: Tensor, ref_logps: Tensor, desirable: Tensor,
             kl_ref_point: Union[Tensor, float], *, beta: float, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0) -> KTOLossOutput:
    """Kahneman-Tversky Optimization loss on unpaired binary feedback.

    Formula: ``r = policy_logps - ref_logps``; ``z0 = max(kl_ref_point, 0)``
    (detached); per example ``l = w_d (1 - sigmoid(beta (r - z0)))`` if
    desirable else ``l = w_u (1 - sigmoid(beta (z0 - r)))``; ``L = mean_b l``
    (over the whole batch, so all-desirable or all-undesirable batches work).

    Metrics: ``chosen_rewards`` / ``rejected_rewards`` = mean ``beta r`` over
    desirable / undesirable examples (0 if there are none), ``reward_margin``
    their difference, ``accuracy`` = share of examples on the right side of
    the reference point (``r > z0`` if desirable, ``r < z0`` otherwise).

    Shapes: ``policy_logps``, ``ref_logps``, ``desirable`` (bool) ``(B,)``;
    ``kl_ref_point`` 0-d.

    Reference: Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect
    Theoretic Optimization", arXiv 2402.01306.
    """
    _check_pair(policy_logps=policy_logps, ref_logps=ref_logps, desirable=desirable)
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    des = desirable if desirable.dtype == torch.bool else desirable != 0
    z0 = torch.as_tensor(kl_ref_point, dtype=policy_logps.dtype,
                         device=policy_logps.device).detach().clamp(min=0.0)
    r = policy_logps - ref_logps
    loss_d = desirable_weight * (1.0 - torch.sigmoid(beta * (r - z0)))
    loss_u = undesirable_weight * (1.0 - torch.sigmoid(beta * (z0 - r)))
    loss = torch.where(des, loss_d, loss_u).mean()
    with torch.no_grad():
        rew = beta * r
        chosen = masked_mean(rew, des)
        rejected = masked_mean(rew, ~des)
        correct = torch.where(des, r > z0, r < z0).to(r.dtype).mean()
    return KTOLossOutput(loss=loss, chosen_rewards=chosen, rejected_rewards=rejected,
                         reward_margin=chosen - rejected, accuracy=correct, kl=z0,
                         n_desirable=des.sum(), n_undesirable=(~des).sum())


def best_worst_pairs(rewards: Tensor, group_size: int) -> tuple[Tensor, Tensor, int]:
    """Online DPO's pairs: in each prompt's group of samples, the best against the worst.

    Formula: for group ``g`` (rows ``g*n .. g*n + n - 1``), ``chosen_g = argmax_i r_i``,
    ``rejected_g = argmin_i r_i`` (the first such row on ties within the group); a group whose
    rewards are all equal (``max r = min r``) gives no pair and is counted.

    Shapes: ``rewards`` ``(G * n,)``, groups contiguous; returns ``(chosen (P,), rejected (P,)
    row indices into rewards, number of tied groups skipped)`` with ``P + skipped = G``.

    Reference: the best-vs-worst pairing of online / iterative DPO, Xu et al. 2023 ("Some things
    are more CRINGE than others", arXiv 2312.16682) and Dong et al. 2024 (RLHF Workflow, arXiv
    2405.07863).
    """
    if rewards.dim() != 1 or group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} rows, "
                         f"got shape {tuple(rewards.shape)}")
    groups = rewards.view(-1, group_size)
    offsets = torch.arange(groups.shape[0], device=rewards.device) * group_size
    best, worst = groups.argmax(-1) + offsets, groups.argmin(-1) + offsets
    distinct = groups.max(-1).values > groups.min(-1).values
    return best[distinct], worst[distinct], int((~distinct).sum().item())
