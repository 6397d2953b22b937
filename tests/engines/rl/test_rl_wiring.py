"""A real RL step with a non-zero KL coefficient, checked against `algos` applied independently.

Real Ray, DeepSpeed (gloo), vLLM (CPU) and scorer actors on tiny models; the
reference is a second model (another initialisation), so the KL to it is
non-zero from the first step. What the round computed (rewards, token
rewards, advantages, the KL controller, the rows it trained on, the KL loss)
is recomputed here from the step's own tensors with the `algos` functions:

- PPO, KL as a reward (k1), adaptive controller, whitened GAE, overlong shaping;
- GRPO, KL as a loss (k3), dynamic sampling, clip-higher;
- GSPO with normalised and clipped rewards, a truncation penalty, IcePop masking,
  no group std, the group-mean-range filter, and the reward statistics in the
  round's checkpoint (these recomputed here in plain Python).
"""

from __future__ import annotations

import pytest
import torch

import algos

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("warm_actors")]  # engines/placement/warm.py

MAX_NEW = 6


def parity_reward(prompt: str, response: str, answer: str | None) -> float:
    return float(sum(map(ord, response)) % 2)


def even_answers_agree(prompt: str, response: str, answer: str | None) -> float:
    """Constant for prompts whose answer is even (their groups carry no signal), else the parity rule."""
    return 1.0 if answer is not None and int(answer) % 2 == 0 else parity_reward(prompt, response, answer)


@pytest.fixture(scope="module")
def reference_model(tmp_path_factory):
    from alignflow.config import TinyModelConfig
    from engines.models import build_tiny_model

    return build_tiny_model(TinyModelConfig(), seed=1, out_dir=tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="module")
def prompts(tokenizer):
    from alignflow.config import SyntheticTaskConfig
    from alignflow.data import synthetic
    from engines.batches import filter_prompts

    data = synthetic.generate(SyntheticTaskConfig(num_sft=1, num_preference=1, num_eval=1, num_rl_prompts=64), seed=0)
    kept, _ = filter_prompts(tokenizer, data["prompts"], 64, "prompts")
    return kept


def _run_step(cfg, tiny_model, reference_model, prompts, then=None):
    """Step 0 of a round; `then(rl, outcome)` runs before the round shuts down."""
    from engines.rl.round import RLRound
    from engines.rl.round_models import RoundSetup

    path = str(tiny_model)
    rl = RLRound(cfg, RoundSetup(policy_path=path, reference_path=str(reference_model), reward_path=path,
                                 prompts=prompts, dtype="float32", torch_threads=1, max_model_len=80, seed=0))
    try:
        objectives = [dict(obj.keywords) for _, obj, _ in rl.update.objectives()]  # as the step will use them
        out = rl.step(0)
        if then is not None:
            then(rl, out)
        return out, objectives
    finally:
        rl.shutdown()


