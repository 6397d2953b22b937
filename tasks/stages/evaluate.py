"""Held-out evaluation of policies and of the reward model.

Policy metrics (the same names for base, SFT and every RL round, so MLflow
compares them side by side):
  eval/accuracy         share of sampled responses the task checker accepts
  eval/reward           mean reward-model score of the sampled responses (when the
                        pipeline trains a reward model)
  eval/response_length  mean response length in tokens
  eval/kl_to_reference  mean over responses of Σ_t (log π − log π_ref), both at the sampling temperature;
                        log π the engines' where they sample the whole distribution, else (top_p < 1,
                        whose engine log-probs are of the renormalised nucleus, log π − log Z ≥ log π) the
                        policy's own, from one more forward
  eval/pass_at_<k>      unbiased pass@k for k = 1..num_samples; eval/majority_accuracy (tasks/stages/eval_metrics.py)
Reward-model metrics: eval/rm_pairwise_accuracy on held-out pairs, and per score-gap bin of
`evaluation.rm_margin_bins` eval/rm_accuracy_margin_<lo>_<hi> and eval/rm_count_margin_<lo>_<hi>.
Process-reward-model metrics, on the held-out step-labelled solutions:
  eval/prm_step_accuracy         share of steps whose score's sign is their label (positive: still right)
  eval/prm_positive_fraction     share of steps labelled right: the step accuracy of a model that says "right"
  eval/prm_solution_accuracy     share of solutions whose weakest step's sign says whether every step is right
  eval/prm_first_error_accuracy  share of solutions whose first step scored wrong is their first wrong step
                                 (or none is, where none is): ProcessBench's measure
  (solutions whose every step lies past the response limit are left out of the last two, and counted:
  eval/prm_solutions_without_steps)
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from alignflow.store.artifacts import ArtifactRef
from alignflow.cluster import ensure_ray
from alignflow.config import EvalConfig, Placement
from alignflow.records import StageResult
from algos import first_error_steps, solution_scores
from engines import batches, models, steps
from engines.rollout.agentic import episode_prompts
from engines.rollout.episodes import episode_metrics, report_failures
from engines.rl import experience
from alignflow.config.loading import load_callable
from engines.rl.scoring import scoring
from engines.rollout.base import Sampling
from tasks.stages import eval_engine
from tasks.context import RunContext, StageOutput, compute_stage
from tasks.stages.data import load_split, token_limits
from tasks.stages.eval_metrics import answer_votes, margin_metrics, sample_metrics
from tasks.plan import PlannedStage
from tasks.registry import (PolicyEvalInputs, PolicyEvalStage, ProcessRewardModelEvalInputs,
                            ProcessRewardModelEvalStage, RewardModelEvalInputs, RewardModelEvalStage)


def load_checker(path: str) -> Callable[[str, str], bool]:
    """`module:function` -> the task checker; a clear error naming the config field."""
    return load_callable(path, "evaluation.checker")


def _score(p: Placement, micro_batch_size: int | None, io, ctx: RunContext, batch: dict, *,
           reference: ArtifactRef | None, reward: ArtifactRef | None,
           temperature: float) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(reference logprobs (B, T) at `temperature`, the sampler's as the engines' log-probs are, and reward
    scores (B,)) of a batch, each None when its model is.

    On `evaluation.scorer_placement`: with GPUs, a ScorerActor holding them; without, the same class
    in this task's process (a CPU-only actor would only add a process start, ~10-40 s on 2 cores).
    """
    with _scorer(p, micro_batch_size, io, ctx, reference, reward) as call:
        return (call("ref_logprobs", batch, temperature) if reference else None,
                call("rewards", batch) if reward else None)


def _scorer(p: Placement, micro_batch_size: int | None, io, ctx: RunContext, reference: ArtifactRef | None,
            reward: ArtifactRef | None, process: ArtifactRef | None = None):
    """`scoring`'s block (engines/rl/scoring.py) for an evaluation: its models on `p`, in micro-batches."""
    return scoring(reference, reward, num_cpus=p.num_cpus, num_gpus=p.num_gpus, resources=p.resources,
                   cpu_cores=p.cpu_cores, dtype=io.dtype, torch_threads=ctx.infra.torch_threads,
                   attn_implementation=io.attn_implementation, micro_batch_size=micro_batch_size,
                   process_path=process)


