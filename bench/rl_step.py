"""Benchmark: RL step phases on the tiny model, and vLLM vs HF `generate`.

    .venv/bin/python bench/rl_step.py [--steps 8] [--hidden-size 128] [--layers 2]

Prints (1) the vLLM engine's generation throughput against Hugging Face
`generate` on the same model, prompts and token counts (fixed-length
outputs), measured alternately in one run and reported as a ratio of
medians; (2) the time per phase of PPO steps (generate, score, reference,
old logprobs, critic, train, weight sync) and rollout tokens/s, averaged over the steps
after the first (which includes engine warm-up).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import ray


def throughput(actor, prompt_ids, sampling) -> float:
    t0 = time.perf_counter()
    rollouts = ray.get(actor.generate.remote(prompt_ids, sampling))
    return sum(len(r.token_ids) for r in rollouts) / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from alignflow.cluster import ray_init_kwargs
    from alignflow.config import InfraConfig, RoundConfig, SyntheticTaskConfig, TinyModelConfig
    from alignflow.data import synthetic
    from engines import batches, models
    from engines.rl import RLRound
    from engines.rollout import Sampling, start_rollout_actor
    from engines.round_models import RoundSetup

    ray.init(**ray_init_kwargs(InfraConfig()))
    work = tempfile.mkdtemp(prefix="alignflow-bench-")
    tiny = TinyModelConfig(hidden_size=args.hidden_size, num_layers=args.layers,
                           intermediate_size=2 * args.hidden_size, max_position_embeddings=128)
    path = str(models.build_tiny_model(tiny, seed=0, out_dir=f"{work}/policy"))
    params = sum(p.numel() for p in models.load_policy(path).parameters())
    tok = models.load_tokenizer(path)
    data = synthetic.generate(SyntheticTaskConfig(num_sft=1, num_preference=1, num_eval=1, num_rl_prompts=256), seed=0)
    prompts, _ = batches.filter_prompts(tok, data["prompts"], 64, "prompts")
    max_len = 64 + args.new_tokens

    # 1. Generation throughput, vLLM vs HF, alternating.
    sampling = Sampling(n=args.samples, temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    ids = [p for p, _ in prompts[: args.prompts]]
    engines = {b: start_rollout_actor(b, path, max_model_len=max_len) for b in ("vllm", "hf")}
    for a in engines.values():
        throughput(a, ids[:4], sampling)  # warm-up (engine start, kernels)
    rates = {b: [] for b in engines}
    for _ in range(args.repeats):
        for b, a in engines.items():
            rates[b].append(throughput(a, ids, sampling))
    for a in engines.values():
        ray.kill(a)
    med = {b: statistics.median(r) for b, r in rates.items()}
    print(f"model: {params / 1e6:.2f}M parameters; {len(ids)} prompts x {args.samples} samples x {args.new_tokens} tokens")
    print(f"generation tokens/s  vllm {med['vllm']:.0f}  hf {med['hf']:.0f}  ratio vllm/hf {med['vllm'] / med['hf']:.2f}x"
          f"  (medians of {args.repeats}, alternating)")

    # 2. RL step phases (PPO with critic, reward model = the policy's backbone + head).
    cfg = RoundConfig(algorithm="ppo", steps=args.steps, prompts_per_step=32)
    rl = RLRound(cfg, RoundSetup(policy_path=path, reference_path=path, reward_path=path, prompts=prompts,
                                 dtype="float32", torch_threads=2, max_model_len=max_len, seed=0))
    try:
        steps = [rl.step(s).metrics for s in range(args.steps)]
    finally:
        rl.shutdown()
    warm = steps[1:] or steps
    phases = ["generate", "score", "reference", "old_logprobs", "critic", "train", "sync"]
    means = {p: statistics.mean(s[f"time/{p}"] for s in warm) for p in phases}
    total = sum(means.values())
    print(f"PPO step ({cfg.prompts_per_step} prompts x {cfg.generation.num_samples} samples), mean of {len(warm)} warm steps:")
    for p in phases:
        print(f"  {p:<10} {means[p] * 1000:8.1f} ms  {100 * means[p] / total:5.1f}%")
    print(f"  {'total':<10} {total * 1000:8.1f} ms")
    print(f"rollout tokens/s (in RL steps): {statistics.mean(s['tokens_per_s'] for s in warm):.0f}")


if __name__ == "__main__":
    main()