def test_ppo_kl_in_reward_adaptive_whitened_overlong_at_a_temperature(ray_local, tiny_model, reference_model,
                                                                      prompts):
    from alignflow.config import ActorConfig, KLConfig, PPOConfig, RewardConfig, RolloutConfig, RoundConfig
    from engines.models import load_policy

    kl = KLConfig(coef=0.05, estimator="k1", apply_as="reward", adaptive=True, target=0.5, horizon=50, clamp=10.0)
    cfg = RoundConfig(
        algorithm="ppo", steps=2, prompts_per_step=8,
        generation=RolloutConfig(num_samples=4, max_new_tokens=MAX_NEW, temperature=0.7),
        reward=RewardConfig(source="rule", rule=f"{__name__}:parity_reward", overlong_buffer=3, overlong_penalty=0.5),
        kl=kl, ppo=PPOConfig(minibatch_size=32, epochs=1), actor=ActorConfig(learning_rate=1e-3))
    out, objectives = _run_step(cfg, tiny_model, reference_model, prompts)
    exp, m = out.experience, out.metrics

    # Every log-prob of the round is of the distribution sampled at temperature 0.7 (logits / 0.7): the engine's,
    # the old policy's and the reference's, against plain forwards here.
    with torch.no_grad():
        policy, reference = (_at_responses(_next_token_logprobs(load_policy(path).eval(), exp.tensors(), 0.7), exp)[0]
                             for path in (tiny_model, reference_model))
    torch.testing.assert_close(exp.old_logprobs, policy, rtol=0, atol=1e-4)
    torch.testing.assert_close(exp.rollout_logprobs, policy, rtol=0, atol=1e-4)
    torch.testing.assert_close(exp.ref_logprobs, reference, rtol=0, atol=1e-4)

    lengths = exp.action_mask.sum(-1)
    assert lengths.max() > MAX_NEW - 3, "no response reached the overlong buffer; the shaping is untested"
    rule = torch.tensor([parity_reward("", r.text, None) for r in out.rollouts])
    torch.testing.assert_close(exp.rewards, rule + algos.overlong_penalty(
        lengths, max_len=MAX_NEW, buffer_len=3, penalty_factor=0.5))

    seq_kl = algos.kl_estimate(exp.old_logprobs, exp.ref_logprobs, kind="k1").mul(exp.action_mask).sum(-1)
    assert seq_kl.abs().max() > 1e-3, "policy and reference agree; the KL penalty is untested"
    token_rewards = algos.kl_penalized_rewards(exp.rewards, exp.old_logprobs, exp.ref_logprobs, exp.action_mask,
                                               kl_coef=0.05, kind="k1", clamp=10.0)
    torch.testing.assert_close(exp.token_rewards, token_rewards)
    gae = algos.get_advantage_estimator("gae")(
        token_rewards=token_rewards, action_mask=exp.action_mask, values=exp.values, group_size=4,
        gamma=cfg.ppo.gamma, lam=cfg.ppo.lam, eps=1e-6)
    torch.testing.assert_close(exp.advantages, algos.masked_whiten(gae.advantages, exp.action_mask))
    torch.testing.assert_close(exp.returns, gae.returns)

    controller = algos.AdaptiveKLController(0.05, target=0.5, horizon=50)
    controller.update(seq_kl.mean().item(), n_steps=len(exp))
    assert m["kl_coef"] == pytest.approx(controller.value)
    toward_target = (m["kl_coef"] > 0.05) == (seq_kl.mean().item() > 0.5)
    assert toward_target and m["kl_coef"] != 0.05
    assert objectives[0]["kl_loss_coef"] == 0.0 and m["kl_loss"] == 0.0  # KL is in the reward, not the loss
    assert out.trained_rows.tolist() == list(range(len(exp)))