def _sampling(cfg: EvalConfig) -> Sampling:
    g = cfg.generation
    return Sampling(n=g.num_samples, temperature=g.temperature, top_p=g.top_p, max_new_tokens=g.max_new_tokens)


def evaluate_policy(stage: PlannedStage, inputs: PolicyEvalInputs, ctx: RunContext) -> StageResult:
    stage_cfg: PolicyEvalStage = stage.config
    cfg, io, name = stage_cfg.evaluation, stage_cfg.io, stage.name.removeprefix("eval_")

    def compute(output: StageOutput, run) -> dict[str, float]:
        checker = load_checker(cfg.checker)
        vote_on = load_callable(cfg.vote_on, "evaluation.vote_on") if cfg.vote_on else None
        policy_dir = ctx.tokenizer_dir(inputs.policy)  # the engine fetches the weights on its node
        tokenizer = models.load_tokenizer(policy_dir)
        records = load_split(inputs.data, ctx, "eval")[: cfg.num_prompts]
        limits = token_limits(inputs.data)
        env = cfg.environment  # an episode's tokens after its prompt: its turns and observations
        render, schemas = episode_prompts(tokenizer, env, records) if env else (None, 0)
        prompt_limit, model_len = limits.for_generation(
            env.max_episode_tokens if env else cfg.generation.max_new_tokens, policy_dir, "evaluation.",
            "environment.max_episode_tokens" if env else "generation.max_new_tokens", schemas)
        kept, report = batches.filter_prompts(tokenizer, records, prompt_limit, "eval", render)
        prompt_ids = [ids for ids, _ in kept]

        ensure_ray(ctx.infra)
        episodes = None if cfg.environment is None else ([r for _, r in kept], cfg.environment)
        rollouts, where = eval_engine.generate(stage.name, cfg.generation, ctx, ctx.ref(inputs.policy), prompt_ids,
                                               _sampling(cfg), seed=stage_cfg.seed, dtype=io.dtype,
                                               max_model_len=model_len, attn_implementation=io.attn_implementation,
                                               episodes=episodes)
        run.set_tag("alignflow.engine_process", where)
        report_failures(rollouts, stage.name)

        correct = [bool(r.episode["success"]) if episodes else
                   bool(checker(r.text, kept[r.prompt_index][1].get("answer"))) for r in rollouts]
        batch = experience.from_rollouts(rollouts, tokenizer.pad_token_id).tensors()
        ref, rewards = _score(cfg.scorer_placement, cfg.micro_batch_size, io, ctx, batch,
                              reference=ctx.ref(inputs.reference), reward=ctx.ref(inputs.reward),
                              temperature=cfg.generation.logprob_temperature)
        scores: list[float | None] = rewards.tolist() if rewards is not None else [None] * len(rollouts)
        sampled = batch["action_mask"]  # an episode's observations are not the policy's: not in its KL
        nucleus = cfg.generation.top_p < 1 and cfg.generation.temperature > 0  # greedy: top_p is not applied
        policy = batch["rollout_logprobs"] if not nucleus else _score(
            cfg.scorer_placement, cfg.micro_batch_size, io, ctx, batch, reference=ctx.ref(inputs.policy),
            reward=None, temperature=cfg.generation.logprob_temperature)[0]
        kls = ((policy - ref) * sampled).sum(-1).tolist()
        n = len(rollouts)
        metrics = {
            "eval/accuracy": sum(correct) / n,
            **({"eval/reward": sum(scores) / n} if inputs.reward is not None else {}),
            "eval/response_length": sampled.sum().item() / n,
            **episode_metrics(rollouts, "eval"),
            "eval/kl_to_reference": sum(kls) / n,
            "eval/finished_fraction": sum(r.finished for r in rollouts) / n,
            **sample_metrics([r.prompt_index for r in rollouts],
                             answer_votes(vote_on, [r.text for r in rollouts], str(cfg.vote_on)), correct,
                             num_prompts=len(kept), num_samples=cfg.generation.num_samples),
            **report.as_metrics("eval"),
        }
        run.log_metrics(metrics)
        samples = [
            {"prompt": tokenizer.decode(r.prompt_ids), "response": r.text, "answer": kept[r.prompt_index][1].get("answer"),
             "correct": c, "reward": s,
             **({"transcript": tokenizer.decode(r.prompt_ids + r.token_ids), "episode": r.episode}
                if r.episode else {})}
            for r, c, s in list(zip(rollouts, correct, scores))[: cfg.num_logged_samples]
        ]
        run.log_dict(samples, f"samples/{name}.json")
        (output.dir / "metrics.json").write_text(json.dumps(metrics, indent=1))
        (output.dir / "samples.json").write_text(json.dumps(samples, indent=1))
        return metrics

    return compute_stage(ctx, stage, compute)


