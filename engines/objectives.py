"""Objectives handed to the training engine: (model, batch) -> (loss, metrics).

The engine runs whatever objective it is given; these adapt model outputs to
the pure losses in `algos`. They are module-level functions (or partials of
them) so that Ray can ship them to the workers.
"""

from __future__ import annotations

import torch

from algos.preference import pairwise_reward_loss
from algos.sequence import shifted_logprobs, sft_loss


def causal_lm_objective(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    """SFT: NLL on response tokens only (loss_mask is over input_ids)."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    logprobs = shifted_logprobs(out.logits, batch["input_ids"])
    mask = batch["loss_mask"][:, 1:]
    loss = sft_loss(logprobs, mask)
    return loss, {"loss": loss.item(), "response_tokens": float(mask.sum())}


def scalar_scores(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sequence scores of a reward model / critic head at the last real token: (B,)."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return out.logits.squeeze(-1).float()


def pairwise_objective(model, batch: dict[str, torch.Tensor], margin: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Bradley-Terry on a batch whose first half is chosen, second half rejected."""
    scores = scalar_scores(model, batch)
    n = scores.shape[0] // 2
    margins = torch.full((n,), margin) if margin else None
    out = pairwise_reward_loss(scores[:n], scores[n:], margin=margins)
    return out.loss, {
        "loss": out.loss.item(),
        "accuracy": float(out.accuracy),
        "reward_margin": float(out.reward_margin),
    }
