"""Held-out evaluation of policies and of the reward model.

Policy metrics (the same names for base, SFT and every RL round, so MLflow
compares them side by side):
  eval/accuracy         share of sampled responses the task checker accepts
  eval/reward           mean reward-model score of the sampled responses (when the
                        pipeline trains a reward model)
  eval/response_length  mean response length in tokens
  eval/kl_to_reference  mean over responses of Σ_t (log π − log π_ref)
Reward-model metric: eval/rm_pairwise_accuracy on held-out pairs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import ray

from alignflow.cluster import ensure_ray
from alignflow.config import EvalConfig
from alignflow.records import StageResult
from engines import batches, models
from engines.rewards import load_callable
from engines.rollout import Sampling, start_rollout_actor
from engines.scoring import RewardScorer, SequenceLogprober
from tasks.context import RunContext, compute_stage
from tasks.data import load_split
from tasks.plan import PlannedStage
from tasks.registry import PolicyEvalInputs, PolicyEvalStage, RewardModelEvalInputs, RewardModelEvalStage


def load_checker(path: str) -> Callable[[str, str], bool]:
    """`module:function` -> the task checker; a clear error naming the config field."""
    return load_callable(path, "evaluation.checker")


def _sampling(cfg: EvalConfig) -> Sampling:
    g = cfg.generation
    return Sampling(n=g.num_samples, temperature=g.temperature, top_p=g.top_p, max_new_tokens=g.max_new_tokens)


def evaluate_policy(stage: PlannedStage, inputs: PolicyEvalInputs, ctx: RunContext) -> StageResult:
    stage_cfg: PolicyEvalStage = stage.config
    cfg, io, name = stage_cfg.evaluation, stage_cfg.io, stage.name.removeprefix("eval_")
    storage = ctx.storage()

    def compute(out: Path, run, uri: str) -> dict[str, float]:
        checker = load_checker(cfg.checker)
        policy_path = str(storage.fetch(inputs.policy.uri))
        tokenizer = models.load_tokenizer(policy_path)
        records = load_split(inputs.data, ctx, "eval")[: cfg.num_prompts]
        kept, report = batches.filter_prompts(tokenizer, records, io.max_prompt_tokens, "eval")
        prompt_ids = [ids for ids, _ in kept]

        ensure_ray(ctx.infra)
        actor = start_rollout_actor(cfg.generation.backend, policy_path, dtype=io.dtype,
                                    seed=stage_cfg.seed, torch_threads=ctx.infra.torch_threads,
                                    max_model_len=io.max_prompt_tokens + cfg.generation.max_new_tokens,
                                    num_cpus=cfg.generation.placement.num_cpus,
                                    num_gpus=cfg.generation.placement.num_gpus)
        try:
            rollouts = ray.get(actor.generate.remote(prompt_ids, _sampling(cfg)))
        finally:
            ray.kill(actor)

        correct = [bool(checker(r.text, kept[r.prompt_index][1].get("answer") or "")) for r in rollouts]
        scores: list[float | None] = [None] * len(rollouts)
        if inputs.reward is not None:
            scores = RewardScorer(str(storage.fetch(inputs.reward.uri)), io.dtype).score(
                [r.prompt_ids + r.token_ids for r in rollouts])
        ref_lp = SequenceLogprober(str(storage.fetch(inputs.reference.uri)), io.dtype).response_logprobs(
            [r.prompt_ids for r in rollouts], [r.token_ids for r in rollouts])
        kls = [sum(r.logprobs) - sum(ref) for r, ref in zip(rollouts, ref_lp)]
        n = len(rollouts)
        metrics = {
            "eval/accuracy": sum(correct) / n,
            **({"eval/reward": sum(scores) / n} if inputs.reward is not None else {}),
            "eval/response_length": sum(len(r.token_ids) for r in rollouts) / n,
            "eval/kl_to_reference": sum(kls) / n,
            "eval/finished_fraction": sum(r.finished for r in rollouts) / n,
            **report.as_metrics("eval"),
        }
        run.log_metrics(metrics)
        samples = [
            {"prompt": tokenizer.decode(r.prompt_ids), "response": r.text, "answer": kept[r.prompt_index][1].get("answer"),
             "correct": c, "reward": s}
            for r, c, s in list(zip(rollouts, correct, scores))[: cfg.num_logged_samples]
        ]
        run.log_dict(samples, f"samples/{name}.json")
        (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
        (out / "samples.json").write_text(json.dumps(samples, indent=1))
        return metrics

    return compute_stage(ctx, stage, compute)


def evaluate_reward_model(stage: PlannedStage, inputs: RewardModelEvalInputs, ctx: RunContext) -> StageResult:
    cfg: RewardModelEvalStage = stage.config
    io = cfg.io
    storage = ctx.storage()

    def compute(out: Path, run, uri: str) -> dict[str, float]:
        scorer = RewardScorer(str(storage.fetch(inputs.reward.uri)), io.dtype)
        records = load_split(inputs.data, ctx, "eval_preference")
        tensors, report = batches.pair_tensors(scorer.tokenizer, records, io.max_prompt_tokens,
                                               io.max_response_tokens)
        seqs = [row[mask.bool()].tolist() for row, mask in zip(tensors["input_ids"], tensors["attention_mask"])]
        scores = scorer.score(seqs)
        n = len(seqs) // 2
        metrics = {"eval/rm_pairwise_accuracy": sum(c > r for c, r in zip(scores[:n], scores[n:])) / n,
                   "eval/rm_margin": sum(c - r for c, r in zip(scores[:n], scores[n:])) / n,
                   **report.as_metrics("eval_preference")}
        run.log_metrics(metrics)
        (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
        return metrics

    return compute_stage(ctx, stage, compute)