def test_grpo_kl_loss_dynamic_sampling_clip_higher(ray_local, tiny_model, reference_model, prompts):
    from alignflow.config import ActorConfig, KLConfig, PPOConfig, RewardConfig, RolloutConfig, RoundConfig

    cfg = RoundConfig(
        algorithm="grpo", steps=2, prompts_per_step=8,
        generation=RolloutConfig(num_samples=4, max_new_tokens=MAX_NEW),
        reward=RewardConfig(source="rule", rule=f"{__name__}:even_answers_agree"),
        kl=KLConfig(coef=0.1), ppo=PPOConfig(minibatch_size=32, epochs=1, clip_low=0.2, clip_high=0.28,
                                             dynamic_sampling=True, tis_cap=None),
        actor=ActorConfig(learning_rate=1e-3))
    out, objectives = _run_step(cfg, tiny_model, reference_model, prompts)
    exp, m = out.experience, out.metrics

    # The spec puts GRPO's KL in the loss, with k3: token rewards carry the task reward alone.
    torch.testing.assert_close(exp.token_rewards, algos.kl_penalized_rewards(
        exp.rewards, exp.ref_logprobs, exp.ref_logprobs, exp.action_mask, kl_coef=0.0))
    grpo = algos.get_advantage_estimator("grpo")(token_rewards=exp.token_rewards, action_mask=exp.action_mask,
                                                 values=None, group_size=4, gamma=1.0, lam=0.95, eps=1e-6)
    torch.testing.assert_close(exp.advantages, grpo.advantages)

    groups = exp.rewards.view(-1, 4)
    constant = (groups == groups[:, :1]).all(-1)
    assert 0 < constant.sum() < len(groups), "need constant and informative groups"
    assert m["dynamic_sampling/dropped_groups"] == constant.sum().item()
    assert out.trained_rows.tolist() == torch.arange(len(exp))[~constant.repeat_interleave(4)].tolist()

    actor = objectives[0]
    assert (actor["clip_low"], actor["clip_high"], actor["kl_estimator"], actor["kl_loss_coef"], actor["agg"]) == (
        0.2, 0.28, "k3", 0.1, "token_mean")
    assert actor["loss_scale_constant"] == cfg.generation.max_new_tokens  # Dr. GRPO's C, were agg to use it
    # One minibatch, one epoch: no separate old-logprob forward; the training forward's own
    # logprobs are the old ones. Its KL term is the k3 KL of the pre-update policy (recomputed
    # here from the checkpoint) to the reference over the trained rows, times the coefficient.
    assert actor["on_policy"] and exp.old_logprobs is None and "time/old_logprobs" not in m
    from engines.models import load_policy
    from engines.train.objectives import response_logprobs

    rows = out.trained_rows
    with torch.no_grad():
        old = response_logprobs(load_policy(tiny_model).eval(), exp.select(rows).tensors())
    k3 = algos.kl_estimate(old, exp.ref_logprobs[rows], kind="k3", clamp=10.0)
    expected = 0.1 * algos.aggregate_loss(k3, exp.action_mask[rows], agg="token_mean")
    assert m["kl_loss"] == pytest.approx(expected.item(), rel=1e-4, abs=1e-7)
    assert m["kl_loss"] > 0
    k1 = algos.kl_estimate(old, exp.ref_logprobs[rows], kind="k1").mul(exp.action_mask[rows]).sum(-1)
    assert m["kl"] == pytest.approx(k1.mean().item(), rel=1e-4, abs=1e-6)


def test_clip_higher_reaches_the_loss(tiny_model):
    """The policy objective on a real model: a ratio between 1 + clip_low and 1 + clip_high counts
    unclipped with clip-higher and clipped without it (`algos.ppo_policy_loss` applied independently)."""
    from engines.models import load_policy
    from engines.rl.experience import from_rollouts
    from engines.rollout.base import Rollout
    from engines.train import objectives

    model = load_policy(tiny_model).eval()
    exp = from_rollouts([Rollout(0, [5, 6, 7], [11, 12, 13], "", [0.0] * 3, True),
                         Rollout(0, [5, 6, 7], [14, 15], "", [0.0] * 2, True)], pad_id=0)
    with torch.no_grad():
        logprobs = objectives.response_logprobs(model, exp.tensors())
    # old = new - log(1.25): every ratio is 1.25, positive advantages
    batch = exp.with_(old_logprobs=(logprobs - torch.log(torch.tensor(1.25))) * exp.action_mask,
                      advantages=exp.action_mask.clone(), ref_logprobs=logprobs).tensors()
    for clip_high in (0.2, 0.28):
        loss, metrics = objectives.policy_objective(
            model, batch, clip_low=0.2, clip_high=clip_high, dual_clip=None, agg="token_mean", entropy_coef=0.0,
            kl_loss_coef=0.0, kl_estimator="k3", kl_clamp=None, tis_cap=None)
        expected = algos.ppo_policy_loss(logprobs, batch["old_logprobs"], batch["advantages"], exp.action_mask,
                                         clip_low=0.2, clip_high=clip_high, agg="token_mean")
        assert loss.item() == pytest.approx(expected.loss.item(), rel=1e-5)
        tokens = float(exp.action_mask.sum())  # (clipped tokens, tokens)
        assert metrics["clip_fraction"] == pytest.approx((tokens if clip_high == 0.2 else 0.0, tokens))


