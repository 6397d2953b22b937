"""Token entropy of the policy and the entropy-bonus loss term."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .aggregate import aggregate_loss


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution defined by ``logits``.

    Formula: ``H = -sum_v p_v log p_v`` with ``log p = log_softmax(logits)``
    (computed in log space, so large logits are safe; ``-inf`` logits, i.e.
    banned tokens, contribute exactly 0 and give no NaN gradient).

    Shapes: ``logits`` ``(B, T, V)``; returns ``(B, T)`` in the dtype of
    ``logits`` (upcast bf16 logits to float32 first for accuracy).

    Reference: entropy bonus of A3C/PPO, Mnih et al. 2016, arXiv 1602.01783;
    Schulman et al. 2017, arXiv 1707.06347.
    """
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    safe_logp = logp.clamp(min=torch.finfo(logp.dtype).min)
    return -(p * safe_logp).sum(dim=-1)


class _TargetLogprobsEntropy(torch.autograd.Function):
    """log p(y) and H from logits in one softmax; backward from the saved p (see the wrapper)."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, with_entropy: bool):
        ctx.set_materialize_grads(False)  # an output unused in the loss sends no gradient
        top = logits.amax(dim=-1, keepdim=True)
        p = torch.sub(logits, top).exp_()
        total = p.sum(dim=-1, keepdim=True)
        p.div_(total)
        lse = (top + total.log()).squeeze(-1)
        logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
        if not with_entropy:
            ctx.save_for_backward(p, targets)
            return logprobs
        entropy = lse - torch.linalg.vecdot(p, logits)
        ctx.save_for_backward(p, targets, logits, lse, entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor | None, grad_entropy: Tensor | None = None):
        saved = ctx.saved_tensors  # unpacked once: under activation checkpointing a second unpack fails
        p, targets = saved[:2]
        grad = None
        if grad_logprobs is not None:  # d log p_y / dz = onehot(y) - p
            grad = p * (-grad_logprobs).unsqueeze(-1)
            grad.scatter_add_(-1, targets.unsqueeze(-1), grad_logprobs.unsqueeze(-1))
        if grad_entropy is not None:  # dH / dz = -p * (log p + H),  log p = z - lse
            logits, lse, entropy = saved[2:]
            term = p * (logits - (lse - entropy).unsqueeze(-1)) * (-grad_entropy).unsqueeze(-1)
            grad = term if grad is None else grad + term
        return grad, None, None


def target_logprobs_and_entropy(logits: Tensor, targets: Tensor, *,
                                with_entropy: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """Log-probability of each target token and, when asked, the distribution's entropy, from one
    softmax of finite logits (an output layer's).

    Formulas, with ``p = softmax(z)`` computed as ``exp(z - max z) / sum``:
    ``log p(y) = z_y - lse(z)``, ``lse = max z + log sum exp(z - max z)``,
    ``H = lse - sum_v p_v z_v``. Gradients from the saved ``p``:
    ``d log p(y) / dz = onehot(y) - p`` and ``dH / dz = -p (log p + H)``, so
    backward needs no second exponential, and an output the loss does not use
    (the entropy when it is only logged) adds nothing to it. The results equal
    ``log_softmax(z).gather(y)`` and :func:`entropy_from_logits` within fp32 rounding.

    Shapes: ``logits`` ``(N, V)`` floating, ``targets`` ``(N,)`` long; returns ``(N,)``
    and ``(N,)`` (or ``None``) in the dtype of ``logits``.

    Reference: the policy log-likelihood and entropy bonus of PPO, Schulman et al. 2017,
    arXiv 1707.06347.
    """
    if not with_entropy:
        return _TargetLogprobsEntropy.apply(logits, targets, False), None
    return _TargetLogprobsEntropy.apply(logits, targets, True)


def entropy_bonus_loss(
    entropy: Tensor,
    action_mask: Tensor,
    *,
    entropy_coef: float,
    agg: str = "token_mean",
    loss_scale_constant: Optional[float] = None,
) -> Tensor:
    """Loss term that rewards entropy: ADD it to the policy loss.

    Formula: ``L_ent = -entropy_coef * agg(H)`` where ``agg`` is
    :func:`algos.aggregate.aggregate_loss` over the valid tokens
    (minimising ``L_ent`` raises the entropy when ``entropy_coef > 0``).

    Shapes: ``entropy``, ``action_mask`` ``(B, T)``; returns a 0-d tensor.

    Reference: Mnih et al. 2016, arXiv 1602.01783; Schulman et al. 2017,
    arXiv 1707.06347 (the ``c2 S`` term of the PPO objective).
    """
    return -entropy_coef * aggregate_loss(
        entropy, action_mask, agg=agg, loss_scale_constant=loss_scale_constant
    )
