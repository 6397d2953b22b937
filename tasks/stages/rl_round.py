"""rl_round: one RL round of any registered algorithm, as a stage.

The round's key covers its resolved config and the policy it starts from,
so rounds chain: round k+1 starts from round k's committed policy. Every
`checkpoint_every` steps the round's full state is committed as a mid-stage
checkpoint (tasks/checkpoints.py); a retried round resumes there.
"""

from __future__ import annotations

from alignflow.cluster import ensure_ray
from alignflow.errors import ConfigError
from alignflow.records import StageResult
from engines import batches, models
from engines.placement.groups import TIMEOUT_S as NODES_WAIT_S
from engines.rl.judge import round_judge_positions
from engines.rl.round import RLRound
from engines.rl.round_placement import RoundSetup
from engines.rollout.agentic import episode_prompts
from tasks.checkpoints import StageCheckpoints
from tasks.context import RunContext, StageOutput, compute_stage
from tasks.stages.data import load_split, token_limits
from tasks.plan import PlannedStage
from tasks.registry import RoundInputs, RoundStage


def rl_round(stage: PlannedStage, inputs: RoundInputs, ctx: RunContext) -> StageResult:
    cfg: RoundStage = stage.config
    round_cfg, io = cfg.round, cfg.io
    storage = ctx.storage()

    field = f"rounds.{int(stage.name.split('_')[1]) - 1}"  # round_k: its config's place

    def compute(out: StageOutput, run) -> dict[str, float]:
        policy_dir = ctx.tokenizer_dir(inputs.policy)  # the actors fetch the weights on their nodes
        tokenizer = models.load_tokenizer(policy_dir)
        limits = token_limits(inputs.data)
        env = round_cfg.environment  # an episode's tokens after its prompt: its turns and observations
        records = load_split(inputs.data, ctx, "prompts")
        render, schemas = episode_prompts(tokenizer, env, records) if env else (None, 0)
        prompt_limit, model_len = limits.for_generation(
            env.max_episode_tokens if env else round_cfg.generation.max_new_tokens, policy_dir, f"{stage.name}: ",
            "environment.max_episode_tokens" if env else "generation.max_new_tokens", schemas)
        if round_cfg.spec.teacher:  # before anything starts
            teacher_dir, where = ctx.tokenizer_dir(inputs.teacher), f"{field}.teacher ({round_cfg.teacher})"
            same_vocabulary(tokenizer, models.load_tokenizer(teacher_dir), where)
            teacher_fits(policy_dir, teacher_dir, model_len, where, sampled=True)
        prompts, report = batches.filter_prompts(tokenizer, records, prompt_limit, "prompts", render)
        run.log_metrics(report.as_metrics("prompts"))
        setup = RoundSetup(
            # A distillation round's frozen log-prob model is its teacher (alignflow/algorithms.py).
            policy_path=ctx.ref(inputs.policy),
            reference_path=ctx.ref(inputs.teacher if round_cfg.spec.teacher else inputs.reference),
            reward_path=ctx.ref(inputs.reward),
            prompts=prompts, dtype=io.dtype, torch_threads=ctx.infra.torch_threads,
            attn_implementation=io.attn_implementation,
            max_model_len=model_len, seed=cfg.seed,
            nodes_wait_s=NODES_WAIT_S if ctx.infra.ray_address else 0.0,  # a cluster may grow; a local Ray cannot
            judge_path=ctx.ref(inputs.judge),
            process_reward_path=ctx.ref(inputs.process_reward),
            step_separator=cfg.step_separator or "\n",
            judge_max_model_len=round_judge_positions(
                models.max_positions(ctx.tokenizer_dir(inputs.judge)), round_cfg.reward.judge,
                f"{field}.reward.judge.generation.max_model_len",
                judge_tokenizer=models.load_tokenizer(ctx.tokenizer_dir(inputs.judge)), policy_tokenizer=tokenizer,
                records=[r for _, r in prompts],
                response_tokens=env.max_episode_tokens if env else round_cfg.generation.max_new_tokens)
            if inputs.judge else None,
        )
        if setup.judge_max_model_len:  # the judge engine's positions: its prompts past them are rl/judge/overlong
            run.log_metrics({"rl/judge/positions": float(setup.judge_max_model_len)})
        ensure_ray(ctx.infra)
        rl = RLRound(round_cfg, setup)
        run.log_metrics({"rl/prompts_left_per_epoch": float(rl.schedule.left_per_epoch),  # whole steps only
                         "rl/prompts_never_sampled": float(rl.never_sampled)})
        checkpoints = StageCheckpoints(storage, out.uri, stage.name, round_cfg.checkpoint_every)
        failed = True  # until the round is done: what raised may have left an actor's call running
        try:
            start = checkpoints.resume(rl.load_state, run, round_cfg.steps)
            run.set_tag("alignflow.total_steps", str(round_cfg.steps))  # the CLI's progress display
            for step in range(start, round_cfg.steps):
                metrics = rl.step(step).metrics
                run.log_metrics({f"rl/{k}": v for k, v in metrics.items()} | {"progress/step": step + 1}, step=step + 1)
                if checkpoints.due(step + 1, round_cfg.steps):
                    checkpoints.save(step + 1, lambda ref: rl.save_state(ref, step + 1))
            out.add(rl.save_policy(out.ref))  # uploaded by the actor's rank 0, from its node
            sleeps = rl.engine_sleeps()
            failed = False
        finally:
            rl.shutdown(failed=failed)
        summary = {"rl/steps": float(round_cfg.steps), "rl/steps_run": float(round_cfg.steps - start),
                   "rl/resumed_from_step": float(start), "rl/final_reward_mean": metrics["reward/mean"],
                   "rl/engine_sleeps": float(sleeps)}
        run.log_metrics(summary)
        return summary

    return compute_stage(ctx, stage, compute)


def same_vocabulary(student, teacher, field: str) -> None:
    """A teacher scores the student's token ids: both tokenizers must number the same tokens alike."""
    if teacher.get_vocab() != student.get_vocab():
        raise ConfigError(f"{field}: its tokenizer is not the student's ({len(teacher)} against {len(student)} "
                          f"tokens, or the same count numbered differently); distillation scores the student's "
                          f"token ids with it")


def teacher_fits(student_dir: str, teacher_dir: str, length: int, field: str, *, sampled: bool) -> None:
    """A teacher scores sequences of up to `length` tokens: within its positions (past them a RoPE model's
    log-probs are silently wrong, a learned-position model's an index error). `sampled`: it scores the ids the
    student's engines sample, which may be any row of the student's output layer (a padded vocabulary's
    too: Qwen2.5-7B's 152064 rows against 3B's 151936), so it needs as many rows."""
    positions = models.max_positions(teacher_dir)
    if positions < length:
        raise ConfigError(f"{field}: the teacher takes {positions} positions, and it would score sequences of up "
                          f"to {length} tokens: lower the data's token limits (or the round's max_new_tokens), or "
                          f"choose a teacher with a longer context")
    if sampled and (rows := models.output_rows(teacher_dir)) < (student_rows := models.output_rows(student_dir)):
        raise ConfigError(f"{field}: the teacher's output layer has {rows} rows, the student's {student_rows}: "
                          f"the student may sample an id past the teacher's, which it cannot score")
