"""GMPO, SAPO, GPG and the covariance controls (Clip-Cov, KL-Cov), from the round config to the objective, without
Ray.

The specs' defaults, the settings refused where the surrogate would not read them, the cache key of a round that
uses none of them, and the objectives on a real (tiny) model against values computed here from the formulas.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import algos
from alignflow.config import ConfigError, PPOConfig, RolloutConfig, RoundConfig, cache_relevant, load_config
from engines.rl.updates import PolicyGradientUpdate
from engines.train import objectives


def _round(algorithm: str, **fields) -> RoundConfig:
    return RoundConfig(algorithm=algorithm, generation=RolloutConfig(num_samples=2), **fields)


def _options(cfg: RoundConfig) -> dict:
    """What the update hands the policy objective (PolicyGradientUpdate reads only its config there)."""
    return PolicyGradientUpdate.surrogate_options(SimpleNamespace(cfg=cfg.resolved()))


def test_gmpo_and_sapo_specs_resolve():
    gmpo, sapo = _round("gmpo").resolved(), _round("sapo").resolved()
    assert (gmpo.ppo.clip_low, gmpo.ppo.clip_high, gmpo.ppo.loss_agg, gmpo.spec.policy_loss) == (
        0.4, 0.4, "seq_mean_token_mean", "gmpo_clip")
    assert (sapo.ppo.loss_agg, sapo.kl.apply_as, sapo.kl.estimator, sapo.spec.advantage) == (
        "seq_mean_token_mean", "loss", "k3", "grpo")
    sapo = _options(_round("sapo", ppo=PPOConfig(sapo_temperatures=(0.5, 2.0))))
    assert (sapo["clip_low"], sapo["clip_high"], sapo["dual_clip"]) == (None, None, None)
    assert sapo["surrogate"].func is algos.sapo_policy_loss
    assert sapo["surrogate"].keywords == dict(tau_positive=0.5, tau_negative=2.0)
    assert _options(_round("gmpo")) == dict(clip_low=0.4, clip_high=0.4, dual_clip=None, entropy_fraction=None,
                                            surrogate=algos.gmpo_policy_loss)


def test_gpg_resolves_to_no_kl_no_reference_and_no_clip_unless_a_kl_is_given():
    gpg = _round("gpg").resolved()
    assert (gpg.kl.coef, gpg.uses_reference, gpg.ppo.clip_low, gpg.ppo.clip_high, gpg.ppo.advantage_std_norm) == (
        0.0, False, None, None, False)
    assert _options(_round("gpg")) == dict(clip_low=None, clip_high=None, dual_clip=None, entropy_fraction=None,
                                           surrogate=algos.vanilla_policy_loss)
    with_kl = _round("gpg", kl={"coef": 0.02}).resolved()
    assert (with_kl.kl.coef, with_kl.uses_reference, with_kl.kl.apply_as, with_kl.kl.estimator) == (
        0.02, True, "loss", "k3")
    assert _round("grpo").resolved().kl.coef == 0.05  # every other algorithm keeps 0.05


def test_a_planned_gpg_round_starts_no_reference_unless_given_a_kl_coef():
    """Given as a file's section or an override, 0.05 (every other algorithm's default) included."""
    from tasks.plan import plan_pipeline

    cfg = load_config(None, ['rounds=[{"algorithm": "gpg"}, {"algorithm": "gpg", "kl": {"coef": 0.05}}, '
                             '{"algorithm": "gpg"}, {"algorithm": "grpo"}]', "rounds.2.kl.coef=0.05"])
    stages = plan_pipeline(cfg).stages
    rounds = [stages[f"round_{i}"].config.round for i in (1, 2, 3, 4)]
    assert [(r.kl.coef, r.uses_reference) for r in rounds] == [(0.0, False), (0.05, True), (0.05, True),
                                                               (0.05, True)]
    assert cfg.rounds[0].kl.coef is None and cfg.rounds[0].model_dump()["kl"]["coef"] is None  # a dump keeps "unset"


def test_rounds_of_each_plan_and_resolve_without_a_clip_where_none_is_read():
    """A planned round is its resolved config validated again: SAPO's and KL-Cov's carry no clip range."""
    from tasks.plan import plan_pipeline

    rounds = ('rounds=[{"algorithm": "sapo"}, {"algorithm": "gmpo"}, {"algorithm": "grpo", "ppo": {"covariance": '
              '{"method": "kl_cov"}}}, {"algorithm": "rloo", "ppo": {"covariance": {"method": "clip_cov"}}}]')
    stages = plan_pipeline(load_config(None, [rounds])).stages
    ppo = [stages[f"round_{i}"].config.round.ppo for i in (1, 2, 3, 4)]
    assert [(p.clip_low, p.clip_high) for p in ppo] == [(None, None), (0.4, 0.4), (None, None), (0.2, 0.2)]


@pytest.mark.parametrize("round_json,error", [
    ('{"algorithm": "sapo", "ppo": {"clip_high": 0.28}}', r"ppo\.clip_high: sapo has no clip here, its soft gate"),
    ('{"algorithm": "grpo", "ppo": {"sapo_temperatures": [1, 2]}}', r"ppo\.sapo_temperatures is read by algorithm "
     r"sapo; this round's is grpo"),
    ('{"algorithm": "sapo", "ppo": {"sapo_temperatures": [1, 0]}}', r"ppo\.sapo_temperatures must be > 0"),
    ('{"algorithm": "gmpo", "ppo": {"dual_clip": 3}}', r"gmpo clips each token's log-ratio"),
    ('{"algorithm": "gspo", "ppo": {"covariance": {"method": "clip_cov"}}}', r"ppo\.covariance \(clip_cov\) acts on "
     r"PPO's token-ratio surrogate; gspo's is gspo_clip"),
    ('{"algorithm": "grpo", "ppo": {"covariance": {"method": "kl_cov"}, "clip_low": 0.1}}',
     r"ppo\.clip_low: grpo has no clip here, ppo\.covariance kl_cov takes the clip's place"),
    ('{"algorithm": "grpo", "ppo": {"covariance": {"method": "kl_cov", "bounds": [0, 9]}}}',
     r"ppo\.covariance\.bounds is not read by kl_cov"),
    ('{"algorithm": "grpo", "ppo": {"covariance": {"method": "clip_cov", "kl_coef": 2}}}',
     r"ppo\.covariance\.kl_coef is not read by clip_cov"),
    ('{"algorithm": "grpo", "ppo": {"covariance": {"method": "clip_cov", "bounds": [5, 1]}}}',
     r"bounds must be \[low, high\] with low < high"),
    ('{"algorithm": "grpo", "ppo": {"covariance": {"method": "clip_cov", "fraction": 2}}}', r"fraction"),
    ('{"algorithm": "gpg", "ppo": {"clip_high": 0.28}}', r"ppo\.clip_high: gpg has no clip here, its plain policy "
     r"gradient has no ratio to clip"),
    ('{"algorithm": "gpg", "ppo": {"dynamic_sampling": true}}', r"gpg scales its advantages by all rows over those "
     r"that carry a gradient.*leave dynamic sampling out"),
    ('{"algorithm": "gpg", "kl": {"adaptive": true}}', r"kl\.adaptive scales kl\.coef, and gpg trains with no KL "
     r"term by default"),
    ('{"algorithm": "gpg", "reference": "sft"}', r"reference: gpg reads none with kl\.coef 0"),
    ('{"algorithm": "gpg", "ppo": {"covariance": {"method": "clip_cov"}}}', r"gpg's is vanilla"),
])
def test_settings_the_surrogate_would_not_read_are_refused(round_json, error):
    with pytest.raises(ConfigError, match=r"rounds\.0"):
        load_config(None, [f"rounds=[{round_json}]"])
    with pytest.raises(ConfigError, match=error):
        load_config(None, [f"rounds=[{round_json}]"])


def test_a_round_without_them_keeps_its_cache_key():
    """The two fields came after published keys: at their defaults they are left out of a round's key."""
    plain = cache_relevant(_round("grpo"))
    assert not {"covariance", "sapo_temperatures", "high_entropy_fraction"} & set(plain["ppo"])
    assert "reference" not in plain
    assert cache_relevant(_round("grpo", ppo=PPOConfig(high_entropy_fraction=0.2)))["ppo"][
        "high_entropy_fraction"] == 0.2
    cov = cache_relevant(_round("grpo", ppo=PPOConfig(covariance={"method": "kl_cov"})))["ppo"]
    assert cov["covariance"] == {"method": "kl_cov", "fraction": None, "bounds": [1.0, 5.0], "kl_coef": 1.0}
    assert cache_relevant(_round("sapo", ppo=PPOConfig(sapo_temperatures=(1.0, 2.0))))["ppo"][
        "sapo_temperatures"] == [1.0, 2.0]


