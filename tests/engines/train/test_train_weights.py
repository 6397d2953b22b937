"""A step taken in micro-batches on several ranks is the whole batch's step.

The policy objective (clipped surrogate, entropy bonus, k3 KL loss) on rollouts of
different response lengths, for each loss aggregation: the whole batch's gradient
against the sum of the micro-batches' gradients, each loss times its
`engines.accumulate.loss_scales` factor and the ranks averaged as DeepSpeed averages
them. In process, on the tiny model; the same arithmetic runs in the trainer
(tests/engines/train/test_train_memory.py checks it through DeepSpeed).
"""

from __future__ import annotations

import functools

import pytest
import torch

AGGS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]


@pytest.fixture(scope="module")
def model(tiny_model):
    from engines.models import load_policy

    return load_policy(tiny_model).eval()


@pytest.fixture(scope="module")
def batch():
    """Eight rollouts of 1-6 response tokens, with advantages, old, reference and rollout log-probs."""
    from engines.rl.experience import from_rollouts
    from engines.rollout.base import Rollout

    g = torch.Generator().manual_seed(0)
    lengths = [6, 1, 4, 2, 5, 1, 3, 6]
    rollouts = [Rollout(i, torch.randint(3, 60, (3 + i % 3,), generator=g).tolist(),
                        torch.randint(3, 60, (n,), generator=g).tolist(), "", [0.0] * n, True)
                for i, n in enumerate(lengths)]
    tensors = from_rollouts(rollouts, pad_id=0).tensors()
    mask = tensors["action_mask"]
    assert mask.sum(-1).tolist() == lengths
    noise = lambda scale: scale * torch.randn(mask.shape, generator=g) * mask  # noqa: E731
    old = -2.0 + noise(0.3)
    return {**tensors, "advantages": noise(1.0), "old_logprobs": old, "ref_logprobs": old + noise(0.2),
            "rollout_logprobs": old + noise(0.1)}


def _objective(agg):
    from engines.train import objectives

    return functools.partial(objectives.policy_objective, clip_low=0.2, clip_high=0.28, dual_clip=3.0, agg=agg,
                             entropy_coef=0.01, kl_loss_coef=0.1, kl_estimator="k3", kl_clamp=10.0, tis_cap=None)


def _grads(model, losses_and_scales) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    for loss, scale in losses_and_scales:
        (loss * scale).backward()
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _stepped(model, batch, objective, weigh, ranks: int, rows: int) -> dict[str, torch.Tensor]:
    """The gradient DeepSpeed would apply: per rank the scaled micro-batch losses accumulated, then the
    ranks' gradients averaged."""
    from engines.accumulate import loss_scales
    from engines.batches import shard
    from engines.micro_batching import micro_batches

    parts = [micro_batches(s, rows) for s in shard(batch, ranks)]
    scales = loss_scales(parts, weigh)
    grads = [_grads(model, [(objective(model, m)[0], s) for m, s in zip(micro, ss)])
             for micro, ss in zip(parts, scales)]
    return {n: sum(g[n] for g in grads) / ranks for n in grads[0]}


@pytest.mark.parametrize("agg", AGGS)
def test_micro_batches_and_ranks_give_the_whole_batch_gradient(model, batch, agg):
    from engines.train import objectives

    objective = _objective(agg)
    whole = _grads(model, [(objective(model, batch)[0], 1.0)])
    weigh = functools.partial(objectives.aggregated, agg=agg)
    for ranks, rows in ((1, 3), (2, 2), (2, 1)):
        split = _stepped(model, batch, objective, weigh, ranks, rows)
        for name, g in whole.items():  # fp32 sums in another order: atol relative to the gradient's scale
            torch.testing.assert_close(split[name], g, rtol=1e-4, atol=1e-5 * g.abs().max().item(),
                                       msg=lambda m: f"{ranks} ranks, {rows} rows, {name}: {m}")
    if agg == "token_mean":  # weighed by rows, micro-batches of 7, 6, 6 and 9 tokens count alike
        by_rows = _stepped(model, batch, objective, objectives.per_row, 2, 2)
        assert max(((by_rows[n] - g).abs().max() / g.abs().max()).item() for n, g in whole.items()) > 1e-2


