"""A round's settings that must agree with each other (RoundConfig's check after its fields validate)."""

from __future__ import annotations

from alignflow.algorithms import ALGORITHMS


def check_round(r) -> None:
    """Raise ValueError naming the settings of the RoundConfig `r` that disagree."""
    if r.generation.num_samples < r.spec.min_samples:
        raise ValueError(f"{r.algorithm} needs generation.num_samples >= {r.spec.min_samples} "
                         f"(a group per prompt)")
    low, high = r.ppo.clip_low or r.spec.clip_low, r.ppo.clip_high or r.spec.clip_high
    _check_surrogate(r)
    if high < low and r.spec.policy_loss != "cispo":  # cispo's clip_low 1 is no lower bound, not a clip range
        raise ValueError(f"ppo.clip_high ({high}) must be >= ppo.clip_low ({low}); a value left out is "
                         f"{r.algorithm}'s default ({r.spec.clip_low}, {r.spec.clip_high})")
    if r.ppo.advantage_std_norm is not None and r.spec.group_std_norm is None:
        raise ValueError(f"ppo.advantage_std_norm: {r.algorithm} has no group-normalised advantages "
                         f"(no group std to switch); leave it out")
    update = r.spec.update
    if update in ("policy_gradient", "best_of_n_sft"):  # an update's rows split evenly across each group's ranks
        groups = [("actor", r.actor.num_workers)] + [("critic", r.critic.num_workers)] * bool(r.spec.critic)
        if uneven := [(g, n) for g, n in groups if r.ppo.minibatch_size % n]:
            g, n = uneven[0]
            raise ValueError(f"ppo.minibatch_size ({r.ppo.minibatch_size}), an update's rows, is split evenly across "
                             f"{g}.num_workers ({n}): make it a multiple of {n}")
    frozen = r.actor.freeze_steps
    if frozen and not r.spec.critic:
        raise ValueError(f"actor.freeze_steps trains the critic alone; {r.algorithm} has no critic")
    if frozen >= r.steps:
        raise ValueError(f"actor.freeze_steps ({frozen}) must be < steps ({r.steps}): the actor would "
                         f"never train")
    per_update = r.dpo.pairs_per_update or r.prompts_per_step
    if r.spec.update == "online_dpo" and per_update % r.actor.num_workers:
        raise ValueError(f"online_dpo splits each update's pairs across actor.num_workers="
                         f"{r.actor.num_workers}: dpo.pairs_per_update (or prompts_per_step, without it) "
                         f"must be a multiple of it, got {per_update}")
    if r.spec.teacher and not r.teacher:
        raise ValueError(f"{r.algorithm} needs a teacher: a policy of this pipeline (e.g. round_2) or a "
                         f"model path")
    if r.teacher_revision is not None and not r.teacher:
        raise ValueError("teacher_revision pins the teacher's hub model: give the teacher")
    if r.reference is not None and not (r.spec.reference and r.uses_reference):
        why = "reads none with kl.coef 0 (no KL term)" if r.spec.reference else "has none"
        raise ValueError(f"reference: {r.algorithm} {why}: leave reference out")
    if r.kl.adaptive and r.kl_coef == 0:
        raise ValueError(f"kl.adaptive scales kl.coef, and {r.algorithm} trains with no KL term by default (kl.coef "
                         f"0): give kl.coef, the controller's start (e.g. 0.05)")
    if r.spec.advantage == "gpg" and (r.ppo.dynamic_sampling or r.ppo.dynamic_sampling_mean_range):
        raise ValueError(f"{r.algorithm} scales its advantages by all rows over those that carry a gradient: it "
                         "makes up for the constant groups that ppo.dynamic_sampling drops instead, and with both the "
                         "rows trained on would be scaled up twice: leave dynamic sampling out")
    if r.teacher and not r.spec.teacher:
        raise ValueError(f"teacher is read by algorithm distill; this round's algorithm is {r.algorithm}")
    if r.spec.teacher and (r.ppo.dynamic_sampling or r.ppo.dynamic_sampling_mean_range):
        raise ValueError(f"{r.algorithm}'s signal is its teacher's, not the task reward's: ppo.dynamic_sampling "
                         "would drop the groups whose (unused) rewards are all equal from distillation")
    if r.generation.num_samples == 1 and r.ppo.dynamic_sampling:  # (a mean range still filters single rows)
        raise ValueError("ppo.dynamic_sampling drops the groups of a prompt's samples whose rewards are all equal; "
                         "with generation.num_samples 1 every group is one sample, so every row would be dropped "
                         "at every step: sample 2 or more")
    if r.spec.teacher and r.generation.top_p < 1:
        raise ValueError(f"{r.algorithm} compares the engines' log-probs of the student's samples with the "
                         f"teacher's at generation.temperature; with generation.top_p={r.generation.top_p} "
                         "the engines' are of the renormalised nucleus, which shifts each token's pull by its "
                         "own amount: sample with top_p 1")
    if any(c.source == "environment" for c in r.reward.components) and r.environment is None:
        raise ValueError("reward.source environment rewards episodes' returns: give the round an environment")
    if r.reward.uses_process_model and r.environment is not None:
        raise ValueError("reward.source process_model scores a response's steps, and an environment's episodes "
                         "interleave observations with them: reward the episodes otherwise")
    if any(c.dense for c in r.reward.components):
        _check_dense(r)
    buffer, longest = r.reward.overlong_buffer, r.max_response_tokens
    if buffer > longest:
        where = ("min(environment.max_turns * per-turn tokens, environment.max_episode_tokens)"
                 if r.environment is not None else "generation.max_new_tokens")
        raise ValueError(f"reward.overlong_buffer ({buffer}) must be <= the longest response, {where} = "
                         f"{longest}: the penalty ramps over the last overlong_buffer tokens before it")
    if r.environment is not None and r.partial_rollouts:
        raise ValueError("partial_rollouts writes single responses in pieces; an environment's episodes take "
                         "weights between whole episodes: leave partial_rollouts out")
    if not r.async_rollouts and (r.max_staleness > 1 or r.partial_rollouts):
        raise ValueError("max_staleness and partial_rollouts shape asynchronous rollouts: set async_rollouts")
    if r.colocate_all:  # every model and engine gets a share of the actor's GPUs (gpu_share)
        n, gpus, scored = r.actor.num_workers, r.actor.placement.num_gpus, r.uses_reference or \
            r.reward.uses_model or r.reward.uses_process_model
        if r.num_rollout_engines != n:
            raise ValueError(f"colocate_all puts one rollout engine beside each actor worker: "
                             f"num_rollout_engines must equal actor.num_workers ({n})")
        if r.spec.critic and r.critic.num_workers != n:
            raise ValueError(f"colocate_all: critic.num_workers must equal actor.num_workers ({n})")
        if r.generation.vllm.tensor_parallel_size > 1:
            raise ValueError("colocate_all with generation.vllm.tensor_parallel_size > 1 is not supported: "
                             "colocate with one GPU per engine, or give tensor-parallel engines GPUs of "
                             "their own (colocate_all: false)")
        if r.async_rollouts:
            raise ValueError("async_rollouts keeps the engines awake while the models train: not with colocate_all")
        on_gpu = gpus > 0  # the actor's GPUs are every model's and engine's (another num_gpus is refused below)
        if (on_gpu and r.generation.backend == "vllm"
                and "gpu_memory_utilization" not in r.generation.vllm.model_fields_set):
            raise ValueError(
                "colocate_all: vLLM starts on GPUs where the actor, critic, reference and reward model already "
                "hold their memory, and refuses to start unless generation.vllm.gpu_memory_utilization (a "
                f"share of the whole GPU, {r.generation.vllm.gpu_memory_utilization} by default) is free: "
                "set it to the share vLLM may take for its weights and KV cache (configs/gpu-small.yaml: 0.3)")
        j = r.reward.judge.generation
        if (on_gpu and r.reward.uses_judge and j.backend == "vllm"
                and "gpu_memory_utilization" not in j.vllm.model_fields_set):
            raise ValueError("colocate_all: the judge's vLLM engine shares the GPU too: set "
                             "reward.judge.generation.vllm.gpu_memory_utilization to its share")
        places = (("generation.placement", r.generation.placement, True), ("reward.judge.generation.placement",
                  j.placement, r.reward.uses_judge), ("critic.placement", r.critic.placement,
                  r.spec.critic), ("scorer_placement", r.scorer_placement, scored))
        if pinned := [name for name, p, _ in places if p.resources]:
            raise ValueError(f"colocate_all places every actor in the actor workers' bundles: set custom "
                             f"resources in actor.placement.resources, not in {', '.join(pinned)}")
        if other := [f"{k}.num_gpus: {p.num_gpus}" for k, p, use in places if use and p.num_gpus not in (0, gpus)]:
            raise ValueError(f"colocate_all shares actor.placement.num_gpus ({gpus}) among the models and engines "
                             f"it starts: {', '.join(other)} would not hold; set {gpus}, or 0 (the default) for it")