def test_covariance_options_carry_the_papers_share():
    kl = _options(_round("grpo", ppo=PPOConfig(covariance={"method": "kl_cov", "kl_coef": 0.5})))
    assert (kl["clip_low"], kl["clip_high"], kl["dual_clip"]) == (None, None, None)
    assert kl["surrogate"].func is algos.kl_cov_policy_loss and kl["surrogate"].keywords == dict(fraction=2e-3,
                                                                                                 kl_coef=0.5)
    clip = _round("grpo", ppo=PPOConfig(covariance={"method": "clip_cov", "bounds": (0.5, 4.0)}))
    options = _options(clip)
    assert options["clip_low"] == 0.2 and options["surrogate"].func is algos.clip_cov_policy_loss
    assert options["surrogate"].keywords == dict(fraction=2e-4, bounds=(0.5, 4.0))  # torch's own draw


# ---- the objectives on a real (tiny) model ----------------------------------------------------------------


COMMON = dict(entropy_coef=0.0, kl_loss_coef=0.0, kl_estimator="k3", kl_clamp=None, tis_cap=None)
SHIFT = torch.tensor([[0.1, 0.5, -0.2], [0.6, -0.7, 0.0]])  # log pi - log pi_old; row 1 has two tokens


def _batch(exp, logprobs, advantages):
    mask = exp.action_mask
    return exp.with_(old_logprobs=(logprobs - SHIFT) * mask, advantages=advantages * mask).tensors()