def evaluate_reward_model(stage: PlannedStage, inputs: RewardModelEvalInputs, ctx: RunContext) -> StageResult:
    cfg: RewardModelEvalStage = stage.config
    io = cfg.io

    def compute(output: StageOutput, run) -> dict[str, float]:
        records = load_split(inputs.data, ctx, "eval_preference")
        limits = token_limits(inputs.data)
        tensors, report = batches.pair_tensors(models.load_tokenizer(ctx.tokenizer_dir(inputs.reward)), records,
                                               limits.prompt, limits.response)
        ensure_ray(ctx.infra)
        _, rewards = _score(cfg.scorer_placement, cfg.scoring_micro_batch_size, io, ctx, tensors, reference=None,
                            reward=ctx.ref(inputs.reward), temperature=1.0)
        scores = rewards.tolist()
        n = len(scores) // 2
        metrics = {"eval/rm_pairwise_accuracy": sum(c > r for c, r in zip(scores[:n], scores[n:])) / n,
                   "eval/rm_margin": sum(c - r for c, r in zip(scores[:n], scores[n:])) / n,
                   **margin_metrics(scores[:n], scores[n:], cfg.rm_margin_bins),
                   **report.as_metrics("eval_preference")}
        run.log_metrics(metrics)
        (output.dir / "metrics.json").write_text(json.dumps(metrics, indent=1))
        return metrics

    return compute_stage(ctx, stage, compute)


def evaluate_process_reward_model(stage: PlannedStage, inputs: ProcessRewardModelEvalInputs,
                                  ctx: RunContext) -> StageResult:
    cfg: ProcessRewardModelEvalStage = stage.config
    io = cfg.io

    def compute(output: StageOutput, run) -> dict[str, float]:
        records = load_split(inputs.data, ctx, "eval_process")
        limits = token_limits(inputs.data)
        tokenizer = models.load_tokenizer(ctx.tokenizer_dir(inputs.process_reward))
        tensors, report = steps.stepwise_tensors(tokenizer, records, limits.prompt, limits.response,
                                                 split="eval_process")
        ensure_ray(ctx.infra)
        with _scorer(cfg.scorer_placement, cfg.scoring_micro_batch_size, io, ctx, None, None,
                     ctx.ref(inputs.process_reward)) as call:
            scores = call("step_rewards", tensors)
        mask, labels = tensors["step_mask"] > 0, tensors["step_labels"] >= 0.5
        said, scored = scores > 0, mask.any(-1)  # solutions of no step (every step cut) are judged on nothing
        solved = (labels | ~mask).all(-1)
        right = (solution_scores(scores, mask, "min") > 0) == solved
        found = first_error_steps(said, mask) == first_error_steps(labels, mask)
        metrics = {"eval/prm_step_accuracy": float((said == labels)[mask].float().mean()),
                   "eval/prm_solution_accuracy": float(right[scored].float().mean()),
                   "eval/prm_first_error_accuracy": float(found[scored].float().mean()),
                   "eval/prm_positive_fraction": float(labels[mask].float().mean()),  # always "right" scores this
                   "eval/prm_steps": float(mask.sum()), "eval/prm_solutions_without_steps": float((~scored).sum()),
                   **report.as_metrics("eval_process")}
        run.log_metrics(metrics)
        (output.dir / "metrics.json").write_text(json.dumps(metrics, indent=1))
        return metrics

    return compute_stage(ctx, stage, compute)
