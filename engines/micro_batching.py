"""A training step's rows, in micro-batches: how many rows a forward takes (a row cap, a token budget), each
micro-batch cut to its own rows' widths, and a function run over a batch micro-batch by micro-batch.

Tensors are right-padded (engines/batches.py): a supervised split to its longest row, an RL step to its
longest sequence and response. Cutting a micro-batch to what its rows use changes the work, not the
objective: the objectives read masked positions only.
"""

from __future__ import annotations

from typing import Any

import torch

from engines.batches import split_pairs, take


def micro_batch_rows(n_rows: int, width: int, size: int | None, tokens: int | None, *, paired: bool = False) -> int:
    """Rows (pairs when `paired`) per micro-batch: at most `size`, and at most `tokens` padded tokens
    (rows x width, both halves of a pair counted), at least one; None for either: no such cap."""
    per_row = width * (2 if paired else 1)
    caps = [n_rows] + ([size] if size is not None else []) + ([tokens // per_row] if tokens is not None else [])
    return max(1, min(caps))


def micro_batches(batch: dict[str, torch.Tensor], size: int | None, *, tokens: int | None = None,
                  paired: bool = False, trim: bool = False) -> list[dict[str, torch.Tensor]]:
    """A worker's share cut into micro-batches of `micro_batch_rows` rows (pairs when `paired`: the
    chosen and rejected halves are cut alike, so each micro-batch is again [chosen..., rejected...]).
    A share that fits is the share itself. The last micro-batch may be smaller. `trim` (training, whose
    micro-batches are never joined again): each cut to its own longest row (`trimmed`)."""
    n = batch["input_ids"].shape[0] // (2 if paired else 1)
    per = micro_batch_rows(n, batch["input_ids"].shape[1], size, tokens, paired=paired)
    parts = [batch] if n <= per else [split_pairs(batch, idx, n) if paired else take(batch, idx)
                                      for idx in (torch.arange(i, min(i + per, n)) for i in range(0, n, per))]
    return [trimmed(p) for p in parts] if trim else parts


# Tensors laid out along a sequence's positions, by the mask whose width measures them and how much shorter
# than it they are (the next-token layout: one): the rows (input_ids', a process reward model's step marks
# and labels among them) and KTO's mismatched `kl_` rows. A
# teacher's top-k is one column per response token (objectives.loss_columns): column j holds a position at
# or past j, so the next-token layout's cut never drops one whose position is kept. An RL batch's tensors
# per response token (B, T, ...) are measured by its action_mask. A batch holding a tensor of any other
# layout is left as it is.
_POSITIONAL = {"attention_mask": {"input_ids": 0, "attention_mask": 0, "loss_mask": 0, "step_mask": 0, "step_labels": 0,
                                  "teacher_ids": 1, "teacher_logprobs": 1, "teacher_positions": 1},
               "kl_attention_mask": {"kl_input_ids": 0, "kl_attention_mask": 0, "kl_loss_mask": 0}}
_MEASURES = (*_POSITIONAL, "action_mask")


def used_width(mask: torch.Tensor) -> int:
    """One past the last column any row uses (a nonzero entry; 0: none)."""
    return int(((mask != 0) * torch.arange(1, mask.shape[1] + 1, device=mask.device)).max()) if mask.numel() else 0


def trimmed(batch: dict[str, Any], widths: dict[str, int] | None = None) -> dict[str, Any]:
    """A right-padded batch with each group of tensors cut to the width its rows use (`used_width` of its
    measuring mask, or `widths[mask]` where wider): positions to the attention mask's, an RL batch's tensors
    per response token to its action_mask's. Supervised data is padded to the longest row of a whole split,
    an RL step's to its longest sequence and response: every forward would run at that width. The objectives
    read masked positions only (a response token's position, response_index, is below the attended width),
    so they do not depend on the padding, only the work does."""
    wide = {k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() >= 2}
    per_token = wide - {k for keys in _POSITIONAL.values() for k in keys}
    if "attention_mask" not in batch or (per_token and (
            "action_mask" not in batch or any(batch[k].shape[1] != batch["action_mask"].shape[1] for k in per_token))):
        return batch
    if used_width(batch["attention_mask"]) == 0:  # no attended position (no row): nothing to cut by
        return batch
    groups = {m: keys for m, keys in _POSITIONAL.items() if m in batch}
    groups |= {"action_mask": dict.fromkeys(per_token, 0)} if per_token else {}
    cut = {}
    for mask, keys in groups.items():
        width = max((widths or {}).get(mask, 0), used_width(batch[mask]), 1)
        if width < batch[mask].shape[1]:
            cut |= {k: batch[k][:, : width - offset] for k, offset in keys.items() if k in wide}
    return {**batch, **cut} if cut else batch


def step_micro_batches(shards: list[dict[str, Any]], size: int | None, *, tokens: int | None = None,
                       paired: bool = False) -> list[list[dict[str, Any]]]:
    """Each rank's shard of one training step in trimmed `micro_batches`, the shards first cut to their common
    widths: a token budget counts the step's rows, not the split's longest, and every rank gets as many
    micro-batches (ZeRO's collectives run once per micro-batch on each)."""
    widths = {m: max((used_width(s[m]) for s in shards if m in s), default=0) for m in _MEASURES}
    return [micro_batches(trimmed(s, widths), size, tokens=tokens, paired=paired, trim=True) for s in shards]


def in_micro_batches(batch: dict[str, Any], size: int | None, fn, *, tokens: int | None = None) -> Any:
    """`fn(batch)` over micro-batches (`micro_batches`), results concatenated along rows (tensors whose
    first dimension is the batch's rows; micro-batches share the batch's padded width). A batch that
    fits: one call, its result as it is."""
    parts = micro_batches(batch, size, tokens=tokens)
    if len(parts) == 1:
        return fn(batch)
    outs = [fn(p) for p in parts]
    if not all(isinstance(o, torch.Tensor) for o in outs):
        raise TypeError("in micro-batches, a function must return a tensor with one row per batch row")
    return torch.cat(outs, 0)
