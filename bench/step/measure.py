"""What the benchmarks measure besides time: the machine's matmul peak, a model's FLOPs, CPU times."""

from __future__ import annotations

import time
from collections import defaultdict


def matmul_peak_gflops(threads: int, n: int = 1024, repeats: int = 20) -> float:
    """The best fp32 GFLOP/s of an n x n matmul on `threads` threads (what a phase could reach)."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def forward_flops(config, tokens: float, logit_positions: float, attended: float) -> float:
    """Model FLOPs of a forward: 2 x (linear weights, output layer excluded) per token, the output
    layer at the positions whose logits are used, and attention (QK^T and AV) over `attended`
    (query, key) pairs. Counted as useful work: logits computed elsewhere do not count."""
    h, layers = config.hidden_size, config.num_hidden_layers
    kv = h // config.num_attention_heads * config.num_key_value_heads
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * config.intermediate_size  # q, o, k, v, MLP
    return 2 * per_layer * layers * tokens + 2 * h * config.vocab_size * logit_positions + 4 * h * layers * attended


def cpu_times() -> dict[int, tuple[float, float]]:
    """(user, system) CPU seconds of this process and each of its descendants (Ray's workers), by pid."""
    import psutil

    out = {}
    me = psutil.Process()
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            out[p.pid] = (t.user + t.children_user, t.system + t.children_system)
        except psutil.Error:
            pass
    return out


def scored_work(batch: dict) -> tuple[float, float]:
    """(tokens, attended (query, key) pairs) that scoring or training this batch runs: every row's
    tokens, or, where engines/train/shared_prefix.py shares the prompts, each group's prompt once (but
    its last token) and each row's remainder."""
    try:
        from engines.train import shared_prefix
    except ImportError:  # a tree compared against (--against) from before shared prompts
        shared_prefix = None

    lengths = batch["attention_mask"].sum(-1).float()
    pairs = lengths * (lengths + 1) / 2
    plan = shared_prefix.plan(batch) if shared_prefix else None
    if plan is None:
        return float(lengths.sum()), float(pairs.sum())
    q = plan.prefix_len.float()
    q_rows = q[plan.row_group]
    return (float(lengths.sum() - q_rows.sum() + q.sum()),
            float(pairs.sum() - (q_rows * (q_rows + 1) / 2).sum() + (q * (q + 1) / 2).sum()))


def synchronized(cuda: bool) -> float:
    """time.perf_counter() once the GPU (where `cuda`) has finished what was queued."""
    if cuda:
        import torch

        torch.cuda.synchronize()
    return time.perf_counter()


def peak_tflops(device: str) -> float:
    """The best matmul rate this device reached in this run, TFLOP/s: bf16 on a GPU, fp32 on 2 CPU threads."""
    if device != "cuda":
        return matmul_peak_gflops(2) / 1e3
    import torch

    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    best = float("inf")
    for _ in range(20):
        start = synchronized(True)
        a @ b
        best = min(best, synchronized(True) - start)
    return 2 * 8192**3 / best / 1e12


def count_ray_calls() -> dict[str, int]:
    """Every actor call this process makes from now on, counted by method name (the round's driver: what
    crosses a process boundary each step)."""
    import ray.actor

    calls: dict[str, int] = defaultdict(int)
    remote = ray.actor.ActorMethod._remote

    def counted(self, *a, **k):
        calls[self._method_name] += 1
        return remote(self, *a, **k)
    ray.actor.ActorMethod._remote = counted
    return calls


def micro_batch_args(p) -> None:
    """The arguments of a bench on one RL micro-batch (bench/step/shared_prefix.py, bench/step/launches.py): the device,
    the model, and `--groups` prompts of `--prompt-tokens` random tokens with `--samples` responses each."""
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", default=None, help="issue14 (CPU default), 30m, gpu-small (GPU default) or a directory")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=26)


def random_rollouts(vocab: int, args, new_tokens: int, seed: int) -> list:
    """`args.groups` prompts of random tokens, each with `args.samples` random responses of `new_tokens`, their
    log-probs drawn in (-1, 0]: the layout a round's experience has."""
    import torch

    from engines.rollout.base import Rollout

    gen = torch.Generator().manual_seed(seed)
    rollouts = []
    for g in range(args.groups):
        prompt = torch.randint(3, vocab, (args.prompt_tokens,), generator=gen).tolist()
        rollouts += [Rollout(g, prompt, torch.randint(3, vocab, (new_tokens,), generator=gen).tolist(), "",
                             (-torch.rand(new_tokens, generator=gen)).tolist(), False) for _ in range(args.samples)]
    return rollouts