def _check_dense(r) -> None:
    """A dense process reward (reward dense: true) gives each step a reward at its last token, which only a
    policy-gradient update's advantages take; the sequence-reward settings do not reach it."""
    if r.spec.update != "policy_gradient" or r.spec.teacher:
        what = {"best_of_n_sft": "keeps each prompt's best response by its sequence reward",
                "online_dpo": "pairs each prompt's best and worst responses by their sequence rewards"}
        raise ValueError(f"reward dense: true makes step rewards part of the advantages, and {r.algorithm} "
                         f"{what.get(r.spec.update, 'takes its advantage from its teacher')}: set dense: false "
                         f"(one reward per response, step_aggregation)")
    if not r.reward.dense_only:
        return
    if r.ppo.dynamic_sampling or r.ppo.dynamic_sampling_mean_range:
        raise ValueError("ppo.dynamic_sampling filters groups by their sequence rewards, and with only a dense "
                         "process reward (dense: true) every sequence reward is 0: every group would be dropped. "
                         "Add an outcome source (reward.sources), or leave dynamic sampling out")
    if r.reward.normalize or r.reward.clip is not None:
        raise ValueError("reward.normalize and reward.clip shape the sequence reward; a dense process reward "
                         "(dense: true) gives rewards at steps, which they never touch, and no sequence reward: "
                         "leave them out")