def test_dr_grpo_scale_is_the_generation_budget_not_the_batch_width(model, batch):
    """Dr. GRPO divides each row's token sum by a constant: with one given, the loss does not follow the
    step's longest response (the batch's padded width); without, it does, as T / (T + k)."""
    T = batch["action_mask"].shape[1]
    wider = {k: torch.cat([v, torch.zeros(v.shape[0], 4, dtype=v.dtype)], 1) if v.shape[1:] == (T,) else v
             for k, v in batch.items()}  # 4 more response columns, all masked
    objective = _objective("seq_mean_token_sum_norm")
    given = [objective(model, b, loss_scale_constant=16.0)[0].item() for b in (batch, wider)]
    assert given[1] == pytest.approx(given[0], rel=1e-6)
    default = [objective(model, b)[0].item() for b in (batch, wider)]
    assert default[1] == pytest.approx(default[0] * T / (T + 4), rel=1e-5)
    assert given[0] == pytest.approx(default[0] * T / 16, rel=1e-5)


@pytest.mark.parametrize("agg", AGGS)
def test_metrics_over_micro_batches_and_ranks_are_the_whole_batchs(model, batch, agg):
    """The loss terms combine by the loss scales; the row mean (sequence_kl) and the token means the
    objective reports as (sum, count) combine exactly, whatever the aggregation. TIS masks tokens whose
    rollout ratio leaves [0.9, 1.1], so clip_fraction and the TIS metrics differ between micro-batches."""
    from engines.accumulate import add_metrics, combine_ranks, host_metrics, loss_scales
    from engines.batches import shard
    from engines.micro_batching import micro_batches
    from engines.train import objectives

    objective = functools.partial(_objective(agg), tis_cap=1.1, tis_low=0.9, tis_mode="mask")
    with torch.no_grad():
        _, whole = objective(model, batch)
        parts = [micro_batches(s, 1) for s in shard(batch, 2)]
        ranks = []
        for micro, scales in zip(parts, loss_scales(parts, functools.partial(objectives.aggregated, agg=agg))):
            sums = {}
            for m, scale in zip(micro, scales):
                add_metrics(sums, objective(model, m)[1], scale)
            ranks.append(host_metrics(sums))  # as a worker's train_step returns them
    combined = combine_ranks(ranks)
    exact = ["policy_loss", "kl_loss", "sequence_kl", "entropy", "kl_to_reference", "clip_fraction", "approx_kl",
             "tis_weight_mean", "tis_masked_fraction"]
    for k in exact:
        value = whole[k][0] / whole[k][1] if isinstance(whole[k], tuple) else whole[k]
        assert combined[k] == pytest.approx(float(value), rel=1e-5), k
    # The row mean by hand: each row's summed k1 (log-prob difference to the reference), over the 8 rows.
    with torch.no_grad():
        from engines.train.objectives import response_logprobs

        k1 = ((response_logprobs(model, batch) - batch["ref_logprobs"]) * batch["action_mask"]).sum(-1)
    assert combined["sequence_kl"] == pytest.approx(k1.mean().item(), rel=1e-5)


FP16_NORM = """
import json, torch, deepspeed
deepspeed.init_distributed("gloo")
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from engines.train.worker import reported_norm_scale
torch.manual_seed(0)
layer = torch.nn.Linear(4, 3).half()
opt = FP16_UnfusedOptimizer(torch.optim.AdamW(layer.parameters(), lr=1e-3), dynamic_loss_scale=True,
                            dynamic_loss_args={"init_scale": 2 ** 8, "scale_window": 1000, "min_scale": 1,
                                               "delayed_shift": 1, "consecutive_hysteresis": False})
opt.backward(layer(torch.randn(2, 4).half()).float().pow(2).mean())
true = float(torch.cat([p.grad.float().flatten() for p in layer.parameters()]).norm()) / 2 ** 8
scale = reported_norm_scale(opt)
opt.step()
print(json.dumps({"reported": opt._global_grad_norm, "scale": scale, "true": true,
                  "plain": reported_norm_scale(torch.optim.AdamW(layer.parameters()))}))
"""


def test_an_fp16_step_at_zero_0_logs_the_norm_of_the_unscaled_gradients(tmp_path):
    """DeepSpeed's FP16_UnfusedOptimizer (fp16, ZeRO-0, torch's AdamW: the trainer's GPU fp16 setup) reports the
    norm of the loss-scaled gradients; the worker divides by the scale they carried. One process group of one
    (gloo), in a process of its own."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from alignflow.net import free_port

    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    out = subprocess.run([sys.executable, "-c", FP16_NORM], capture_output=True, text=True, timeout=300, env=env,
                         cwd=Path(__file__).resolve().parents[3])
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["scale"] == 256.0 and got["plain"] == 1.0
    assert got["reported"] == pytest.approx(got["true"] * 256, rel=1e-3)  # what DeepSpeed reports
    assert got["reported"] / got["scale"] == pytest.approx(got["true"], rel=1e-3)  # what the worker logs
