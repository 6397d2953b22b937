"""Benchmark: RL step phases on the tiny model, and vLLM vs HF `generate`.

    .venv/bin/python bench/rl_step.py [--steps 8] [--hidden-size 128] [--layers 2]
    python3 bench/rl_step.py --config configs/gpu-small.yaml   # on a GPU: the config's model and round

Prints (1) the vLLM engine's generation throughput against Hugging Face
`generate` on the same model, prompts and token counts (fixed-length
outputs), measured alternately in one run and reported as a ratio of
medians; (2) the time per phase of PPO steps (generate, score, reference,
old logprobs, critic, train, weight sync) and rollout tokens/s, averaged over the steps
after the first (which includes engine warm-up), with the tokens per second
each phase processed (generated tokens for generate, whole sequences for
the forward and training phases). With --config, the model shape, dtype and
first round (placements, colocation, vLLM options) come from that pipeline
config, and part (1) is left out.
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
    parser.add_argument("--config", default=None, help="pipeline config: its model and first round")
    args = parser.parse_args()

    from alignflow.cluster import ray_init_kwargs
    from alignflow.config import InfraConfig, RoundConfig, SyntheticTaskConfig, TinyModelConfig, load_config
    from alignflow.data import synthetic
    from engines import batches, models
    from engines.rl import RLRound
    from engines.round_models import RoundSetup

    ray.init(**ray_init_kwargs(InfraConfig()))
    work = tempfile.mkdtemp(prefix="alignflow-bench-")
    pipeline = load_config(args.config) if args.config else None
    tiny = pipeline.model.tiny if pipeline else TinyModelConfig(
        hidden_size=args.hidden_size, num_layers=args.layers, intermediate_size=2 * args.hidden_size,
        max_position_embeddings=128)
    dtype = pipeline.model.dtype if pipeline else "float32"
    path = str(models.build_tiny_model(tiny, seed=0, out_dir=f"{work}/policy"))
    params = sum(p.numel() for p in models.load_policy(path).parameters())
    tok = models.load_tokenizer(path)
    data = synthetic.generate(SyntheticTaskConfig(num_sft=1, num_preference=1, num_eval=1, num_rl_prompts=256), seed=0)
    prompts, _ = batches.filter_prompts(tok, data["prompts"], 64, "prompts")
    max_len = 64 + args.new_tokens

    print(f"model: {params / 1e6:.2f}M parameters, {dtype}")
    if pipeline is None:
        generation_vllm_vs_hf(args, path, prompts, max_len)
    # 2. RL step phases (PPO with critic, reward model = the policy's backbone + head).
    cfg = (pipeline.rounds[0] if pipeline else RoundConfig(algorithm="ppo", prompts_per_step=32)).model_copy(
        update={"steps": args.steps})
    rl = RLRound(cfg, RoundSetup(policy_path=path, reference_path=path, reward_path=path, prompts=prompts,
                                 dtype=dtype, torch_threads=2, max_model_len=max_len, seed=0))
    try:
        steps = [rl.step(s) for s in range(args.steps)]
    finally:
        rl.shutdown()
    warm = steps[1:] or steps
    phases = ["generate", "score", "reference", "old_logprobs", "critic", "train", "sync"]
    means = {p: statistics.mean(s.metrics[f"time/{p}"] for s in warm) for p in phases}
    generated = statistics.mean(float(s.experience.action_mask.sum()) for s in warm)
    sequence = statistics.mean(float(s.experience.attention_mask.sum()) for s in warm)
    total = sum(means.values())
    print(f"{cfg.algorithm} step ({cfg.prompts_per_step} prompts x {cfg.generation.num_samples} samples), "
          f"mean of {len(warm)} warm steps:")
    for p in phases:
        tokens = generated if p == "generate" else sequence
        rate = f"{tokens / means[p]:10.0f} tokens/s" if means[p] > 1e-4 and p not in ("score", "sync") else ""
        print(f"  {p:<12} {means[p] * 1000:8.1f} ms  {100 * means[p] / total:5.1f}%  {rate}")
    print(f"  {'total':<12} {total * 1000:8.1f} ms")


def generation_vllm_vs_hf(args, path: str, prompts, max_len: int) -> None:
    """(1) vLLM against HF `generate`: fixed-length outputs, alternating, ratio of medians."""
    from engines.rollout import Sampling
    from engines.rollout_actors import start_rollout_actor

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
    print(f"{len(ids)} prompts x {args.samples} samples x {args.new_tokens} tokens")
    print(f"generation tokens/s  vllm {med['vllm']:.0f}  hf {med['hf']:.0f}  ratio vllm/hf {med['vllm'] / med['hf']:.2f}x"
          f"  (medians of {args.repeats}, alternating)")


if __name__ == "__main__":
    main()
