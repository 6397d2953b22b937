"""One optimizer step over micro-batches and ranks, accumulated exactly.

Each micro-batch's loss is scaled by its share of what the objective
averages over (`loss_scales`), so the gradients accumulated over a rank's
micro-batches and averaged over the ranks (as DeepSpeed averages them) are
those of the objective on the whole batch at once. Metrics are summed the
same way (`add_metrics`), read from the device once per step
(`host_metrics`), and the ranks' sums combined (`combine_ranks`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def loss_scales(parts: list[list[dict[str, Any]]], weigh: Callable[[dict[str, Any]], float]) -> list[list[float]]:
    """Per rank, per micro-batch, the factor its loss is multiplied by before backward so that the
    accumulated, rank-averaged gradient is that of the objective on the whole batch at once.

    `parts[r]`: rank r's micro-batches. `weigh(micro)`: what the objective's loss averages over in
    it: its rows for a mean over rows or pairs, its response tokens for a token mean
    (algos.aggregate_weight). A micro-batch's scale is `R * w / sum(w)` over all ranks' micro-batches:
    its share of the whole, times the R ranks whose gradients DeepSpeed averages. Rows alone would
    be exact for row means only: a token mean would count a micro-batch of short responses like one
    of long ones. Nothing to weigh (a batch without a valid token) gives scales of 0.
    """
    weights = [[float(weigh(m)) for m in micro] for micro in parts]
    total = sum(map(sum, weights))
    return [[len(parts) * w / total if total else 0.0 for w in ws] for ws in weights]


def add_metrics(sums: dict[str, Any], metrics: dict[str, Any], scale: float) -> None:
    """One micro-batch's metrics into a rank's `sums`. A number counts by its loss's scale
    (`loss_scales`): right for the loss and for means over what the loss averages over. A mean over
    something else comes as a `(sum, count)` pair, added as it is, so the mean is exact whatever the
    micro-batches: a row mean (sequence_kl) weighed by tokens would follow their lengths.

    A value may be a 0-dim tensor, still on the device: it is added there, detached, and nothing waits
    for it until `host_metrics` reads the step's sums (one device-to-host sync per step, not one per
    metric and micro-batch)."""
    for k, v in metrics.items():
        if isinstance(v, tuple):
            total, count = sums.get(k, (0.0, 0.0))
            sums[k] = (total + _value(v[0]), count + _value(v[1]))
        else:
            sums[k] = sums.get(k, 0.0) + _value(v) * scale


def _value(v: Any) -> float | torch.Tensor:
    return v.detach().double() if isinstance(v, torch.Tensor) else float(v)  # sums as exact as Python floats


def host_metrics(sums: dict[str, Any]) -> dict[str, Any]:
    """`add_metrics`' sums as Python floats (pairs as pairs), the tensors among them read in one copy."""
    tensors = [v for value in sums.values() for v in (value if isinstance(value, tuple) else (value,))
               if isinstance(v, torch.Tensor)]
    read = iter(torch.stack([t.to(tensors[0].device) for t in tensors]).tolist() if tensors else [])

    def host(v):  # the tensors come back in the order they were stacked: this walk's
        return next(read) if isinstance(v, torch.Tensor) else v
    return {k: tuple(map(host, value)) if isinstance(value, tuple) else host(value) for k, value in sums.items()}


def combine_ranks(results: list[dict[str, Any]]) -> dict[str, float]:
    """The ranks' metrics (`add_metrics`) as one: numbers averaged over the ranks, as DeepSpeed averages
    their gradients; pairs summed over the ranks, then the sum divided by the count (0 for no count)."""
    out = {}
    for k, v in results[0].items():
        if isinstance(v, tuple):
            total, count = (sum(r[k][i] for r in results) for i in (0, 1))
            out[k] = total / count if count else 0.0
        else:
            out[k] = sum(r[k] for r in results) / len(results)
    return out
