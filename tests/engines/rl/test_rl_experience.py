"""Experience making as pure functions (engines/rl/experience.py), on CPU tensors, without Ray.

Expected values are computed here in plain Python from the formulas in the
docstrings, never by calling the `algos` functions the code uses.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from engines.rl import experience
from engines.rollout.base import Rollout

PAD = 0


def _rollouts() -> list[Rollout]:
    """Two prompts x two samples; prompt lengths 3 and 2; one unfinished sample."""
    return [
        Rollout(0, [5, 6, 7], [11, 12], "a", [-0.5, -1.0], True),
        Rollout(0, [5, 6, 7], [13], "b", [-0.25], True),
        Rollout(1, [8, 9], [14, 15, 16], "c", [-1.0, -2.0, -0.5], False),
        Rollout(1, [8, 9], [17], "d", [-0.75], True),
    ]


@pytest.fixture
def exp():
    return experience.from_rollouts(_rollouts(), PAD)


def test_from_rollouts_layout(exp):
    assert exp.input_ids.tolist() == [[5, 6, 7, 11, 12], [5, 6, 7, 13, 0], [8, 9, 14, 15, 16], [8, 9, 17, 0, 0]]
    assert exp.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    # response token t of a P-token prompt is predicted at position P - 1 + t
    assert exp.response_index.tolist() == [[2, 3, 0], [2, 0, 0], [1, 2, 3], [1, 0, 0]]
    assert exp.action_mask.tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]]
    assert exp.rollout_logprobs.tolist() == [[-0.5, -1.0, 0], [-0.25, 0, 0], [-1.0, -2.0, -0.5], [-0.75, 0, 0]]
    assert exp.prompt_index.tolist() == [0, 0, 1, 1] and exp.finished.tolist() == [True, True, False, True]
    assert exp.rewards is None and exp.advantages is None


def test_experience_is_immutable(exp):
    with pytest.raises(dataclasses.FrozenInstanceError):
        exp.rewards = torch.ones(4)
    filled = exp.with_(rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]))
    assert exp.rewards is None and filled.rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    picked = filled.select(torch.tensor([3, 0]))
    assert picked.rewards.tolist() == [1.0, 1.0] and picked.input_ids[0].tolist() == [8, 9, 17, 0, 0]
    assert set(filled.tensors()) == {"input_ids", "attention_mask", "response_index", "action_mask",
                                     "rollout_logprobs", "prompt_index", "finished", "rewards"}


def test_shaped_rewards_overlong_penalty(exp):
    task = torch.tensor([1.0, 1.0, 1.0, 1.0])
    assert torch.equal(experience.shaped_rewards(task, exp.action_mask, max_response_tokens=3, overlong_buffer=0,
                                                 overlong_penalty=1.0), task)
    # L = 3, C = 2: lengths (2, 1, 3, 1); p = 0 for len <= 1, ((L - C) - len) / C * 0.5 above
    shaped = experience.shaped_rewards(task, exp.action_mask, max_response_tokens=3, overlong_buffer=2,
                                       overlong_penalty=0.5)
    expected = [1.0 + (1 - 2) / 2 * 0.5, 1.0, 1.0 + (1 - 3) / 2 * 0.5, 1.0]
    assert shaped.tolist() == pytest.approx(expected)


def test_overlong_shaping_counts_an_episodes_sampled_tokens_not_its_observations():
    # One episode: turn (2 tokens), observation (3, action 0), turn (1); and a response of 3 sampled tokens.
    mask = torch.tensor([[1, 1, 0, 0, 0, 1], [1, 1, 1, 0, 0, 0]])
    shaped = experience.shaped_rewards(torch.zeros(2), mask, max_response_tokens=4, overlong_buffer=2,
                                       overlong_penalty=1.0)
    # L = 4, C = 2: both rows are 3 sampled tokens long, so both get ((4 - 2) - 3) / 2 = -0.5; counting the
    # observation tokens (6) would have given the episode the full penalty, -1.
    assert shaped.tolist() == pytest.approx([-0.5, -0.5])


def _filled(exp, rewards, old, ref):
    return exp.with_(rewards=torch.tensor(rewards), old_logprobs=torch.tensor(old), ref_logprobs=torch.tensor(ref))


OLD = [[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0], [-1.0, -1.0, -1.0], [-3.0, 0.0, 0.0]]
REF = [[-1.5, -1.0, 0.0], [-0.5, 0.0, 0.0], [-2.0, -1.0, -0.5], [-1.0, 0.0, 0.0]]
LENGTHS = [2, 1, 3, 1]


def test_a_distillation_steps_token_rewards_are_the_teachers_pull_alone_in_an_environment(exp):
    """An environment's intermediate rewards are moved to their turns from the sequence reward at the row's end;
    a distillation step has none there (its signal is the teacher's pull), so moving them would leave +r at a
    turn's end and -r at the row's: they are not added."""
    import algos

    turns = torch.zeros(4, 3)
    turns[0, 0], turns[2, 1] = 1.0, 2.0  # rows 0 and 2: a rewarded turn before the end
    filled = _filled(exp, [1.0, 0.0, 0.5, 0.5], OLD, REF).with_(turn_rewards=turns)
    out = experience.with_advantages(filled, estimator="per_token", whiten=False, group_size=2, gamma=1.0, lam=1.0,
                                     kl_coef=0.0, kl_estimator="k1", kl_clamp=None, teacher=True)
    pull = algos.distillation_token_rewards(torch.tensor(OLD), torch.tensor(REF), exp.action_mask)
    assert torch.equal(out.token_rewards, pull)
    plain = experience.with_advantages(filled, estimator="grpo", whiten=False, group_size=2, gamma=1.0, lam=1.0,
                                       kl_coef=0.0, kl_estimator="k1", kl_clamp=None)
    assert plain.token_rewards[0, 0] == 1.0 + 0.0 and plain.token_rewards[0, 1] == 1.0 - 1.0  # moved, sum kept


def test_kl_in_the_reward_then_grpo(exp):
    coef = 0.1
    out = experience.with_advantages(_filled(exp, [1.0, 0.0, 0.5, 0.5], OLD, REF), estimator="grpo", whiten=False,
                                     group_size=2, gamma=1.0, lam=1.0, kl_coef=coef, kl_estimator="k1", kl_clamp=None)
    rewards = [1.0, 0.0, 0.5, 0.5]
    for b, n in enumerate(LENGTHS):
        for t in range(3):
            want = 0.0
            if t < n:
                want = -coef * (OLD[b][t] - REF[b][t]) + (rewards[b] if t == n - 1 else 0.0)
            assert out.token_rewards[b, t].item() == pytest.approx(want), (b, t)
    # GRPO on the summed token rewards: (s - mean) / (unbiased std + eps), per group of two
    s = [sum(out.token_rewards[b, :n].tolist()) for b, n in enumerate(LENGTHS)]
    for g in (0, 2):
        mean = (s[g] + s[g + 1]) / 2
        std = math.sqrt(((s[g] - mean) ** 2 + (s[g + 1] - mean) ** 2) / 1)
        for b in (g, g + 1):
            want = (s[b] - mean) / (std + 1e-6)
            assert out.advantages[b, :LENGTHS[b]].tolist() == pytest.approx([want] * LENGTHS[b], rel=1e-5)
            assert out.advantages[b, LENGTHS[b]:].abs().sum() == 0


def test_kl_as_a_loss_leaves_rewards_alone(exp):
    out = experience.with_advantages(_filled(exp, [1.0, 0.0, 0.5, 0.5], OLD, REF), estimator="dr_grpo",
                                     whiten=False, group_size=2, gamma=1.0, lam=1.0, kl_coef=0.0,
                                     kl_estimator="k3", kl_clamp=None)
    assert out.token_rewards[0].tolist() == [0.0, 1.0, 0.0] and out.token_rewards[2].tolist() == [0.0, 0.0, 0.5]
    assert out.advantages[0, 0].item() == pytest.approx(0.5) and out.advantages[1, 0].item() == pytest.approx(-0.5)
    assert out.advantages[2:].abs().sum() == 0  # equal rewards in the second group


def test_gae_whitened(exp):
    values = [[0.5, 0.25, 0.0], [0.0, 0.0, 0.0], [1.0, 0.5, 0.25], [0.5, 0.0, 0.0]]
    filled = _filled(exp, [1.0, 0.0, 0.5, 0.5], OLD, REF).with_(values=torch.tensor(values))
    out = experience.with_advantages(filled, estimator="gae", whiten=True, group_size=2, gamma=1.0, lam=1.0,
                                     kl_coef=0.0, kl_estimator="k1", kl_clamp=None)
    # gamma = lam = 1: A_t = (sum of rewards from t on) - V_t; returns = A + V (before whitening)
    raw = []
    for b, n in enumerate(LENGTHS):
        row = [[1.0, 0.0, 0.5, 0.5][b] - values[b][t] for t in range(n)]
        raw.append(row)
        assert out.returns[b, :n].tolist() == pytest.approx([row[t] + values[b][t] for t in range(n)])
    flat = [a for row in raw for a in row]
    mean = sum(flat) / len(flat)
    var = sum((a - mean) ** 2 for a in flat) / len(flat)  # population variance
    for b, row in enumerate(raw):
        want = [(a - mean) / math.sqrt(var + 1e-8) for a in row]
        assert out.advantages[b, :len(row)].tolist() == pytest.approx(want, rel=1e-4, abs=1e-5)


def test_whitening_takes_the_statistics_of_the_rows_trained_on(exp):
    """After dynamic sampling drops a group, a whitened estimator's mean and variance are those of the kept rows'
    tokens (DAPO filters before the advantages): their advantages have mean 0 and variance 1, the dropped rows 0."""
    from alignflow.algorithms import get_algorithm

    filled = _filled(exp, [1.0, 0.0, 0.5, 0.5], OLD, REF)
    kept = torch.tensor([0, 1])
    # The specs' own whiten (REINFORCE++'s was False, so the estimator's whitening over every row stood).
    assert get_algorithm("reinforce_pp").whiten and get_algorithm("reinforce_pp_baseline").whiten
    out = experience.with_advantages(filled, estimator="reinforce_pp", whiten=get_algorithm("reinforce_pp").whiten,
                                     group_size=2, gamma=1.0, lam=1.0, kl_coef=0.0, kl_estimator="k1",
                                     kl_clamp=None, rows=kept)
    # REINFORCE++ with gamma 1, no KL: each token's return-to-go is its row's reward
    raw = [[[1.0, 0.0][b]] * LENGTHS[b] for b in (0, 1)]
    flat = [a for row in raw for a in row]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((a - mean) ** 2 for a in flat) / len(flat) + 1e-8)
    for b in (0, 1):
        assert out.advantages[b, :LENGTHS[b]].tolist() == pytest.approx([(a - mean) / std for a in raw[b]], rel=1e-5)
    assert out.advantages[2:].abs().sum() == 0
    every = experience.with_advantages(filled, estimator="reinforce_pp", whiten=True, group_size=2, gamma=1.0,
                                       lam=1.0, kl_coef=0.0, kl_estimator="k1", kl_clamp=None)
    assert not torch.allclose(every.advantages[:2], out.advantages[:2])  # the dropped rows shifted them


def test_sequence_kl_without_old_log_probs_is_the_samplers(exp):
    """On policy no old log-probs are measured; a step that trains no row still reports (and adapts the KL
    coefficient to) the sampler's KL against the reference, not 0."""
    filled = exp.with_(rewards=torch.zeros(4), ref_logprobs=torch.tensor(REF))
    want = [sum(exp.rollout_logprobs[b, t].item() - REF[b][t] for t in range(n)) for b, n in enumerate(LENGTHS)]
    assert experience.sequence_kl(filled).tolist() == pytest.approx(want)


def test_kl_penalty_without_a_reference_is_an_error(exp):
    filled = exp.with_(rewards=torch.zeros(4), old_logprobs=torch.tensor(OLD))
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        experience.with_advantages(filled, estimator="rloo", whiten=False, group_size=2, gamma=1.0, lam=1.0,
                                   kl_coef=0.1, kl_estimator="k1", kl_clamp=None)
    assert experience.sequence_kl(filled).tolist() == [0.0] * 4


def test_sequence_kl(exp):
    kl = experience.sequence_kl(_filled(exp, [0.0] * 4, OLD, REF))
    want = [sum(OLD[b][t] - REF[b][t] for t in range(n)) for b, n in enumerate(LENGTHS)]
    assert kl.tolist() == pytest.approx(want)


def test_best_of_n(exp):
    # prompt 0: rows 0, 1 tie at 1.0 -> the first; prompt 1: row 2 is unfinished, so row 3 wins
    filled = exp.with_(rewards=torch.tensor([1.0, 1.0, 5.0, 0.25]))
    assert experience.best_of_n(filled, None).tolist() == [0, 3]
    assert experience.best_of_n(filled, 0.5).tolist() == [0]
    assert experience.best_of_n(filled, 2.0).tolist() == []


def test_best_of_n_thresholds_the_task_reward_not_the_shaped_one(exp):
    # Normalised within a group of mostly right answers, a right answer (task reward 1) shapes to 0.58.
    filled = exp.with_(rewards=torch.tensor([0.58, -1.7, 5.0, 0.58]), task_rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]))
    assert experience.best_of_n(filled, 1.0).tolist() == [0, 3]
    assert experience.best_of_n(filled, 1.5).tolist() == []


