"""The algorithm library's options, from the round config to the computation, without Ray.

GSPO (its spec's defaults and its objective), IcePop masking in the policy
objective, reward normalisation / clipping / truncation penalty, the group
std switch and the group-mean-range filter. Expected values are computed
here by hand from the formulas, never by calling the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from alignflow.config import ConfigError, PPOConfig, RewardConfig, RolloutConfig, RoundConfig, load_config
from engines.rl import experience
from engines.rl.experience import kept_rows
from engines.rollout.base import Rollout
from engines.train import objectives


def _round(algorithm: str, **fields) -> RoundConfig:
    return RoundConfig(algorithm=algorithm, generation=RolloutConfig(num_samples=2), **fields)


# ---- config: defaults by algorithm, overrides, errors naming the field ------------------


def test_gspo_spec_defaults_resolve_and_can_be_overridden():
    gspo = _round("gspo").resolved()
    assert (gspo.ppo.clip_low, gspo.ppo.clip_high, gspo.ppo.loss_agg, gspo.ppo.advantage_std_norm) == (
        3e-4, 4e-4, "seq_mean_token_mean", True)
    assert (gspo.kl.apply_as, gspo.kl.estimator, gspo.spec.advantage, gspo.spec.policy_loss) == (
        "loss", "k3", "grpo", "gspo_clip")
    mine = _round("gspo", ppo=PPOConfig(clip_high=1e-3, loss_agg="token_mean", advantage_std_norm=False)).resolved()
    assert (mine.ppo.clip_low, mine.ppo.clip_high, mine.ppo.loss_agg, mine.ppo.advantage_std_norm) == (
        3e-4, 1e-3, "token_mean", False)


def test_cispo_spec_defaults_and_its_clip_range():
    """CISPO's weight is clipped to [1 - clip_low, 1 + clip_high] = [0, 6] by default (no lower bound); a clip_high
    under clip_low is its own range (DAPO's clip-higher order is PPO's), and a dual clip has nothing to cap."""
    cispo = _round("cispo").resolved()
    assert (cispo.ppo.clip_low, cispo.ppo.clip_high, cispo.ppo.loss_agg, cispo.ppo.advantage_std_norm) == (
        1.0, 5.0, "token_mean", True)
    assert (cispo.kl.apply_as, cispo.kl.estimator, cispo.spec.advantage, cispo.spec.policy_loss) == (
        "loss", "k3", "grpo", "cispo")
    assert _round("cispo", ppo=PPOConfig(clip_high=0.28)).resolved().ppo.clip_high == 0.28
    with pytest.raises(ConfigError, match=r"rounds\.0: .*ppo\.dual_clip caps PPO's clipped surrogate; cispo has none"):
        load_config(None, ['rounds=[{"algorithm": "cispo", "ppo": {"dual_clip": 3.0}}]'])


def test_defaults_of_the_other_algorithms_are_unchanged():
    for name, std_norm in (("ppo", None), ("grpo", True), ("dr_grpo", False), ("rloo", None)):
        cfg = _round(name).resolved()
        assert (cfg.ppo.clip_low, cfg.ppo.clip_high, cfg.ppo.advantage_std_norm) == (0.2, 0.2, std_norm), name
        assert (cfg.ppo.tis_cap, cfg.ppo.tis_mode, cfg.ppo.tis_low) == (2.0, "truncate", None)
        assert cfg.ppo.dynamic_sampling_mean_range is None
        assert (cfg.reward.normalize, cfg.reward.clip, cfg.reward.truncation_penalty) == (False, None, 0.0)


@pytest.mark.parametrize("round_yaml,match", [
    ('{"algorithm": "gspo", "ppo": {"clip_low": 0.2}}', r"rounds\.0: .*ppo\.clip_high \(0\.0004\) must be >= ppo\.clip_low \(0\.2\)"),
    ('{"algorithm": "ppo", "ppo": {"advantage_std_norm": true}}', r"rounds\.0: .*ppo\.advantage_std_norm: ppo has no group"),
    ('{"algorithm": "grpo", "ppo": {"tis_cap": null, "tis_mode": "mask"}}', r"rounds\.0\.ppo: .*need ppo\.tis_cap"),
    ('{"algorithm": "grpo", "ppo": {"tis_cap": 2.0, "tis_low": 2.0}}', r"rounds\.0\.ppo: .*tis_low \(2\.0\) must be < ppo\.tis_cap"),
    ('{"algorithm": "grpo", "ppo": {"tis_mode": "drop"}}', r"rounds\.0\.ppo\.tis_mode"),
    ('{"algorithm": "grpo", "ppo": {"tis_cap": null, "tis_level": "sequence"}}', r"rounds\.0\.ppo: .*tis_level / ppo\.tis_veto "
     r"need ppo\.tis_cap"),
    ('{"algorithm": "grpo", "ppo": {"tis_level": "row"}}', r"rounds\.0\.ppo\.tis_level"),
    ('{"algorithm": "grpo", "ppo": {"tis_cap": null, "tis_veto": 0.001}}', r"rounds\.0\.ppo: .*tis_veto need "
     r"ppo\.tis_cap"),
    ('{"algorithm": "grpo", "ppo": {"tis_veto": 1.5}}', r"rounds\.0\.ppo\.tis_veto"),
    ('{"algorithm": "grpo", "ppo": {"dynamic_sampling_mean_range": [0.9, 0.1]}}',
     r"rounds\.0\.ppo: .*dynamic_sampling_mean_range must be \[low, high\]"),
    ('{"algorithm": "grpo", "ppo": {"dynamic_sampling_mean_range": [0.1]}}', r"rounds\.0\.ppo\.dynamic_sampling_mean_range"),
    ('{"algorithm": "ppo", "ppo": {"dynamic_sampling": true}, "generation": {"num_samples": 1}}',
     r"rounds\.0: .*with generation\.num_samples 1 every group is one sample"),
    ('{"algorithm": "ppo", "ppo": {"dynamic_sampling": true, "dynamic_sampling_mean_range": [-5, 5]}, '
     '"generation": {"num_samples": 1}}', r"rounds\.0: .*with generation\.num_samples 1 every group is one sample"),
    ('{"algorithm": "grpo", "reward": {"clip": 0}}', r"rounds\.0\.reward\.clip"),
    ('{"algorithm": "grpo", "reward": {"truncation_penalty": -1}}', r"rounds\.0\.reward\.truncation_penalty"),
])
def test_invalid_options_name_their_field(round_yaml, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [f"rounds=[{round_yaml}]"])


def test_a_mean_range_filters_single_samples():
    """One sample a prompt: its group's mean is its own reward, so a mean range drops the rows outside it (a reward
    model's outliers, say) and keeps the rest; only dynamic_sampling's all-equal groups would drop every row."""
    cfg = load_config(None, ['rounds=[{"algorithm": "ppo", "ppo": {"dynamic_sampling_mean_range": [-5, 5]}, '
                             '"generation": {"num_samples": 1}}]']).rounds[0]
    rows, metrics = kept_rows(torch.tensor([0.5, 9.0, -1.0]), cfg)
    assert rows.tolist() == [0, 2] and metrics["dynamic_sampling/dropped_groups_mean_range"] == 1.0


def test_options_load_from_yaml():
    cfg = load_config(None, ['rounds=[{"algorithm": "gspo", "reward": {"normalize": true, "clip": 3.0, '
                             '"truncation_penalty": 0.5}, "ppo": {"tis_mode": "mask", "tis_low": 0.5, "tis_cap": 5.0, '
                             '"dynamic_sampling_mean_range": [0.1, 0.9]}}]']).rounds[0]
    assert (cfg.reward.normalize, cfg.reward.clip, cfg.reward.truncation_penalty) == (True, 3.0, 0.5)
    assert (cfg.ppo.tis_mode, cfg.ppo.tis_low, cfg.ppo.tis_cap) == ("mask", 0.5, 5.0)
    assert cfg.ppo.dynamic_sampling_mean_range == (0.1, 0.9)


# ---- rewards: normalise, clip, overlong, truncation ---------------------------------------


def _exp():
    """Two prompts x two samples; response lengths 2, 1, 3, 1; the third sample hit the limit."""
    return experience.from_rollouts([
        Rollout(0, [5, 6, 7], [11, 12], "a", [-0.5, -1.0], True),
        Rollout(0, [5, 6, 7], [13], "b", [-0.25], True),
        Rollout(1, [8, 9], [14, 15, 16], "c", [-1.0, -2.0, -0.5], False),
        Rollout(1, [8, 9], [17], "d", [-0.75], True),
    ], pad_id=0)


def test_default_reward_shaping_is_the_task_reward():
    exp, task = _exp(), torch.tensor([1.0, 0.0, 3.0, -1.0])
    out = experience.shape_rewards(task, exp.action_mask, exp.finished, max_response_tokens=3, overlong_buffer=0,
                                   overlong_penalty=1.0)
    assert torch.equal(out.rewards, task) and out.stats is None
    assert out.metrics == {"reward/task_mean": 0.75, "reward/truncated": 1.0, "reward/clipped": 0.0}


def test_normalise_clip_overlong_truncation_in_order():
    import algos

    exp, task = _exp(), torch.tensor([1.0, 0.0, 3.0, -1.0])
    kw = dict(max_response_tokens=3, overlong_buffer=2, overlong_penalty=0.5, truncation_penalty=0.25, clip=1.0)
    out = experience.shape_rewards(task, exp.action_mask, exp.finished, stats=algos.RunningMeanStd(), **kw)
    mean = 0.75
    var = sum((x - mean) ** 2 for x in (1.0, 0.0, 3.0, -1.0)) / 4  # 2.1875
    norm = [(x - mean) / math.sqrt(var + 1e-8) for x in (1.0, 0.0, 3.0, -1.0)]  # 0.169, -0.507, 1.521, -1.183
    clipped = [max(-1.0, min(1.0, x)) for x in norm]
    overlong = [(1 - 2) / 2 * 0.5, 0.0, (1 - 3) / 2 * 0.5, 0.0]  # L = 3, C = 2, lengths 2, 1, 3, 1
    truncated = [0.0, 0.0, -0.25, 0.0]
    assert out.rewards.tolist() == pytest.approx([c + o + t for c, o, t in zip(clipped, overlong, truncated)])
    assert out.metrics["reward/clipped"] == 2.0 and out.metrics["reward/truncated"] == 1.0
    assert out.metrics["reward/running_mean"] == pytest.approx(mean)
    assert out.metrics["reward/running_std"] == pytest.approx(math.sqrt(var))
    # the next step: statistics over all eight rewards so far
    later = experience.shape_rewards(torch.tensor([2.0, 2.0, 2.0, 2.0]), exp.action_mask, exp.finished,
                                     stats=out.stats, **kw)
    values = [1.0, 0.0, 3.0, -1.0, 2.0, 2.0, 2.0, 2.0]
    mean8 = sum(values) / 8
    var8 = sum((x - mean8) ** 2 for x in values) / 8
    assert later.metrics["reward/running_mean"] == pytest.approx(mean8)
    assert later.metrics["reward/running_std"] == pytest.approx(math.sqrt(var8))
    assert later.rewards[1].item() == pytest.approx((2.0 - mean8) / math.sqrt(var8 + 1e-8))


# ---- advantages: the group std switch ---------------------------------------------------


def test_group_std_switch_reaches_the_estimator():
    exp = _exp().with_(rewards=torch.tensor([1.0, 0.0, 0.5, 0.0]))
    common = dict(whiten=False, group_size=2, gamma=1.0, lam=1.0, kl_coef=0.0, kl_estimator="k1", kl_clamp=None)
    centered = experience.with_advantages(exp, estimator="grpo", std_norm=False, **common)
    # groups (1, 0) and (0.5, 0): reward minus the group mean, on every response token
    torch.testing.assert_close(centered.advantages, torch.tensor(
        [[0.5, 0.5, 0.0], [-0.5, 0.0, 0.0], [0.25, 0.25, 0.25], [-0.25, 0.0, 0.0]]))
    normalised = experience.with_advantages(exp, estimator="dr_grpo", std_norm=True, **common)
    a, b = 0.5 / (math.sqrt(0.5) + 1e-6), 0.25 / (math.sqrt(0.125) + 1e-6)  # unbiased std of (1, 0), (0.5, 0)
    torch.testing.assert_close(normalised.advantages, torch.tensor(
        [[a, a, 0.0], [-a, 0.0, 0.0], [b, b, b], [-b, 0.0, 0.0]]))


# ---- dynamic sampling: constant groups, then the mean range --------------------------------


def test_kept_rows_constant_groups_then_mean_range():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.9])  # group means 1, 0.5, 0, 0.95
    both = _round("grpo", ppo=PPOConfig(dynamic_sampling=True, dynamic_sampling_mean_range=(0.2, 0.8)))
    rows, metrics = kept_rows(rewards, both)
    assert rows.tolist() == [2, 3]
    # constant groups 0 and 2; of the rest, group 3 (mean 0.95) is out of range
    assert metrics == {"dynamic_sampling/dropped_groups": 2.0, "dynamic_sampling/dropped_groups_mean_range": 1.0}
    rows, metrics = kept_rows(rewards, _round("grpo", ppo=PPOConfig(dynamic_sampling_mean_range=(0.2, 0.8))))
    assert rows.tolist() == [2, 3]
    assert metrics == {"dynamic_sampling/dropped_groups": 0.0, "dynamic_sampling/dropped_groups_mean_range": 3.0}
    rows, metrics = kept_rows(rewards, _round("grpo"))
    assert rows.tolist() == list(range(8)) and set(metrics.values()) == {0.0}


def test_the_mean_range_reads_the_task_rewards_not_the_shaped_ones():
    """reward.normalize (or clip, penalties) moves the shaped rewards; the pass-rate range reads the task's."""
    task = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])  # group means 0.5, 1, 0
    shaped = (task - task.mean()) / task.std()  # normalised: every group mean is off [0.2, 0.8] but group 0's
    cfg = RoundConfig(algorithm="grpo", generation=RolloutConfig(num_samples=2),
                      ppo=PPOConfig(dynamic_sampling_mean_range=(0.2, 0.8)))
    rows, metrics = kept_rows(shaped, cfg, task_rewards=task)
    assert rows.tolist() == [0, 1] and metrics["dynamic_sampling/dropped_groups_mean_range"] == 2.0