def test_gmpo_objective_reads_the_geometric_mean(policy_batch):
    model, exp, logprobs = policy_batch
    batch = _batch(exp, logprobs, torch.tensor([[1.0], [-2.0]]))
    loss, metrics = objectives.policy_objective(model, batch, **_options(_round("gmpo")),
                                                          agg="seq_mean_token_mean", **COMMON)
    row0 = math.exp((0.1 + 0.4 - 0.2) / 3)  # 0.5 clipped down to 0.4 where A > 0
    row1 = math.exp((0.6 - 0.4) / 2)  # -0.7 lifted to -0.4 where A < 0
    assert loss.item() == pytest.approx(-(row0 - 2 * row1) / 2, rel=1e-4)
    assert metrics["clip_fraction"] == pytest.approx((2.0, 5.0))


def test_sapo_objective_reads_the_gate(policy_batch):
    model, exp, logprobs = policy_batch
    batch = _batch(exp, logprobs, torch.tensor([[1.0], [-1.0]]))
    loss, _ = objectives.policy_objective(model, batch, **_options(_round("sapo")),
                                                    agg="token_mean", **COMMON)

    def gate(x: float, a: float) -> float:
        tau = 1.0 if a > 0 else 1.05
        return -4 / tau / (1 + math.exp(-tau * (math.exp(x) - 1))) * a

    expect = [gate(x, 1.0) for x in (0.1, 0.5, -0.2)] + [gate(x, -1.0) for x in (0.6, -0.7)]
    assert loss.item() == pytest.approx(sum(expect) / 5, rel=1e-4)


