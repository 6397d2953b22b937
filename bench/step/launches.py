"""Benchmark: what one training micro-batch asks of the device, counted by the torch profiler.

    .venv/bin/python bench/step/launches.py                           # CPU: issue 14's model, fp32
    python3 bench/step/launches.py --device cuda --model gpu-small    # a GPU: the 0.48B model, bf16

The work is one GRPO micro-batch of an RL step (`--groups` prompts x `--samples` responses of
`--new-tokens`): forward, k3 KL in the loss against reference log-probs, TIS against the rollout
log-probs, backward. Two sides run it on the same model and batch, alternating:

- alignflow: `engines/train/objectives.policy_objective` as a trainer calls it (logits only at the
  response tokens; the shared-prompt forward where `shared_prefix.PAYS_ON` says it pays);
- plain: the textbook version every trainer starts from: the model's full logits, `log_softmax` over
  every position, the response's log-probs gathered, the same loss.

Counted per micro-batch:
- kernels: on a GPU the profiler's device kernels (each a launch); on the CPU, where there are none,
  the innermost aten ops that compute (`kernel_ops`: views, allocations and metadata left out), each
  of which a GPU runs as one kernel or more;
- host syncs: ops whose result the host must wait for (`.item()`, `nonzero`'s data-dependent size);
- and the median time of `--repeats` micro-batches, outside the profiler.
Printed: both sides and alignflow / plain.
"""

from __future__ import annotations

import argparse
import statistics
import time

SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero")  # the host waits for their result (.item(), a bool, nonzero)
# Ops that only make views, allocate or read metadata: no kernel on a GPU.
METADATA_OPS = frozenset(f"aten::{op}" for op in (
    "as_strided", "view", "_unsafe_view", "view_as", "reshape", "_reshape_alias", "expand", "expand_as", "t",
    "transpose", "permute", "slice", "select", "unsqueeze", "squeeze", "flatten", "unflatten", "narrow", "split",
    "split_with_sizes", "chunk", "unbind", "alias", "detach", "detach_", "lift_fresh", "resolve_conj",
    "resolve_neg", "result_type", "empty", "empty_strided", "empty_like", "resize_", "set_", "to", "_to_copy",
    "contiguous", "clone", "scalar_tensor", "item", "_local_scalar_dense", "is_nonzero", "size", "stride",
    "_has_compatible_shallow_copy_type", "numpy_T"))


def batch_of(model, args, device: str) -> dict:
    """One GRPO micro-batch of random rollouts (measure.random_rollouts), with advantages and reference
    log-probs, on `device`."""
    import torch

    from engines.rl.experience import from_rollouts
    from measure import random_rollouts  # bench/step/measure.py, beside this script

    exp = from_rollouts(random_rollouts(model.config.vocab_size, args, args.new_tokens, seed=0), 0)
    gen = torch.Generator().manual_seed(1)
    mask = exp.action_mask
    batch = {k: v for k, v in exp.tensors().items() if isinstance(v, torch.Tensor)}
    batch["advantages"] = torch.randn(mask.shape, generator=gen) * mask
    batch["ref_logprobs"] = (exp.rollout_logprobs - 0.1 * torch.rand(mask.shape, generator=gen)) * mask
    return {k: v.to(device) for k, v in batch.items()}


def alignflow_step(model, batch) -> None:
    from engines.train.objectives import policy_objective

    loss, _ = policy_objective(model, batch, clip_low=0.2, clip_high=0.2, dual_clip=None, agg="token_mean",
                               entropy_coef=0.0, kl_loss_coef=0.04, kl_estimator="k3", kl_clamp=10.0, tis_cap=2.0,
                               on_policy=True)
    loss.backward()


def alignflow_gpu_path(model, batch) -> None:
    """`alignflow_step` on the path a GPU takes: the plain forward (shared_prefix.PAYS_ON), run on this device."""
    from engines.train import shared_prefix

    pays, shared_prefix.PAYS_ON = shared_prefix.PAYS_ON, ()
    try:
        alignflow_step(model, batch)
    finally:
        shared_prefix.PAYS_ON = pays


