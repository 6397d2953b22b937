"""Token log-probabilities and the supervised (SFT) loss.

Shapes: `logits` (B, L, V) from a causal LM over a full sequence
`input_ids` (B, L). The token at position t is predicted by the logits at
t-1, so per-token quantities are (B, L-1), aligned with `input_ids[:, 1:]`.
"""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(labels_t | logits_t) for each position.

    logp_t = logits_t[labels_t] / τ − logsumexp(logits_t / τ)

    logits: (B, T, V); labels: (B, T) long → (B, T) float32.
    Computed in float32 with logsumexp, so it is exact for any vocabulary
    size and stable for large logits. Temperature τ matches the sampler's
    (vLLM reports logprobs of the temperature-scaled distribution only when
    asked; rollouts here use τ as configured).
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def shifted_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Next-token logprobs of a sequence: (B, L, V), (B, L) → (B, L-1)."""
    return token_logprobs(logits[:, :-1], input_ids[:, 1:], temperature)


def sft_loss(logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood averaged over response tokens of the batch.

    L = − Σ_{b,t} m_{b,t} · logp_{b,t} / Σ_{b,t} m_{b,t}

    logprobs, loss_mask: (B, T), mask 1 on response tokens (prompt and
    padding are 0). A batch with no response token gives 0, not NaN.
    (Standard maximum-likelihood fine-tuning, e.g. Ouyang et al. 2022,
    arXiv 2203.02155, with the loss restricted to the response.)
    """
    mask = loss_mask.to(logprobs.dtype)
    return -(logprobs * mask).sum() / mask.sum().clamp(min=1.0)