def test_gpg_objective_is_the_plain_policy_gradient(policy_batch):
    """Value -mean A over the 5 tokens whatever the ratios; the gradient of the policy's log-probs, no clip."""
    model, exp, logprobs = policy_batch
    batch = _batch(exp, logprobs, torch.tensor([[3.0], [-1.0]]))
    model.zero_grad()
    loss, metrics = objectives.policy_objective(model, batch, **_options(_round("gpg")), agg="token_mean", **COMMON)
    assert loss.item() == pytest.approx(-(3 * 3.0 - 2 * 1.0) / 5, rel=1e-5)
    assert metrics["clip_fraction"] == pytest.approx((0.0, 5.0))
    loss.backward()
    grad = model.lm_head.weight.grad.clone()
    model.zero_grad()  # the same gradient from -sum A log pi / 5, written out
    lp = objectives.response_logprobs_and_entropy(model, batch, with_entropy=False)[0]
    (-(batch["advantages"] * lp * batch["action_mask"]).sum() / 5).backward()
    assert torch.allclose(grad, model.lm_head.weight.grad, atol=1e-6)


def test_kl_cov_through_the_policy_objective_logs_its_share(policy_batch):
    model, exp, logprobs = policy_batch
    batch = _batch(exp, logprobs, torch.tensor([[1.0], [-1.0]]))
    cfg = _round("grpo", ppo=PPOConfig(covariance={"method": "kl_cov", "fraction": 0.2}))  # k = 1 of 5
    model.zero_grad()
    loss, metrics = objectives.policy_objective(model, batch, **_options(cfg), agg="token_mean", **COMMON)
    loss.backward()
    assert metrics["cov_fraction"] == pytest.approx((1.0, 5.0))
    unclipped = -(sum(math.exp(x) for x in (0.1, 0.5, -0.2)) - sum(math.exp(x) for x in (0.6, -0.7)))
    penalty = loss.item() * 5 - unclipped  # |x| of the one token picked, times kl_coef 1
    assert any(penalty == pytest.approx(abs(x), rel=1e-3) for x in (0.1, 0.5, 0.2, 0.6, 0.7))
    assert model.lm_head.weight.grad.norm() > 0


def test_the_high_entropy_share_trains_the_surrogate_on_its_tokens_alone(policy_batch):
    """0.4 of the 5 tokens: the 2 whose entropy (from a plain forward here) is highest carry the surrogate, over
    all five tokens' count; the KL term would keep all five."""
    model, exp, logprobs = policy_batch
    batch = _batch(exp, logprobs, torch.tensor([[1.0], [1.0]]))
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    picked = torch.gather(logits, 1, batch["response_index"].unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    logp = torch.log_softmax(picked, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    valid = [(entropy[i, j].item(), (i, j)) for i in range(2) for j in range(3) if exp.action_mask[i, j]]
    top = [ij for _, ij in sorted(valid, reverse=True)[:2]]
    cfg = _round("grpo", ppo=PPOConfig(high_entropy_fraction=0.4))
    loss, metrics = objectives.policy_objective(model, batch, **_options(cfg), agg="token_mean", **COMMON)
    ratio = [[math.exp(x) for x in row] for row in SHIFT.tolist()]
    # A = 1: the clip at 1 + 0.2 caps e^0.5 and e^0.6; the other tokens' terms are 0, still counted
    expect = -sum(min(ratio[i][j], 1.2) for i, j in top) / 5
    assert loss.item() == pytest.approx(expect, rel=1e-4)
    assert metrics["pg_token_fraction"] == pytest.approx((2.0, 5.0))