def test_constant_groups_are_read_from_the_task_rewards_as_dapo_reads_accuracy():
    """An all-right group whose overlong penalty spreads its shaped rewards is still constant in accuracy:
    dropped. A group the task splits stays, whatever the shaping."""
    task = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])  # groups: all right, split, all wrong
    shaped = task + torch.tensor([0.0, -0.4, 0.0, 0.0, -0.2, 0.0])  # penalties on two long responses
    cfg = RoundConfig(algorithm="grpo", generation=RolloutConfig(num_samples=2), ppo=PPOConfig(dynamic_sampling=True))
    rows, metrics = kept_rows(shaped, cfg, task_rewards=task)
    assert rows.tolist() == [2, 3] and metrics["dynamic_sampling/dropped_groups"] == 2.0
    rows, _ = kept_rows(shaped, cfg)  # no task rewards given: the rewards are the task's
    assert rows.tolist() == [0, 1, 2, 3, 4, 5]


# ---- the policy objectives on a real (tiny) model ------------------------------------------


COMMON = dict(dual_clip=None, entropy_coef=0.0, kl_loss_coef=0.0, kl_estimator="k3", kl_clamp=None)


def test_gspo_objective_clips_whole_sequences(policy_batch):
    model, exp, logprobs = policy_batch
    mask = exp.action_mask
    # old = new - log(1.0002) on row 0 (every token ratio 1.0002), new - 0.5 on row 1 (ratio e^0.5)
    shift = torch.tensor([[math.log(1.0002)] * 3, [0.5, 0.5, 0.0]])
    batch = exp.with_(old_logprobs=(logprobs - shift) * mask, advantages=mask.clone()).tensors()
    loss, metrics = objectives.policy_objective(model, batch, clip_low=3e-4, clip_high=4e-4, agg="seq_mean_token_mean",
                                                tis_cap=None, surrogate=objectives.SURROGATES["gspo_clip"], **COMMON)
    # row 0: s = 1.0002 inside [1 - 3e-4, 1 + 4e-4]; row 1: s = e^0.5 clipped to 1 + 4e-4; A = 1
    assert loss.item() == pytest.approx(-(1.0002 + 1.0004) / 2, rel=1e-5)
    assert metrics["clip_fraction"] == pytest.approx((2.0, 5.0))  # (clipped tokens, tokens)
    # the token-ratio PPO loss on the same batch: row 1 clipped at 1.2 per token, token mean
    loss, metrics = objectives.policy_objective(model, batch, clip_low=0.2, clip_high=0.2, agg="token_mean",
                                                tis_cap=None, **COMMON)
    assert loss.item() == pytest.approx(-(3 * 1.0002 + 2 * 1.2) / 5, rel=1e-5)