def test_best_of_n_breaks_a_tie_of_clipped_rewards_by_the_task_reward(exp):
    # reward.clip 1: scores 3.2 and 5.0 of prompt 0 both shape to 1.0; the 5.0 wins, not the first row.
    filled = exp.with_(rewards=torch.tensor([1.0, 1.0, 5.0, -1.0]), task_rewards=torch.tensor([3.2, 5.0, 1.0, -3.0]))
    assert experience.best_of_n(filled, None).tolist() == [1, 3]
    # the shaped reward still decides where it differs (a penalty on row 1 puts it below row 0)
    penalised = filled.with_(rewards=torch.tensor([1.0, 0.5, 5.0, -1.0]))
    assert experience.best_of_n(penalised, None).tolist() == [0, 3]


def test_sft_batch_masks_exactly_the_response_tokens(exp):
    batch = experience.sft_batch(exp)
    assert batch["loss_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 1, 0], [0, 0, 1, 1, 1], [0, 0, 1, 0, 0]]
    assert torch.equal(batch["input_ids"], exp.input_ids)
    one_token_prompt = experience.from_rollouts([Rollout(0, [5], [6, 7], "x", [-1.0, -1.0], True),
                                                 Rollout(0, [5], [8], "y", [-1.0], True)], PAD)
    assert experience.sft_batch(one_token_prompt)["loss_mask"].tolist() == [[0, 1, 1], [0, 1, 0]]


def test_rejection_sampling_of_episodes_fine_tunes_on_the_sampled_turns_alone():
    """An episode's winner is fine-tuned on its turns, never on the observations between them (the environment's
    words the model did not write): rejection sampling and online DPO read the action mask, which
    `from_rollouts` takes from `Rollout.sampled`."""
    episode = Rollout(0, [5, 6], [11, 12, 30, 31, 13], "c", [-0.5, -1.0, 0.0, 0.0, -0.25], True,
                      sampled=[1, 1, 0, 0, 1])
    exp = experience.from_rollouts([episode, Rollout(0, [5, 6], [14], "d", [-0.75], True)], PAD)
    assert exp.action_mask.tolist() == [[1, 1, 0, 0, 1], [1, 0, 0, 0, 0]]
    winners = experience.best_of_n(exp.with_(rewards=torch.tensor([1.0, 0.0])), None)
    assert winners.tolist() == [0]
    # input_ids [5, 6, 11, 12, 30, 31, 13]: the loss falls on 11, 12 (turn 1) and 13 (turn 2).
    assert experience.sft_batch(exp.select(winners))["loss_mask"].tolist() == [[0, 0, 1, 1, 0, 0, 1]]


def test_reinforce_pp_baseline_whitens_over_the_kept_groups(exp):
    """Dropped groups' zero returns inflated the kept advantages by 1/sqrt(kept fraction): the spec re-whitens
    over the rows trained on, so the kept tokens' advantages have mean 0 and variance 1."""
    from alignflow.algorithms import get_algorithm

    filled = _filled(exp, [1.0, 1.0, 1.0, 0.0], OLD, REF)  # group 0 constant (dropped), group 1 informative
    kept = torch.tensor([2, 3])
    out = experience.with_advantages(filled, estimator="reinforce_pp_baseline",
                                     whiten=get_algorithm("reinforce_pp_baseline").whiten, group_size=2,
                                     gamma=1.0, lam=1.0, kl_coef=0.0, kl_estimator="k1", kl_clamp=None, rows=kept)
    tokens = torch.cat([out.advantages[b, :LENGTHS[b]] for b in (2, 3)])
    assert tokens.mean().item() == pytest.approx(0.0, abs=1e-5)
    assert tokens.var(unbiased=False).item() == pytest.approx(1.0, rel=1e-4)



def test_dense_step_rewards_reach_the_advantages_of_grpo_and_the_returns_of_reinforce(exp):
    """A dense process reward's steps (`step_rewards` at `step_ends`) beside the sequence rewards [1, 0 | .5, .5]."""
    steps = torch.zeros(4, 3)
    ends = torch.zeros(4, 3)
    for b, t, r in ((0, 0, 1.0), (0, 1, -1.0), (1, 0, 2.0), (2, 2, 0.5), (3, 0, 0.5)):
        steps[b, t], ends[b, t] = r, 1.0
    filled = _filled(exp, [1.0, 0.0, 0.5, 0.5], OLD, REF).with_(step_rewards=steps, step_ends=ends)
    out = experience.with_advantages(filled, estimator="grpo", whiten=False, group_size=2, gamma=1.0, lam=1.0,
                                     kl_coef=0.0, kl_estimator="k3", kl_clamp=None)
    # Outcome: group 0's (1, 0) standardised, (1/sqrt(.5), -1/sqrt(.5)) / ... ; group 1 equal: 0. Process: group 0's
    # step rewards {1, -1, 2} standardised (unbiased std), summed over the steps ending at or after each token;
    # group 1's {.5, .5} equal: 0.
    o = 0.5 / (math.sqrt(0.5) + 1e-6)
    mean, std = 2 / 3, math.sqrt(((1 - 2 / 3) ** 2 + (-1 - 2 / 3) ** 2 + (2 - 2 / 3) ** 2) / 2)
    a, b_, c = ((v - mean) / (std + 1e-6) for v in (1.0, -1.0, 2.0))
    want = [[o + a + b_, o + b_, 0.0], [-o + c, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    torch.testing.assert_close(out.advantages, torch.tensor(want), atol=1e-5, rtol=1e-5)
    rpp = experience.with_advantages(filled, estimator="reinforce_pp", whiten=False, group_size=2, gamma=1.0,
                                     lam=1.0, kl_coef=0.0, kl_estimator="k1", kl_clamp=None)
    # gamma 1: each token's return is the row's reward plus every step reward from that token on.
    want = [[1.0 + 1.0 - 1.0, 1.0 - 1.0, 0.0], [0.0 + 2.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.5 + 0.5, 0.0, 0.0]]
    torch.testing.assert_close(rpp.returns, torch.tensor(want), atol=1e-6, rtol=1e-6)
