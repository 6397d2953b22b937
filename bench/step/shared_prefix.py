"""Benchmark: the shared-prompt forward (engines/train/shared_prefix.py) against the plain one, on a device.

    .venv/bin/python bench/step/shared_prefix.py                          # CPU: issue 14's model, fp32
    python3 bench/step/shared_prefix.py --device cuda --model gpu-small   # a GPU: the 0.48B model, bf16

The work: one micro-batch of an RL step, `--groups` prompts of `--prompt-tokens` random tokens with
`--samples` responses of `--new-tokens` each (the layout a round's experience has), through
`objectives.response_logprobs`: the actor's training pass (forward and backward of the log-probs'
sum) and the reference's (forward, no gradients). "shared" runs each prompt once and the responses on
its cache; "plain" is the same batch without `prompt_index`, where the planner shares nothing. The two
alternate call by call after a warm-up, the GPU synchronised around each; printed: median ms of each
and plain / shared (above 1: sharing pays on this device, at this shape).
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    from measure import micro_batch_args, random_rollouts  # bench/step/measure.py, beside this script
    from rl_step import bench_policy  # bench/step/rl_step.py

    p = argparse.ArgumentParser()
    micro_batch_args(p)
    p.add_argument("--new-tokens", type=int, nargs="+", default=[32, 128])
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()

    import torch

    from engines.rl.experience import from_rollouts
    from engines.train import shared_prefix
    from engines.train.objectives import response_logprobs

    # The bench decides where sharing pays: here it runs on this device whatever PAYS_ON says (on a GPU,
    # left as it is, "shared" would take the plain path too and read 1.00x).
    shared_prefix.PAYS_ON = (args.device,)
    model, shape, dtype = bench_policy(args)
    vocab = model.config.vocab_size
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    print(f"model {shape}, {dtype} on {args.device}; {args.groups} prompts x {args.samples} samples, prompts of "
          f"{args.prompt_tokens} tokens; median of {args.repeats}, alternating")
    print(f"{'new tokens':>10} {'pass':>10} {'shared ms':>10} {'plain ms':>10} {'plain/shared':>13}")
    for new in args.new_tokens:
        rollouts = random_rollouts(vocab, args, new, seed=new)
        shared = {k: v.to(args.device) for k, v in from_rollouts(rollouts, 0).tensors().items()
                  if isinstance(v, torch.Tensor)}
        plain = {k: v for k, v in shared.items() if k != "prompt_index"}

        def train(batch):
            model.train()
            response_logprobs(model, batch).sum().backward()
            model.zero_grad(set_to_none=True)

        @torch.no_grad()
        def reference(batch):
            model.eval()
            response_logprobs(model, batch)

        for name, fn in (("train", train), ("reference", reference)):
            times = {"shared": [], "plain": []}
            for i in range(args.repeats + 1):
                for label, batch in (("shared", shared), ("plain", plain)):
                    sync()
                    start = time.perf_counter()
                    fn(batch)
                    sync()
                    if i:  # the first of each: warm-up
                        times[label].append(time.perf_counter() - start)
            s, pl = (statistics.median(times[k]) * 1e3 for k in ("shared", "plain"))
            print(f"{new:>10} {name:>10} {s:10.1f} {pl:10.1f} {pl / s:12.2f}x", flush=True)


if __name__ == "__main__":
    main()
