"""Rollouts -> padded tensors for training (the Experience batch).

Layout (B rollouts, L = longest prompt+response, T = longest response):
    input_ids, attention_mask   (B, L)  prompt + response, right-padded
    response_index              (B, T)  position of response token t in the
                                        next-token (L-1) layout: P_b - 1 + t
    action_mask                 (B, T)  1 on real response tokens
    rollout_logprobs            (B, T)  the sampler's logprobs
Later filled in: old_logprobs, ref_logprobs, values, advantages, returns (B, T)
and rewards (B,).
"""

from __future__ import annotations

import torch

from engines.batches import right_padded
from engines.rollout import Rollout


def rollout_batch(rollouts: list[Rollout], pad_id: int) -> dict[str, torch.Tensor]:
    if not rollouts:
        raise ValueError("no rollouts to batch")
    T = max(1, max(len(r.token_ids) for r in rollouts))
    index = torch.zeros(len(rollouts), T, dtype=torch.long)
    mask = torch.zeros(len(rollouts), T)
    lps = torch.zeros(len(rollouts), T)
    for b, r in enumerate(rollouts):
        n = len(r.token_ids)
        index[b, :n] = torch.arange(len(r.prompt_ids) - 1, len(r.prompt_ids) - 1 + n)
        mask[b, :n] = 1.0
        lps[b, :n] = torch.tensor(r.logprobs, dtype=torch.float32)
    return {
        **right_padded([r.prompt_ids + r.token_ids for r in rollouts], pad_id),
        "response_index": index,
        "action_mask": mask,
        "rollout_logprobs": lps,
    }


def select(batch: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v[rows] for k, v in batch.items()}


def minibatches(n_rows: int, size: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Shuffled row indices in chunks of `size` (the remainder is dropped when more than one chunk)."""
    perm = torch.randperm(n_rows, generator=generator)
    if n_rows <= size:
        return [perm]
    return [perm[i : i + size] for i in range(0, n_rows - size + 1, size)]
