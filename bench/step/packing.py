"""Benchmark: SFT forward + backward, packed rows against right-padded rows, side by side.

    .venv/bin/python bench/step/packing.py                        # sdpa, 32 samples of 8..256 tokens
    .venv/bin/python bench/step/packing.py --attn eager --wider 2 # eager attention, rows up to 2 x the longest

The work: a Qwen2-shape model (hidden 256, 4 layers, 4 heads, 2 KV heads, intermediate 1024,
vocabulary 2048, fp32, random weights) and `--samples` samples whose lengths are drawn uniformly
from [--min-len, --max-len] (a quarter prompt, the rest response, random tokens). One step is the
SFT loss's forward and backward over the whole batch:

  - unpacked: objectives.causal_lm_objective on the rows right-padded to the batch's longest;
  - packed:   packed_objectives.packed_causal_lm_objective, the same rows packed first-fit-decreasing
              into rows of at most `--wider` x the longest (a block-diagonal mask on the CPU).

The two alternate step by step (this machine is noisy: only numbers taken side by side compare),
after one warm-up step each. Printed: real tokens per second of each (the same real tokens: the
padding is not counted), from the median step time (and per second of this process's CPU time, which
other load on a shared machine disturbs less), the ratio packed / unpacked, each layout's share
of real tokens among the positions it computes, and the two losses (equal up to rounding).
"""

from __future__ import annotations

import argparse
import statistics
import time


def build(args):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(args.seed)
    config = Qwen2Config(vocab_size=2048, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=0,
                         max_position_embeddings=args.max_len, attn_implementation=args.attn)
    model = Qwen2ForCausalLM(config).float()
    assert model.config._attn_implementation == args.attn, model.config._attn_implementation
    return model


def data(args) -> dict:
    import torch

    from engines.batches import pad_right, right_padded

    gen = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.samples,), generator=gen).tolist()
    seqs = [torch.randint(8, 2048, (n,), generator=gen).tolist() for n in lengths]
    masks = [[0] * max(1, n // 4) + [1] * (n - max(1, n // 4)) for n in lengths]
    return {**right_padded(seqs, 0), "loss_mask": pad_right(masks, 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--wider", type=int, default=1, help="packed rows hold up to this many x the longest sample")
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each layout")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; 1 by default: on a small shared machine, threads that wait on each other "
                             "for a core another process holds make wall times swing by 3x")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch

    from engines.train.objectives import causal_lm_objective
    from engines.train.packed_objectives import packed_causal_lm_objective
    from engines.train.packing import pack_batch

    torch.set_num_threads(args.threads)
    model = build(args)
    batch = data(args)
    width = batch["input_ids"].shape[1]
    max_tokens = width * args.wider
    tokens = int(batch["attention_mask"].sum())
    packed_rows = pack_batch(batch, max_tokens)[0]["input_ids"]
    layouts = {
        "unpacked": causal_lm_objective,
        "packed": lambda m, b: packed_causal_lm_objective(m, b, max_tokens=max_tokens),
    }
    times: dict[str, list[float]] = {k: [] for k in layouts}
    cpu: dict[str, list[float]] = {k: [] for k in layouts}
    losses: dict[str, float] = {}

    def step(name: str) -> tuple[float, float]:
        model.zero_grad(set_to_none=True)
        t0, c0 = time.perf_counter(), time.process_time()
        loss, _ = layouts[name](model, batch)
        loss.backward()
        elapsed = time.perf_counter() - t0, time.process_time() - c0
        losses[name] = loss.item()
        return elapsed

    for name in layouts:  # warm-up
        step(name)
    for i in range(args.steps):
        order = list(layouts) if i % 2 == 0 else list(reversed(layouts))
        for name in order:
            wall, used = step(name)
            times[name].append(wall)
            cpu[name].append(used)

    slots = {"unpacked": batch["input_ids"].numel(), "packed": packed_rows.numel()}
    rate = {k: tokens / statistics.median(v) for k, v in times.items()}
    cpu_rate = {k: tokens / statistics.median(v) for k, v in cpu.items()}
    print(f"{args.samples} samples of {args.min_len}..{args.max_len} tokens, {tokens} real tokens; attn={args.attn}, "
          f"{args.threads} threads, {args.steps} timed steps each (alternating)")
    print(f"unpacked: {batch['input_ids'].shape[0]} rows x {width}; packed: {packed_rows.shape[0]} rows x "
          f"{packed_rows.shape[1]} (max_tokens {max_tokens})")
    for name in layouts:
        print(f"  {name:9s} median step {statistics.median(times[name]):7.3f} s   {rate[name]:7.0f} tokens/s   "
              f"({cpu_rate[name]:7.0f} per CPU-second)   real share of positions {tokens / slots[name]:.3f}   "
              f"loss {losses[name]:.6f}")
    print(f"tokens/s ratio packed/unpacked: {rate['packed'] / rate['unpacked']:.2f} "
          f"(per CPU-second, less sensitive to a busy machine: {cpu_rate['packed'] / cpu_rate['unpacked']:.2f})")


if __name__ == "__main__":
    main()
