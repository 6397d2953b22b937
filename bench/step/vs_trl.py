"""Benchmark: an alignflow GRPO round against TRL's GRPOTrainer, on the same model and the same work.

    .venv/bin/python bench/step/vs_trl.py                                   # CPU: issue 14's 4.5M model, 32x8x32
    python3 bench/step/vs_trl.py --device cuda --model gpu-small            # a GPU: gpu-small's 0.48B model, bf16
    python3 bench/step/vs_trl.py --device cuda --model gpu-small --prompts 64 --new-tokens 128 --runs 1

TRL is an optional extra (`pip install -e '.[bench]'`), never a runtime dependency.

The work on both sides: `--prompts` texts of about `--prompt-tokens` tokens (the same texts through the
same tokenizer), `--samples` samples each of at most `--new-tokens` tokens at temperature 1, a rule
reward on the text, k3 KL in the loss (coefficient 0.04) against a frozen reference, learning rate
1e-5, one optimizer step per batch in micro-batches of `--micro-rows` rows, no gradient checkpointing;
bf16 on a GPU, fp32 on the CPU. TRL generates with transformers `generate`; alignflow with its rollout
backend (`--backend`: vLLM where it is installed, else HF generate). On a GPU alignflow colocates every
model on the one GPU (`colocate_all`), as TRL does; on the CPU it runs configs' defaults.

Each side runs in a process of its own, the sides alternating run by run; a run times `--steps` steps
after a warm-up step. Printed, medians over runs: each side's step and phases side by side and their
ratio, tokens generated, and training MFU (model FLOPs of a full forward and backward over every row,
the same count for both sides, over the train phase) against the bf16 (GPU) or fp32 (CPU) matmul peak
measured in the same run. alignflow's phases are its round's; TRL's are timed around its own methods
(`_generate`; `_get_per_token_logps_and_entropies` on the reference; the rest of
`_generate_and_score_completions` is scoring; the rest of the step is training), each boundary
synchronising the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from measure import count_ray_calls, forward_flops, peak_tflops, synchronized  # bench/step/measure.py, beside this script
from rl_step import model_name, model_named, word_corpus  # bench/step/rl_step.py

KL_COEF, LR = 0.04, 1e-5
ROWS = ["step", "generate", "reference", "score", "train", "weight update"]


def reward(prompt: str, response: str, answer: str | None) -> float:
    """The rule both sides score with (alignflow's rule signature): the share of 'e' in the response."""
    return response.count("e") / max(len(response), 1)


def trl_reward(completions, **_) -> list[float]:
    return [reward("", c, None) for c in completions]


def prompt_texts(model: str, n: int, tokens: int) -> list[str]:
    """n texts of `tokens` tokens each, as the model's tokenizer cuts and decodes them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return [tok.decode(tok(line)["input_ids"][:tokens]) for line in word_corpus(words=12 * n)[:n]]


def alignflow_worker(args, texts: list[str]) -> dict:
    """Timed steps of an alignflow GRPO round in this process (its own Ray)."""
    import ray

    from alignflow.cluster import ray_init_kwargs
    from alignflow.config import InfraConfig, RoundConfig
    from engines.models import load_tokenizer
    from engines.rl.round import RLRound
    from engines.rl.round_models import RoundSetup

    cuda = args.device == "cuda"
    ray.init(**ray_init_kwargs(InfraConfig()))
    tok = load_tokenizer(args.model)
    ids = [tok(t)["input_ids"] for t in texts]
    place = {"placement": {"num_cpus": 1, "num_gpus": 1}} if cuda else {}
    cfg = {"algorithm": "grpo", "prompts_per_step": args.prompts, "steps": args.steps + 1, "colocate_all": cuda,
           "reward": {"source": "rule", "rule": "vs_trl:reward"},
           "generation": {"backend": args.backend, "num_samples": args.samples, "max_new_tokens": args.new_tokens,
                          "temperature": 1.0, "vllm": {"gpu_memory_utilization": 0.3}, **place},
           "kl": {"coef": KL_COEF, "estimator": "k3", "apply_as": "loss"},
           "ppo": {"epochs": 1, "minibatch_size": args.prompts * args.samples},
           "actor": {"learning_rate": LR, "warmup_steps": 0, "micro_batch_size": args.micro_rows, **place},
           **({"scorer_placement": place["placement"]} if cuda else {})}
    for key, value in json.loads(args.set or "{}").items():  # --set, dotted keys
        *sections, last = key.split(".")
        node = cfg
        for s in sections:
            node = node.setdefault(s, {})
        node[last] = value
    rl = RLRound(RoundConfig.model_validate(cfg), RoundSetup(
        policy_path=args.model, reference_path=args.model, reward_path=None,
        prompts=[(i, {"prompt": t, "answer": None}) for i, t in zip(ids, texts)],
        dtype="bfloat16" if cuda else "float32", torch_threads=2,
        max_model_len=max(map(len, ids)) + args.new_tokens + 8, seed=0))
    calls = count_ray_calls()
    try:
        rl.step(0)
        calls.clear()
        steps = [rl.step(s).metrics for s in range(1, args.steps + 1)]
    finally:
        rl.shutdown()
        ray.shutdown()
    med = lambda k: statistics.median(m.get(k, 0.0) for m in steps)  # noqa: E731
    phases = {"generate": med("time/generate"), "reference": med("time/reference"),
              "score": med("time/score") + med("time/old_logprobs"), "train": med("time/train"),
              "weight update": med("time/sync")}
    moves = {k: med(k) for k in steps[-1] if k.startswith(("time/colocation/", "resident"))}
    return {"step": statistics.median(sum(v for k, v in m.items() if k.count("/") == 1 and k.startswith("time/"))
                                      for m in steps),
            "phases": phases, "moves": moves, "generated": med("response_length") * args.prompts * args.samples,
            "ray_calls": {k: v / args.steps for k, v in sorted(calls.items())}}


def trl_worker(args, texts: list[str]) -> dict:
    """Timed steps of TRL's GRPOTrainer in this process."""
    import datasets
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = args.device == "cuda"
    rows = args.prompts * args.samples
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="vs-trl-"), per_device_train_batch_size=args.micro_rows,
        gradient_accumulation_steps=rows // args.micro_rows, num_generations=args.samples,
        max_completion_length=args.new_tokens, temperature=1.0, top_k=0, beta=KL_COEF, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, max_steps=args.steps + 1, logging_steps=1, report_to="none",
        save_strategy="no", bf16=cuda, use_cpu=not cuda, gradient_checkpointing=False, seed=0, disable_tqdm=True,
        model_init_kwargs={"dtype": "bfloat16" if cuda else "float32", "attn_implementation": "sdpa"})
    data = datasets.Dataset.from_dict({"prompt": texts * (args.steps + 2)})
    trainer = GRPOTrainer(model=args.model, reward_funcs=trl_reward, args=config, train_dataset=data)
    times: dict[str, float] = defaultdict(float)

    def timed(name: str, phase: str, when=lambda *a, **k: True) -> None:
        fn = getattr(trainer, name)

        def wrapper(*a, **k):
            if not when(*a, **k):
                return fn(*a, **k)
            start = synchronized(cuda)
            try:
                return fn(*a, **k)
            finally:
                times[phase] += synchronized(cuda) - start
        setattr(trainer, name, wrapper)

    timed("_generate", "generate")
    timed("_get_per_token_logps_and_entropies", "reference", lambda model, *a, **k: model is trainer.ref_model)
    timed("_generate_and_score_completions", "generate_and_score")
    steps: list[dict] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            times.clear()
            times["start"] = synchronized(cuda)

        def on_step_end(self, *_, **__):
            step = synchronized(cuda) - times["start"]
            gas = times["generate_and_score"]
            steps.append({"step": step, "generate": times["generate"], "reference": times["reference"],
                          "score": gas - times["generate"] - times["reference"], "train": step - gas})

    generated = []
    trainer.add_callback(Clock())
    original = trainer._generate

    def counting(prompts):
        out = original(prompts)
        generated.append(sum(len(c) for c in out[1]))  # (prompt_ids, completion_ids, ...)
        return out
    trainer._generate = counting
    trainer.train()
    timed_steps = steps[1:]  # after the warm-up step
    med = lambda k: statistics.median(s[k] for s in timed_steps)  # noqa: E731
    return {"step": med("step"), "phases": {p: med(p) for p in ("generate", "reference", "score", "train")},
            "moves": {}, "generated": statistics.median(generated[1:])}


