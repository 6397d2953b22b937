"""On-policy distillation: the teacher's pull on the tokens the student sampled.

The student samples a response; the teacher scores exactly those tokens. The
per-token signal is the negative reverse KL, KL(student || teacher), estimated
at the sampled token (the k1 estimator of :mod:`algos.kl`), used as the
token's reward and, with no return-to-go, as its advantage: each token is
pushed toward what the teacher would have sampled there, and no further.

References: Agarwal et al. 2024, "On-Policy Distillation of Language Models:
Learning from Self-Generated Mistakes" (GKD), arXiv 2306.13649; Gu et al.
2024, "MiniLLM", arXiv 2306.08543 (reverse KL on student samples); Thinking
Machines 2025, "On-Policy Distillation" (per-token reverse KL as the
advantage of an importance-sampled policy-gradient step, discount 0).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..masked import _bool_mask, _check_same_shape


def reverse_kl_per_token(student_logprobs: Tensor, teacher_logprobs: Tensor, action_mask: Tensor) -> Tensor:
    """The sampled estimate of KL(student || teacher) at each response token.

    Formula: ``kl_{b,t} = m_{b,t} * (log pi_S(y_t | y_<t) - log pi_T(y_t | y_<t))`` with ``y_t`` the token
    the student sampled: an unbiased estimate of the reverse KL of the next-token distributions, whose
    sum over t is the sequence's reverse KL estimate. 0 at padding (``m = 0``).

    Shapes: every argument ``(B, T)``; returns ``(B, T)`` float32.

    Reference: Gu et al. 2024, MiniLLM, arXiv 2306.08543; Agarwal et al. 2024, GKD, arXiv 2306.13649.
    """
    _check_same_shape(student_logprobs=student_logprobs, teacher_logprobs=teacher_logprobs, action_mask=action_mask)
    d = (student_logprobs - teacher_logprobs).float()
    return torch.where(_bool_mask(action_mask), d, torch.zeros_like(d))


def distillation_token_rewards(student_logprobs: Tensor, teacher_logprobs: Tensor, action_mask: Tensor) -> Tensor:
    """Each sampled token's reward, the negative reverse KL.

    Formula: ``r_{b,t} = -kl_{b,t} = m_{b,t} * (log pi_T - log pi_S)``
    (:func:`reverse_kl_per_token`). Positive where the teacher likes the token more than the student does.

    Shapes: every argument ``(B, T)``; returns ``(B, T)`` float32, detached.

    Reference: Agarwal et al. 2024, GKD, arXiv 2306.13649 (on-policy, reverse KL on student samples).
    """
    return -reverse_kl_per_token(student_logprobs, teacher_logprobs, action_mask).detach()


def topk_forward_kl(student_logprobs: Tensor, teacher_topk_logprobs: Tensor) -> Tensor:
    """Offline distillation's loss at each position: the forward KL from the teacher's top-k, renormalised,
    to the student.

    Formula, with ``t_k`` the teacher's log-probs of its k most likely tokens and ``s_k`` the student's
    (full-vocabulary) log-probs of the same tokens: ``q_k = softmax(t)_k`` (the top-k renormalised) and
    ``KL(q || p_S) = sum_k q_k (log q_k - s_k)``. q is 0 outside the top-k, so this is the KL of q to the
    student's whole distribution: it is 0 exactly when the student puts the teacher's renormalised
    top-k probabilities on those tokens (and so nothing elsewhere).

    Shapes: ``student_logprobs``, ``teacher_topk_logprobs`` ``(..., K)``; returns ``(...)`` float32.

    Reference: Hinton et al. 2015, arXiv 1503.02531 (distillation on the teacher's distribution);
    sparse top-k targets as in Agarwal et al. 2024, arXiv 2306.13649 (GKD, the supervised case).
    """
    _check_same_shape(student_logprobs=student_logprobs, teacher_topk_logprobs=teacher_topk_logprobs)
    log_q = torch.log_softmax(teacher_topk_logprobs.float(), dim=-1)
    return (log_q.exp() * (log_q - student_logprobs.float())).sum(-1)
