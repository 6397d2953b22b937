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


# Tensors laid out along a sequence's positions, by how much shorter than input_ids' width (the next-token
# layout: one). A batch holding another tensor of two or more dimensions is left as it is. A teacher's top-k
# is one column per response token (objectives.loss_columns): column j holds a position at or past j, so
# the next-token layout's cut never drops one whose position is kept.
_POSITIONAL = {"input_ids": 0, "attention_mask": 0, "loss_mask": 0,
               "teacher_ids": 1, "teacher_logprobs": 1, "teacher_positions": 1}


def attended_width(batch: dict[str, Any]) -> int:
    """One past the last attended position of any row (0: none)."""
    mask = batch["attention_mask"]
    return int((mask * torch.arange(1, mask.shape[1] + 1)).max()) if mask.numel() else 0


def response_width(batch: dict[str, Any]) -> int:
    """One past the last response column any row trains on (`action_mask`; 0: none, or no action_mask)."""
    mask = batch.get("action_mask")
    return int(((mask != 0) * torch.arange(1, mask.shape[1] + 1)).max()) if mask is not None and mask.numel() else 0


def trimmed(batch: dict[str, Any], width: int | None = None, columns: int | None = None) -> dict[str, Any]:
    """A right-padded batch cut to `width` positions (at least its `attended_width`) and, an RL batch, its
    per-response-token tensors (B, T, ...: action_mask's T) to `columns` (at least its `response_width`).
    Supervised data is padded to the longest row of a whole split, an RL step's to its longest sequence and
    response: every forward would run at that width. The objectives read masked positions only (a response
    token's position, response_index, is below the attended width), so they do not depend on the padding,
    only the work does. A batch holding a tensor of another layout is left as it is."""
    wide = {k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() >= 2}
    per_token = wide - _POSITIONAL.keys()
    if "attention_mask" not in batch or (per_token and (
            "action_mask" not in batch or any(batch[k].shape[1] != batch["action_mask"].shape[1] for k in per_token))):
        return batch
    width = attended_width(batch) if width is None else max(width, attended_width(batch))
    if width == 0:  # no attended position (no row): nothing to cut by
        return batch
    cut = {k: v[:, : width - _POSITIONAL[k]] for k, v in batch.items()
           if k in wide - per_token and width < batch["attention_mask"].shape[1]}
    if per_token:
        cols = max(columns or 0, response_width(batch), 1)
        if cols < batch["action_mask"].shape[1]:
            cut |= {k: batch[k][:, :cols] for k in per_token}
    return {**batch, **cut} if cut else batch


def step_micro_batches(shards: list[dict[str, Any]], size: int | None, *, tokens: int | None = None,
                       paired: bool = False) -> list[list[dict[str, Any]]]:
    """Each rank's shard of one training step in trimmed `micro_batches`, the shards first cut to their common
    attended width: a token budget counts the step's rows, not the split's longest, and every rank gets as
    many micro-batches (ZeRO's collectives run once per micro-batch on each)."""
    width = max((attended_width(s) for s in shards if "attention_mask" in s), default=0)
    columns = max((response_width(s) for s in shards), default=0)
    return [micro_batches(trimmed(s, width, columns), size, tokens=tokens, paired=paired, trim=True) for s in shards]


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