def test_icepop_masks_the_tokens_whose_engines_disagree_out_of_the_loss(tiny_model):
    """IcePop (`tis_mode: mask`) in the policy objective on a real model: a token whose trainer/sampler
    ratio lies outside [tis_low, tis_cap] leaves the loss, and the masked fraction counts it; the rest
    keep their ratio as a weight. The expected figures are worked by hand."""
    from engines.models import load_policy
    from engines.rl.experience import from_rollouts
    from engines.rollout.base import Rollout
    from engines.train import objectives

    model = load_policy(tiny_model).eval()
    exp = from_rollouts([Rollout(0, [5, 6, 7], [11, 12, 13], "", [0.0] * 3, True),
                         Rollout(0, [5, 6, 7], [14, 15], "", [0.0] * 2, True)], pad_id=0)
    with torch.no_grad():
        logprobs = objectives.response_logprobs(model, exp.tensors())
    mask = exp.action_mask
    # Trainer over sampler probability of each sampled token; 3.0 and 0.25 lie outside [0.5, 2.0].
    ratios = torch.tensor([[3.0, 1.0, 0.25], [1.5, 0.6, 1.0]])  # the last one is padding
    batch = exp.with_(old_logprobs=logprobs * mask, rollout_logprobs=(logprobs - ratios.log()) * mask,
                      advantages=mask.clone().float(), ref_logprobs=logprobs).tensors()
    common = dict(clip_low=0.2, clip_high=0.2, dual_clip=None, agg="token_mean", entropy_coef=0.0, kl_loss_coef=0.0,
                  kl_estimator="k3", kl_clamp=None, tis_cap=2.0, tis_low=0.5)
    loss, metrics = objectives.policy_objective(model, batch, tis_mode="mask", **common)
    # new = old: every PPO ratio is 1, so each token's loss is -advantage x weight: -(1.0 + 1.5 + 0.6) / 5 tokens
    assert loss.item() == pytest.approx(-(1.0 + 1.5 + 0.6) / 5, rel=1e-5)
    assert metrics["tis_masked_fraction"] == pytest.approx((2.0, 5.0))  # (masked tokens, tokens)
    assert metrics["tis_weight_mean"] == pytest.approx((1.0 + 1.5 + 0.6, 5.0), rel=1e-5)
    # The same tokens truncated (TIS) instead: min(ratio, 2), floored at 0.5: nothing leaves the loss.
    loss, metrics = objectives.policy_objective(model, batch, tis_mode="truncate", **common)
    assert loss.item() == pytest.approx(-(2.0 + 1.0 + 0.5 + 1.5 + 0.6) / 5, rel=1e-5)
    assert metrics["tis_masked_fraction"] == pytest.approx((0.0, 5.0))


# vLLM's and the trainer's fp32 log-probabilities of a token differ by up to ~5e-7 on the CPU (0 on about
# half the tokens): a range this narrow masks some tokens and keeps others, so a real round shows masking.
TIS_LOW, TIS_HIGH = 1 - 2e-7, 1 + 2e-7