def test_cispo_objective_keeps_the_gradient_of_tokens_past_the_clip(policy_batch):
    """Through the model: ratios 1.0002 | e^0.5 (row 1's two tokens) with clip_high 0.2: PPO's clip zeroes those
    tokens' gradient; CISPO weighs it by 1.2 and its loss reads -w A per token."""
    model, exp, logprobs = policy_batch
    mask = exp.action_mask
    shift = torch.tensor([[math.log(1.0002)] * 3, [0.5, 0.5, 0.0]])
    batch = exp.with_(old_logprobs=(logprobs - shift) * mask, advantages=mask.clone()).tensors()
    losses = {}
    for name in ("cispo", "ppo_clip"):
        model.zero_grad()
        loss, metrics = objectives.policy_objective(model, batch, clip_low=0.2, clip_high=0.2, agg="token_mean",
                                                    tis_cap=None, surrogate=objectives.SURROGATES[name], **COMMON)
        loss.backward()
        losses[name] = (loss.item(), metrics["clip_fraction"], model.lm_head.weight.grad.norm().item())
    # the same value as PPO's here (A > 0: both read -1.2 A past the clip), not the same gradient
    assert losses["cispo"][0] == pytest.approx(-(3 * 1.0002 + 2 * 1.2) / 5, rel=1e-5) == losses["ppo_clip"][0]
    assert losses["cispo"][1] == pytest.approx((2.0, 5.0)) and losses["ppo_clip"][1] == pytest.approx((2.0, 5.0))
    assert losses["cispo"][2] > losses["ppo_clip"][2] > 0  # the clipped tokens still pull under CISPO