def run_side(side: str, args, texts_file: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", side, "--texts", texts_file, "--model", args.model,
           "--device", args.device, "--backend", args.backend, "--steps", str(args.steps),
           "--prompts", str(args.prompts), "--samples", str(args.samples), "--new-tokens", str(args.new_tokens),
           "--micro-rows", str(args.micro_rows)] + (["--set", args.set] if args.set else [])
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2],
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             filter(None, [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")]))})
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        raise SystemExit(f"{side}: the run failed (exit {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-6000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def train_flops(model: str, args) -> tuple[float, float]:
    """(FLOPs of one training pass, forward and backward, over every row in full; parameters, billions)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    rows, length = args.prompts * args.samples, args.prompt_tokens + args.new_tokens
    fwd = forward_flops(config, rows * length, rows * args.new_tokens, rows * length * (length + 1) / 2)
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = h // config.num_attention_heads * config.num_key_value_heads
    params = layers * (2 * h * h + 2 * h * kv + 3 * h * i) + h * config.vocab_size
    return 3 * fwd, params / 1e9


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", default=None, help="issue14 (4.5M, CPU default), 30m, gpu-small (0.48B, GPU default) "
                   "or a model directory")
    p.add_argument("--backend", default=None, help="alignflow's rollout backend: vllm (where installed) or hf")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=26)
    p.add_argument("--micro-rows", type=int, default=64, help="rows per forward/backward, both sides")
    p.add_argument("--steps", type=int, default=3, help="timed steps per run, after a warm-up step")
    p.add_argument("--runs", type=int, default=2, help="runs per side, the sides alternating")
    p.add_argument("--sides", default="alignflow,trl")
    p.add_argument("--set", default=None, help='alignflow round settings as JSON, e.g. {"actor.micro_batch_tokens": null}')
    p.add_argument("--worker", choices=["alignflow", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--texts", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.backend is None:
        import importlib.util
        args.backend = "vllm" if importlib.util.find_spec("vllm") else "hf"
    if args.worker:
        texts = json.loads(Path(args.texts).read_text())
        work = alignflow_worker if args.worker == "alignflow" else trl_worker
        print("RESULT " + json.dumps(work(args, texts)), flush=True)
        return
    if (args.prompts * args.samples) % args.micro_rows:
        raise SystemExit(f"--micro-rows {args.micro_rows} must divide prompts x samples "
                         f"({args.prompts * args.samples}): TRL accumulates whole micro-batches")
    shape = model_name(args)
    args.model = model_named(shape)
    built = None if Path(shape).is_dir() else args.model  # built for this run: removed after it
    texts = prompt_texts(args.model, args.prompts, args.prompt_tokens)
    texts_file = Path(tempfile.mkdtemp(prefix="vs-trl-")) / "texts.json"
    texts_file.write_text(json.dumps(texts))
    sides = args.sides.split(",")
    results: dict[str, list[dict]] = {s: [] for s in sides}
    for i in range(args.runs):
        for side in sides:
            try:  # a side that fails (or a limit that ends the bench) keeps what the runs before it measured
                results[side].append(run_side(side, args, str(texts_file)))
            except SystemExit as err:
                print(f"run {i + 1}/{args.runs} {side}: FAILED: {err}", flush=True)
                continue
            print(f"run {i + 1}/{args.runs} {side}: step {results[side][-1]['step']:.3f} s; "
                  f"{json.dumps(results[side][-1])}", flush=True)
    if not (results := {s: r for s, r in results.items() if r}):
        raise SystemExit("vs_trl: no side finished a run")
    report(args, shape, results, peak_tflops(args.device), *train_flops(args.model, args))
    if built:
        import shutil
        shutil.rmtree(built, ignore_errors=True)


def report(args, shape: str, results: dict[str, list[dict]], peak: float, flops: float, params_b: float) -> None:
    sides = list(results)
    med = {s: {"step": statistics.median(r["step"] for r in results[s]),
               **{p: statistics.median(r["phases"].get(p, 0.0) for r in results[s]) for p in ROWS[1:]},
               "generated": statistics.median(r["generated"] for r in results[s])} for s in sides}
    precision = "bf16" if args.device == "cuda" else "fp32"
    print(f"\nGRPO, {args.prompts} prompts x {args.samples} samples x {args.new_tokens} new tokens, micro-batches of "
          f"{args.micro_rows} rows; model {shape} ({params_b * 1e3:.1f}M parameters), {precision} on {args.device}; "
          f"alignflow's rollout backend {args.backend}; medians of {args.runs} runs x {args.steps} steps, alternating")
    print(f"{'':<16}" + "".join(f"{s:>12}" for s in sides) + ("       ratio" if len(sides) == 2 else ""))
    for row in ROWS:
        vals = [med[s][row] for s in sides]
        ratio = f"{vals[0] / vals[1]:11.2f}x" if len(sides) == 2 and vals[1] > 1e-4 else ""
        print(f"{row:<16}" + "".join(f"{v:11.3f}s" for v in vals) + ratio)
    gen = [med[s]["generated"] for s in sides]
    print(f"{'tokens generated':<16}" + "".join(f"{g:12.0f}" for g in gen))
    per_token = [med[s]["step"] / max(med[s]["generated"], 1) * 1e3 for s in sides]
    print(f"{'ms per token':<16}" + "".join(f"{t:12.3f}" for t in per_token)
          + (f"{per_token[0] / per_token[1]:11.2f}x" if len(sides) == 2 else ""))
    print(f"{'train MFU':<16}" + "".join(f"{100 * flops / max(med[s]['train'], 1e-9) / 1e12 / peak:11.1f}%"
                                         for s in sides) + f"   of {peak:.3g} TFLOP/s measured")
    for s in sides:
        if calls := results[s][0].get("ray_calls"):
            print(f"{s} Ray calls per step: {sum(calls.values()):.0f} (" + ", ".join(
                f"{k} {v:g}" for k, v in calls.items()) + ")")
        moves = {k: statistics.median(r["moves"].get(k, 0.0) for r in results[s]) for k in results[s][0]["moves"]}
        if moves:
            print(f"{s} colocation: " + ", ".join(f"{k.split('/')[-1]} {v:.3f}" for k, v in sorted(moves.items())))
        print(f"{s} runs: " + ", ".join(f"{r['step']:.3f}" for r in results[s]) + " s")


if __name__ == "__main__":
    main()