def test_gspo_normalised_clipped_rewards_truncation_icepop_mean_range(ray_local, tiny_model, reference_model,
                                                                       prompts, tmp_path):
    import json
    import math

    from alignflow.config import ActorConfig, KLConfig, PPOConfig, RewardConfig, RolloutConfig, RoundConfig
    from engines.train import objectives as objective_fns

    low, high = 0.3, 1.0  # in task-reward units (a pass rate): groups with one right answer in four drop
    cfg = RoundConfig(
        algorithm="gspo", steps=2, prompts_per_step=8,
        generation=RolloutConfig(num_samples=4, max_new_tokens=MAX_NEW),
        reward=RewardConfig(source="rule", rule=f"{__name__}:even_answers_agree", normalize=True, clip=1.0,
                            truncation_penalty=0.25),
        kl=KLConfig(coef=0.0),
        ppo=PPOConfig(minibatch_size=8, epochs=1, tis_cap=TIS_HIGH, tis_low=TIS_LOW, tis_mode="mask", dynamic_sampling=True,
                      dynamic_sampling_mean_range=(low, high), advantage_std_norm=False),
        actor=ActorConfig(learning_rate=1e-3))
    seen = {}

    def checkpoint_round_trip(rl, out):
        import ray

        seen["schedule"] = ray.get([w.__ray_call__.remote(lambda w: w.scheduler.last_epoch)
                                    for w in rl.models.actor.workers])
        seen["records"] = rl._prompts(0)[1]  # the step's prompt records (their answers)
        seen["objective"] = rl.update.objectives()[0][1]
        rl.save_state(str(tmp_path), 1)
        seen["json"] = json.loads((tmp_path / "round.json").read_text())
        stats = rl.reward_stats
        rl.reward_stats = type(stats)()  # forget the statistics, then resume from the checkpoint
        rl.load_state(str(tmp_path))
        seen["restored"] = rl.reward_stats == stats

    out, objectives = _run_step(cfg, tiny_model, reference_model, prompts, then=checkpoint_round_trip)
    exp, m = out.experience, out.metrics

    # rewards: the rule, standardised over the round's rewards so far (this first step's), clipped to
    # [-1, 1], minus 0.25 for each response cut by the length limit
    task = [even_answers_agree("", r.text, seen["records"][r.prompt_index].get("answer")) for r in out.rollouts]
    n = len(task)
    mean = sum(task) / n
    m2 = sum((x - mean) ** 2 for x in task)
    clipped = [max(-1.0, min(1.0, (x - mean) / math.sqrt(m2 / n + 1e-8))) for x in task]
    cut = [not r.finished for r in out.rollouts]
    assert sum(cut) > 0, "no response hit the length limit; the truncation penalty is untested"
    rewards = [c - 0.25 * k for c, k in zip(clipped, cut)]
    assert exp.rewards.tolist() == pytest.approx(rewards, abs=1e-5)
    n_clipped = sum(abs((x - mean) / math.sqrt(m2 / n + 1e-8)) > 1.0 for x in task)
    assert (m["reward/truncated"], m["reward/clipped"]) == (sum(cut), n_clipped)
    assert m["reward/running_mean"] == pytest.approx(mean) and m["reward/task_mean"] == pytest.approx(mean)
    assert seen["json"]["reward_stats"] == pytest.approx({"count": float(n), "mean": mean, "m2": m2})
    assert seen["restored"]

    # advantages: GRPO's group baseline without the std division (advantage_std_norm: false)
    groups = [rewards[i:i + 4] for i in range(0, n, 4)]
    centered = [x - sum(g) / 4 for g in groups for x in g]
    assert exp.advantages[:, 0].tolist() == pytest.approx(centered, abs=1e-5)

    # rows: constant groups dropped, then groups whose mean task reward (not the shaped one) is outside
    # [low, high]
    constant = [max(g) == min(g) for g in groups]
    in_range = [low <= sum(task[i:i + 4]) / 4 <= high for i in range(0, n, 4)]
    kept = [i for i in range(n) if not constant[i // 4] and in_range[i // 4]]
    assert 0 < len(kept) < n, "need kept and dropped groups"
    assert out.trained_rows.tolist() == kept
    # Fewer rows, fewer minibatches of 8 than the 4 the schedule is sized for a step: it moves on by 4 all the
    # same, so that it is where the round is (it lagged, and never reached its floor).
    assert len(kept) < 32 and seen["schedule"] == [4]
    assert m["dynamic_sampling/dropped_groups"] == sum(constant)
    assert m["dynamic_sampling/dropped_groups_mean_range"] == sum(not c and not r for c, r in zip(constant, in_range))

    # the GSPO objective with its spec's clip range and aggregation, and IcePop masking
    actor = objectives[0]
    assert (actor["clip_low"], actor["clip_high"], actor["agg"]) == (3e-4, 4e-4, "seq_mean_token_mean")
    assert (actor["tis_mode"], actor["tis_low"], actor["tis_cap"], actor["on_policy"]) == ("mask", TIS_LOW, TIS_HIGH, False)
    # IcePop in the real round: of the trained rows' tokens, some lie outside [TIS_LOW, TIS_HIGH] and some
    # inside; the step masked a share of them out (weight 0) and kept the rest (weight ~1). The step's figures
    # average its minibatches', so they are bounded here (the test above works the mask's arithmetic).
    sel = exp.action_mask[out.trained_rows].bool()
    rho = (exp.old_logprobs[out.trained_rows] - exp.rollout_logprobs[out.trained_rows]).exp()[sel]
    outside = (rho < TIS_LOW) | (rho > TIS_HIGH)
    assert 0 < outside.sum() < outside.numel(), f"masked {int(outside.sum())} of {outside.numel()}: nothing to tell apart"
    assert 0 < m["tis_masked_fraction"] < 1 and 0 < m["tis_weight_mean"] < 1, m
    assert m["tis_weight_mean"] == pytest.approx(1 - m["tis_masked_fraction"], abs=1e-5)
    assert seen["objective"].func is objective_fns.policy_objective
    assert seen["objective"].keywords["surrogate"] is objective_fns.SURROGATES["gspo_clip"]
    assert exp.old_logprobs is not None  # several optimizer steps: the old policy's forward ran


def _next_token_logprobs(model, exp, temperature: float = 1.0) -> torch.Tensor:
    """log π(· | y_<t) at every position, at `temperature`: (B, L-1, V), from a plain forward of `model` (no
    engine code)."""
    logits = model(input_ids=exp["input_ids"], attention_mask=exp["attention_mask"]).logits.float() / temperature
    return torch.log_softmax(logits[:, :-1], dim=-1)


def _at_responses(logp: torch.Tensor, exp) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each sampled response token (B, T), the exact reverse-KL operand: the (B, T, V)
    next-token distributions at the response positions)."""
    index = exp.response_index
    dists = logp.gather(1, index[..., None].expand(-1, -1, logp.shape[-1]))
    sampled = dists.gather(-1, exp.input_ids[:, 1:].gather(1, index)[..., None])[..., 0]
    return sampled * exp.action_mask, dists


def _exact_reverse_kl(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over response positions of KL(student(·) || teacher(·)), summed over the whole vocabulary."""
    kl = (student.exp() * (student - teacher)).sum(-1)
    return algos.masked_mean(kl, mask).item()


def test_distillation_scores_the_samples_with_the_teacher_and_moves_the_student_toward_it(
        ray_local, tiny_model, reference_model, prompts):
    """algorithm: distill. The teacher (a second model) scores exactly the tokens the student sampled;
    each token's advantage is its negative reverse KL to the teacher (`algos.distillation_token_rewards`
    of the old log-probs); no KL term besides; and the step lowers the student's exact reverse KL to
    the teacher (over the whole vocabulary) at the positions it trained on."""
    from transformers import AutoModelForCausalLM

    from alignflow.config import ActorConfig, PPOConfig, RewardConfig, RolloutConfig, RoundConfig

    cfg = RoundConfig(
        algorithm="distill", teacher=str(reference_model), steps=2, prompts_per_step=8,
        generation=RolloutConfig(num_samples=4, max_new_tokens=MAX_NEW),
        reward=RewardConfig(source="rule", rule=f"{__name__}:parity_reward"),
        ppo=PPOConfig(minibatch_size=32, epochs=4), actor=ActorConfig(learning_rate=1e-3)).resolved()
    after = {}

    def full_logprobs(model, batch):  # defined here, so that Ray ships it to the actor by value
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        return torch.log_softmax(logits[:, :-1], dim=-1)

    def measure(rl, out):
        after["logp"] = rl.models.actor.evaluate_rows(out.experience.tensors(), full_logprobs)

    out, objectives = _run_step(cfg, tiny_model, reference_model, prompts, then=measure)
    exp, m, mask = out.experience, out.metrics, out.experience.action_mask

    def plain(path):
        model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
        with torch.no_grad():
            return _at_responses(_next_token_logprobs(model, exp.tensors()), exp)

    teacher, teacher_dists = plain(reference_model)
    torch.testing.assert_close(exp.ref_logprobs, teacher, atol=1e-5, rtol=1e-5)
    student, student_dists = plain(tiny_model)  # the policy before the step: the old log-probs
    torch.testing.assert_close(exp.old_logprobs, student, atol=1e-5, rtol=1e-5)
    expected = algos.distillation_token_rewards(student, teacher, mask)
    assert expected.abs().max() > 0.1, "student and teacher agree; the signal is untested"
    torch.testing.assert_close(exp.token_rewards, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(exp.advantages, expected, atol=1e-5, rtol=1e-5)  # per token, no return-to-go
    assert objectives[0]["kl_loss_coef"] == 0.0 and m["kl_coef"] == 0.0
    sampled = algos.masked_mean(algos.reverse_kl_per_token(student, teacher, mask), mask).item()
    assert m["distill/reverse_kl_per_token"] == pytest.approx(sampled, rel=1e-4)

    before = _exact_reverse_kl(student_dists, teacher_dists, mask)
    later = _exact_reverse_kl(_at_responses(after["logp"], exp)[1], teacher_dists, mask)
    assert later < 0.9 * before, (before, later)


def test_a_lora_student_colocated_with_its_teacher_learns_from_it(ray_local, tiny_model, reference_model, prompts):
    """algorithm: distill with LoRA on the student and colocate_all: the teacher gets a scorer of its own in
    the round's one placement group (not the actor with its adapters off, which is the student's base),
    under 5 % of the parameters train, and the step lowers the exact reverse KL to the teacher."""
    import ray
    from transformers import AutoModelForCausalLM

    from alignflow.config import ActorConfig, PPOConfig, RewardConfig, RolloutConfig, RoundConfig
    from engines.rl.round import RLRound
    from engines.rl.round_models import RoundSetup

    lora = {"rank": 8, "alpha": 16.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    cfg = RoundConfig(
        algorithm="distill", teacher=str(reference_model), steps=2, prompts_per_step=8, colocate_all=True,
        generation=RolloutConfig(num_samples=4, max_new_tokens=MAX_NEW),
        reward=RewardConfig(source="rule", rule=f"{__name__}:parity_reward"),
        ppo=PPOConfig(minibatch_size=32, epochs=4), actor=ActorConfig(learning_rate=5e-3, lora=lora))
    path = str(tiny_model)
    rl = RLRound(cfg, RoundSetup(policy_path=path, reference_path=str(reference_model), reward_path=None,
                                 prompts=prompts, dtype="float32", torch_threads=1, max_model_len=80, seed=0))

    def full_logprobs(model, batch):  # defined here, so that Ray ships it to the actor by value
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        return torch.log_softmax(logits[:, :-1], dim=-1)

    try:
        assert rl.models.reference is not None and not rl.models.reference_from_actor
        pg = rl.models.placement_group
        reports = [*rl.models.actor.device_reports(), ray.get(rl.models.reference.device_report.remote())]
        assert {r["placement_group"] for r in reports} == {pg.id.hex()}, reports
        out = rl.step(0)
        exp = out.experience
        assert out.metrics["lora/trainable_fraction"] < 0.05
        after = rl.models.actor.evaluate(exp.tensors(), full_logprobs)
    finally:
        rl.shutdown()

    def plain(model_dir):
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
        with torch.no_grad():
            return _at_responses(_next_token_logprobs(model, exp.tensors()), exp)

    teacher, teacher_dists = plain(reference_model)
    torch.testing.assert_close(exp.ref_logprobs, teacher, atol=1e-5, rtol=1e-5)  # the teacher, not the base
    _, student_dists = plain(tiny_model)
    before = _exact_reverse_kl(student_dists, teacher_dists, exp.action_mask)
    later = _exact_reverse_kl(_at_responses(after, exp)[1], teacher_dists, exp.action_mask)
    assert later < 0.9 * before, (before, later)