@pytest.mark.parametrize("mode,weights,masked", [
    ("mask", [1.0, 0.0, 0.0, 1.5, 1.0], 2 / 5),
    ("truncate", [1.0, 2.0, 0.5, 1.5, 1.0], 0.0),
])
def test_rollout_importance_modes_in_the_policy_objective(policy_batch, mode, weights, masked):
    model, exp, logprobs = policy_batch
    mask = exp.action_mask
    # old = new (ratio 1), A = 1; old - rollout = log rho with rho 1, 3, 0.25 | 1.5, 1
    rho = torch.tensor([[1.0, 3.0, 0.25], [1.5, 1.0, 1.0]])
    batch = exp.with_(old_logprobs=logprobs, advantages=mask.clone(),
                      rollout_logprobs=(logprobs - torch.log(rho)) * mask).tensors()
    loss, metrics = objectives.policy_objective(model, batch, clip_low=0.2, clip_high=0.2, agg="token_mean",
                                                tis_cap=2.0, tis_low=0.5, tis_mode=mode, **COMMON)
    assert loss.item() == pytest.approx(-sum(weights) / 5, rel=1e-5)
    assert metrics["tis_masked_fraction"] == pytest.approx((masked * 5, 5.0))  # (sum, count) over the 5 tokens
    assert metrics["tis_weight_mean"] == pytest.approx((sum(weights), 5.0), rel=1e-5)