def _check_surrogate(r) -> None:
    """The clip settings, SAPO's temperatures and the covariance control agree with the round's surrogate."""
    p, surrogate = r.ppo, r.spec.policy_loss
    cov = p.covariance.method if p.covariance is not None else None
    if cov is not None and surrogate != "ppo_clip":
        ppo_clip = [a.name for a in ALGORITHMS.values()
                    if a.update == "policy_gradient" and a.policy_loss == "ppo_clip"]
        raise ValueError(f"ppo.covariance ({cov}) acts on PPO's token-ratio surrogate; {r.algorithm}'s is "
                         f"{surrogate}: use it with {', '.join(ppo_clip)}")
    given = [f"ppo.{k}" for k in ("clip_low", "clip_high", "dual_clip") if getattr(p, k) is not None]
    if r.clip_replaced_by and given:
        raise ValueError(f"{', '.join(given)}: {r.algorithm} has no clip here, {r.clip_replaced_by}: leave them out")
    no_cap = {"cispo": "cispo has none to cap (its weight is clipped at ppo.clip_high)",
              "gmpo_clip": "gmpo clips each token's log-ratio (ppo.clip_low / clip_high, in log space)"}
    if surrogate in no_cap and p.dual_clip is not None:
        raise ValueError(f"ppo.dual_clip caps PPO's clipped surrogate; {no_cap[surrogate]}: leave it out")
    if surrogate != "sapo_gate" and p.sapo_temperatures != type(p).model_fields["sapo_temperatures"].default:
        raise ValueError(f"ppo.sapo_temperatures is read by algorithm sapo; this round's is {r.algorithm}")
