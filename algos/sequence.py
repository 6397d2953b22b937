"""Token log-probabilities, the supervised (SFT) losses and NEFTune's embedding noise.

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


def dft_loss(logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Dynamic Fine-Tuning: each response token's NLL weighted by its own probability, held constant.

    L = − Σ_{b,t} m_{b,t} · sg(p_{b,t}) · logp_{b,t} / Σ_{b,t} m_{b,t},  p = exp(logp)

    Its gradient is −sg(p) ∇logp = −∇p: SFT's gradient, which the paper reads as a policy gradient whose
    implicit reward 1/p blows up on the tokens the model finds unlikely, with that reward taken out. The
    value is not an NLL: per token −p log p lies in [0, 1/e], below the NLL −log p.

    logprobs, loss_mask: (B, T), mask 1 on response tokens. A batch with no response token gives 0.
    (Wu et al. 2025, "On the Generalization of SFT: A Reinforcement Learning Perspective with Reward
    Rectification", arXiv 2508.05629.)
    """
    mask = loss_mask.to(logprobs.dtype)
    weight = torch.exp(logprobs.detach().float()).to(logprobs.dtype)
    return -(weight * logprobs * mask).sum() / mask.sum().clamp(min=1.0)


SFT_LOSSES = {"nll": sft_loss, "dft": dft_loss}


def neftune_noise(embeds: torch.Tensor, lengths: torch.Tensor, alpha: float,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """NEFTune: input embeddings plus uniform noise scaled down by the sequence's size.

    e'_{b,t} = e_{b,t} + U(−1, 1) · α / sqrt(n_{b,t} · d)

    with d the embedding width and n_{b,t} the number of tokens in the sequence position (b, t) belongs to
    (its own sample's, in a row packed with several); no noise where n is 0 (padding). The draw is
    float32 from `generator` (None: torch's global one), on the embeddings' device.

    embeds: (B, L, d); lengths: (B, L) → (B, L, d) in embeds' dtype.
    (Jain et al. 2023, "NEFTune: Noisy Embeddings Improve Instruction Finetuning", arXiv 2310.05914,
    Algorithm 1.)
    """
    if alpha <= 0:
        raise ValueError(f"NEFTune's alpha must be > 0, got {alpha}")
    n = lengths.to(torch.float32).unsqueeze(-1)
    scale = torch.where(n > 0, alpha / torch.sqrt(n.clamp(min=1.0) * embeds.shape[-1]), torch.zeros_like(n))
    noise = torch.rand(embeds.shape, generator=generator, device=embeds.device, dtype=torch.float32) * 2 - 1
    return (embeds.float() + noise * scale).to(embeds.dtype)