def test_the_sequence_level_weighs_each_response_by_its_own_ratio_through_the_round(policy_batch):
    """ppo.tis_level reaches the objective from the round's update; row 0's ratio 1 x 3 x 0.25 = 0.75, row 1's
    1.5 x 1 = 1.5, each on every token of its row; a config left at token keeps its key."""
    from types import SimpleNamespace

    from alignflow.config import PPOConfig, RolloutConfig, RoundConfig, cache_relevant
    from engines.rl.updates import PolicyGradientUpdate

    model, exp, logprobs = policy_batch
    mask = exp.action_mask
    rho = torch.tensor([[1.0, 3.0, 0.25], [1.5, 1.0, 1.0]])
    batch = exp.with_(old_logprobs=logprobs, advantages=mask.clone(),
                      rollout_logprobs=(logprobs - torch.log(rho)) * mask).tensors()
    cfg = RoundConfig(algorithm="grpo", generation=RolloutConfig(num_samples=2), kl={"coef": 0.0},
                      ppo=PPOConfig(tis_level="sequence", tis_veto=0.1, entropy_coef=0.0)).resolved()
    update = SimpleNamespace(cfg=cfg, kl_ctl=SimpleNamespace(value=0.0), on_policy=lambda c: False,
                             models=SimpleNamespace(actor="actor", critic=None),
                             surrogate_options=lambda: PolicyGradientUpdate.surrogate_options(SimpleNamespace(cfg=cfg)))
    [(_, objective, _)] = PolicyGradientUpdate.objectives(update, frozen=False)
    assert (objective.keywords["tis_level"], objective.keywords["tis_veto"]) == ("sequence", 0.1)
    loss, _ = objective(model, batch)
    assert loss.item() == pytest.approx(-(3 * 0.75 + 2 * 1.5) / 5, rel=1e-5)  # no token's ratio below 0.1
    assert not {"tis_level", "tis_veto"} & set(cache_relevant(PPOConfig()))
    assert cache_relevant(PPOConfig(tis_level="geometric", tis_veto=1e-4))["tis_veto"] == 1e-4


def test_an_asynchronous_distillation_round_measures_the_students_log_probs_before_its_step():
    """A step that is one optimizer step skips the old log-probs' forward (the training forward's own serve), and
    a distillation round's teacher then pulls at the sampler's log-probs. An asynchronous round's sampler is
    versions behind the student the step trains, so it measures them: log pi_T - log pi_stale is not the
    reverse KL of the policy it trains."""
    from engines.rl.updates import PolicyGradientUpdate

    def round_(algorithm, **kw):
        return RoundConfig(algorithm=algorithm, teacher="t" if algorithm == "distill" else None, prompts_per_step=8,
                           generation=RolloutConfig(num_samples=4), ppo=PPOConfig(minibatch_size=32, epochs=1),
                           **kw).resolved()

    on_policy = PolicyGradientUpdate.on_policy
    assert on_policy(round_("distill")) and on_policy(round_("grpo", async_rollouts=True))
    assert not on_policy(round_("distill", async_rollouts=True))