def plain_step(model, batch) -> None:
    """Full logits, log-softmax everywhere, gather; ratio 1 on policy, clipped; k3 KL; token mean; TIS."""
    import torch

    ids, mask = batch["input_ids"], batch["action_mask"]
    logits = model(input_ids=ids, attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    all_logps = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    logps = all_logps.gather(1, batch["response_index"])  # response token t sits at response_index[t] + 1
    ratio = torch.exp(logps - logps.detach())
    adv = batch["advantages"]
    surrogate = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    weight = torch.exp(logps.detach() - batch["rollout_logprobs"]).clamp(max=2.0)
    delta = (batch["ref_logprobs"] - logps).clamp(-10, 10)
    kl = torch.exp(delta) - delta - 1
    loss = ((surrogate * weight + 0.04 * kl) * mask).sum() / mask.sum()
    loss.backward()


def counts(fn, model, batch, cuda: bool, repeats: int) -> tuple[float, float]:
    """(kernels, host syncs) per micro-batch over `repeats` profiled runs."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            fn(model, batch)
            model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    if cuda:
        kernels = sum(1 for e in events if e.device_type == DeviceType.CUDA)
    else:
        kernels = sum(map(kernel_ops, (e for e in events if e.cpu_parent is None)))
    syncs = sum(1 for e in events if e.name in SYNC_OPS)
    return kernels / repeats, syncs / repeats


def kernel_ops(event) -> int:
    """The aten ops under `event` (itself included) that compute (not METADATA_OPS) and call no other op that
    does: on the CPU, what a GPU would launch kernels for (a clone's or a copy's copy_ is counted once)."""
    below = sum(kernel_ops(c) for c in event.cpu_children)
    own = event.name.startswith("aten::") and event.name not in METADATA_OPS and not below
    return below + int(own)


def main() -> None:
    from measure import micro_batch_args  # bench/step/measure.py, beside this script
    from rl_step import bench_policy  # bench/step/rl_step.py

    p = argparse.ArgumentParser()
    micro_batch_args(p)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    import torch

    cuda = args.device == "cuda"
    model, shape, dtype = bench_policy(args)
    model.train()
    batch = batch_of(model, args, args.device)
    sides = {"alignflow": alignflow_step, "plain": plain_step}
    if not cuda:  # what a GPU would run, counted here
        sides = {"alignflow": alignflow_step, "alignflow, GPU path": alignflow_gpu_path, "plain": plain_step}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(args.repeats + 1):  # the first of each: warm-up
        for name, fn in sides.items():
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn(model, batch)
            if cuda:
                torch.cuda.synchronize()
            if i:
                times[name].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    counted = {name: counts(fn, model, batch, cuda, args.repeats) for name, fn in sides.items()}
    unit = "device kernels" if cuda else "compute ops (CPU)"
    print(f"model {shape}, {dtype} on {args.device}; one micro-batch of {args.groups} prompts x {args.samples} "
          f"samples, prompts of {args.prompt_tokens} tokens, {args.new_tokens} new tokens; training pass "
          f"(forward, loss, backward); {args.repeats} runs each, alternating; ratios to plain")
    print(f"{'':18}" + "".join(f"{name:>22}" for name in sides))
    rows = [(unit, {k: c[0] for k, c in counted.items()}), ("host syncs", {k: c[1] for k, c in counted.items()}),
            ("median ms", {k: statistics.median(t) * 1e3 for k, t in times.items()})]
    for label, values in rows:
        base = values["plain"]
        cells = [f"{v:10.1f}" + (f" ({v / base:5.2f}x)" if base and name != "plain" else " " * 9)
                 for name, v in values.items()]
        print(f"{label:18}" + "".join(f"{c:>22}" for c in cells))

if __name__ == "__main__":
    main()
