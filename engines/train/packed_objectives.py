"""Objectives over packed rows (engines/train/packing.py), equal to their unpacked counterparts.

Two layers:

  - on a packed batch (`pack_rows` / `pack_batch` output) with `n` samples: the response-token
    log-probabilities, the SFT loss, per-sample sequence log-probabilities (DPO, KTO) and per-sample
    last-token scores of a scalar-head model (reward model);
  - drop-ins taking the ordinary right-padded batch, packed on the fly within it, so shards,
    micro-batches, pair halves [chosen..., rejected...] and per-row side tensors (ref_logps) are
    untouched: `packed_causal_lm_objective` = objectives.causal_lm_objective,
    `packed_sequence_logps` = preference.sequence_logps, `packed_scalar_scores` =
    objectives.scalar_scores, `packed_pairwise_objective` = objectives.pairwise_objective.

A target token is predicted only from inside its own sample: positions where a sample starts
(position_ids 0) are never targets, as column 0 of a right-padded row never is.
"""

from __future__ import annotations

import torch
from torch import Tensor

from algos.losses.preference import pairwise_reward_loss
from algos.sequence import SFT_LOSSES, sft_loss
from engines.models import last_hidden
from engines.train.logits import embedding_noise, keep_last_logits, logprobs_from_hidden, output_head, unwrap
from engines.train.packing import PackStats, model_inputs, pack_batch


def packed_hidden(model, packed: dict[str, Tensor]) -> Tensor:
    """The last layer's (normed) hidden states of a packed batch: (P, W, H). The causal LM's output
    layer runs on one position only where the model supports it."""
    return last_hidden(model, **model_inputs(model, packed), **keep_last_logits(model))


def packed_token_logprobs(model, packed: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """log π(token | earlier tokens of its sample) at every loss_mask token that is not a sample's
    first: (K,) float32; the sample each belongs to and its position there: (K,) long each (so
    `engines.train.logits.scatter(logprobs, sample, position - 1, (B, L - 1))` is the unpacked layout)."""
    wanted = (packed["loss_mask"][:, 1:] > 0) & (packed["position_ids"][:, 1:] > 0)
    rows, cols = wanted.nonzero(as_tuple=True)
    hidden = packed_hidden(model, packed)[rows, cols]
    module = unwrap(model)
    logprobs, _ = logprobs_from_hidden(output_head(module), hidden, packed["input_ids"][rows, cols + 1],
                                       module.config.vocab_size)
    return logprobs, packed["sample_index"][rows, cols + 1], packed["position_ids"][rows, cols + 1]


def packed_sft_loss(model, packed: dict[str, Tensor], loss: str = "nll") -> tuple[Tensor, Tensor, int]:
    """SFT's `loss` (algos.sequence.SFT_LOSSES) over a packed batch, a token mean as algos.sequence.sft_loss's
    (Σ −log p / number of response tokens); its NLL (detached); and that number."""
    logprobs, _, _ = packed_token_logprobs(model, packed)
    flat, ones = logprobs.unsqueeze(0), torch.ones_like(logprobs).unsqueeze(0)
    return SFT_LOSSES[loss](flat, ones), sft_loss(flat.detach(), ones), int(logprobs.numel())


def packed_sample_logps(model, packed: dict[str, Tensor], n: int) -> Tensor:
    """Σ of each sample's response-token log-probabilities: (n,) float32, in source-row order."""
    logprobs, sample, _ = packed_token_logprobs(model, packed)
    return logprobs.new_zeros(n).index_add(0, sample, logprobs)


def last_token_positions(packed: dict[str, Tensor], n: int) -> Tensor:
    """Flat (P * W) index of each sample's last token, the one objectives.scalar_scores scores: (n,) long."""
    sample = packed["sample_index"].reshape(-1)
    real = sample >= 0
    flat = torch.arange(sample.numel(), device=sample.device)
    return torch.full((n,), -1, device=sample.device).scatter_reduce(0, sample[real], flat[real], "amax")


def packed_last_token_scores(model, packed: dict[str, Tensor], n: int) -> Tensor:
    """A scalar-head model's score of each sample at its last token: (n,) float32, source-row order.
    The head runs on the n scored hidden states only."""
    module = unwrap(model)
    hidden = packed_hidden(model, packed)
    at = last_token_positions(packed, n)
    return module.score(hidden.reshape(-1, hidden.shape[-1])[at]).squeeze(-1).float()


# ---- drop-ins on right-padded batches -------------------------------------------------------


def _pack(model, batch: dict[str, Tensor], max_tokens: int | None) -> tuple[dict[str, Tensor], PackStats]:
    pad = unwrap(model).config.pad_token_id
    return pack_batch(batch, max_tokens, pad_id=0 if pad is None else pad)


def packed_causal_lm_objective(model, batch: dict[str, Tensor], *, max_tokens: int | None = None, loss: str = "nll",
                               neftune_alpha: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """objectives.causal_lm_objective over the batch packed into rows of at most `max_tokens`
    (None: the batch's padded width): the same loss, noise and metrics, and how it packed (PackStats.as_metrics).
    NEFTune's scale takes each sample's own length, not its packed row's."""
    packed, stats = _pack(model, batch, max_tokens)
    with embedding_noise(model, neftune_alpha, packed):
        value, nll, tokens = packed_sft_loss(model, packed, loss)
    return value, {"loss": value.detach(), **({"nll": nll} if loss != "nll" else {}),
                   "response_length": (float(tokens), float(batch["input_ids"].shape[0])), **stats.as_metrics()}


def packed_sequence_logps_and_stats(model, batch: dict[str, Tensor], *,
                                    max_tokens: int | None = None) -> tuple[Tensor, PackStats]:
    """engines.train.preference.sequence_logps (Σ_t loss_mask_t · log π(token_t | tokens_<t)) packed: (B,);
    and how it packed."""
    packed, stats = _pack(model, batch, max_tokens)
    return packed_sample_logps(model, packed, batch["input_ids"].shape[0]), stats


def packed_sequence_logps(model, batch: dict[str, Tensor], *, max_tokens: int | None = None) -> Tensor:
    """`packed_sequence_logps_and_stats`' log-likelihoods: (B,)."""
    return packed_sequence_logps_and_stats(model, batch, max_tokens=max_tokens)[0]


def _packed_scores(model, batch: dict[str, Tensor], max_tokens: int | None) -> tuple[Tensor, PackStats]:
    packed, stats = _pack(model, batch, max_tokens)
    return packed_last_token_scores(model, packed, batch["input_ids"].shape[0]), stats


def packed_scalar_scores(model, batch: dict[str, Tensor], *, max_tokens: int | None = None) -> Tensor:
    """objectives.scalar_scores packed: (B,) float32."""
    return _packed_scores(model, batch, max_tokens)[0]


def packed_pairwise_objective(model, batch: dict[str, Tensor], margin: float = 0.0, *,
                              max_tokens: int | None = None) -> tuple[Tensor, dict[str, float]]:
    """objectives.pairwise_objective (Bradley-Terry on [chosen..., rejected...]) with packed scores; and
    how it packed."""
    scores, stats = _packed_scores(model, batch, max_tokens)
    n = scores.shape[0] // 2
    margins = torch.full((n,), margin, device=scores.device) if margin else None
    out = pairwise_reward_loss(scores[:n], scores[n:], margin=margins)
    return out.loss, {"loss": out.loss.detach(), "accuracy": out.accuracy.detach(),
                      "reward_margin": out.reward_margin.detach(), **stats.as_metrics()}
