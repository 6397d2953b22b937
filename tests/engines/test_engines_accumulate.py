"""A step over micro-batches and ranks: loss scales and metrics that add up to the whole batch's."""

from __future__ import annotations

import pytest
import torch

from engines.accumulate import add_metrics, combine_ranks, host_metrics, loss_scales


def test_loss_scales_are_each_micro_batchs_share_of_the_whole_times_the_ranks():
    # 2 ranks: micro-batches of 3 and 1 tokens on rank 0, 4 and 0 on rank 1.
    parts = [[{"t": 3}, {"t": 1}], [{"t": 4}, {"t": 0}]]
    scales = loss_scales(parts, lambda m: m["t"])
    assert scales == [[2 * 3 / 8, 2 * 1 / 8], [2 * 4 / 8, 0.0]]
    # DeepSpeed averages the ranks' sums: the weights of the whole batch's mean.
    losses = [[5.0, 7.0], [1.0, 0.0]]
    per_rank = [sum(s * x for s, x in zip(ss, ls)) for ss, ls in zip(scales, losses)]
    assert sum(per_rank) / 2 == pytest.approx((3 * 5 + 1 * 7 + 4 * 1) / 8)
    assert loss_scales([[{"t": 0}], [{"t": 0}]], lambda m: m["t"]) == [[0.0], [0.0]]  # nothing to weigh


def test_metrics_combine_by_loss_scale_and_pairs_exactly():
    # Rank 0: micro-batches of scale 0.5 and 1.0; rank 1: one of scale 0.5 (2 ranks: scales sum to 2).
    ranks = []
    for micro in ([(0.5, {"loss": 2.0, "kl": (3.0, 1)}), (1.0, {"loss": 4.0, "kl": (5.0, 3)})],
                  [(0.5, {"loss": 6.0, "kl": (0.0, 0)})]):
        sums = {}
        for scale, metrics in micro:
            add_metrics(sums, metrics, scale)
        ranks.append(sums)
    assert ranks[0] == {"loss": 0.5 * 2.0 + 1.0 * 4.0, "kl": (8.0, 4.0)}
    out = combine_ranks(ranks)
    assert out["loss"] == pytest.approx((0.5 * 2 + 1.0 * 4 + 0.5 * 6) / 2)  # the weighted mean, weights 1/4, 1/2, 1/4
    assert out["kl"] == pytest.approx(8.0 / 4)  # every row once, whatever the scales
    assert combine_ranks([{"kl": (0.0, 0.0)}]) == {"kl": 0.0}


def test_metrics_left_on_the_device_are_summed_there_and_read_once_per_step():
    """An objective may return 0-dim tensors (a GPU's, unread): add_metrics sums them as tensors, detached, and
    host_metrics gives the same floats as numbers would have, pairs as pairs."""
    loss = torch.tensor(2.0, requires_grad=True) * 1.0
    as_tensors, as_numbers = {}, {}
    for scale, values in ((0.5, (2.0, 3.0, 1.0)), (1.0, (4.0, 5.0, 3.0))):
        add_metrics(as_tensors, {"loss": loss * values[0] / 2, "kl": (torch.tensor(values[1]), torch.tensor(values[2])),
                                 "rows": (1.0, 2.0)}, scale)
        add_metrics(as_numbers, {"loss": values[0], "kl": (values[1], values[2]), "rows": (1.0, 2.0)}, scale)
    assert isinstance(as_tensors["loss"], torch.Tensor) and not as_tensors["loss"].requires_grad
    read = host_metrics(as_tensors)
    assert read == as_numbers == {"loss": 0.5 * 2.0 + 1.0 * 4.0, "kl": (8.0, 4.0), "rows": (2.0, 4.0)}
    assert all(isinstance(x, float) for v in read.values() for x in (v if isinstance(v, tuple) else (v,)))
