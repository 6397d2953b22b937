"""RL algorithms as specs: what a round needs and which math it runs.

An RL round reads its algorithm's spec and never branches on the name:

- `update`: how the policy learns from a step's experience. "policy_gradient"
  (advantages, then clipped-surrogate epochs over minibatches) or
  "best_of_n_sft" (keep the best finished response per prompt, fine-tune on
  those: rejection sampling), or "online_dpo" (per prompt the best sample
  against the worst, then DPO steps against the round's reference).
- `advantage`: an estimator of the `algos` advantage registry; `whiten`
  whitens its output over the rows the step trains on (PPO's GAE; REINFORCE++'s,
  which its estimator whitens over every row, dynamic sampling's dropped ones too).
- the models it needs: a critic (values for GAE), the reference policy
  (for the KL term), and whether rewards must come in groups of at least
  `min_samples` samples per prompt (group baselines).
- defaults for where the KL term goes (`kl_apply_as`: added to the reward
  per token, or added to the loss) with which estimator, the loss
  aggregation, the clip range of the surrogate, and whether group
  advantages are divided by the group std (`group_std_norm`; None: the
  estimator has no group std to switch); a round's config may override each.
- `teacher`: the round's frozen log-prob model is a teacher (`rounds[i].teacher`) instead of the
  reference, and each sampled token's advantage is its negative reverse KL to it (on-policy
  distillation, `algos/losses/distill.py`); there is no KL term besides.
- `policy_loss`: the surrogate (engines/train/objectives.py `SURROGATES`): "ppo_clip" (token ratios),
  "gspo_clip" (sequence ratios), "cispo" (clipped, detached token weights), "gmpo_clip" (the geometric mean of
  token ratios, clipped in log space: clip_low / clip_high are of log r), "sapo_gate" (a soft gate, no clip) or
  "vanilla" (the plain policy gradient, no ratio and no clip).
- `kl_coef`: the default of `kl.coef` (0.05; GPG's 0, its paper training with no KL term: no reference model is
  started unless the round gives one).

Adding an algorithm is one `register_algorithm` entry here, plus its math in
`algos/` when it needs new math. Kept free of torch: configs import it to
validate `rounds[*].algorithm` in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from alignflow.errors import ConfigError

Update = Literal["policy_gradient", "best_of_n_sft", "online_dpo"]
KLPlacement = Literal["reward", "loss"]
KLEstimator = Literal["k1", "k2", "k3"]
LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str
    summary: str
    update: Update
    advantage: str | None = None  # `algos` advantage estimator (policy_gradient only)
    whiten: bool = False
    critic: bool = False
    reference: bool = True
    reference_in_update: bool = False  # the update itself reads the reference (DPO), whatever the KL coefficient
    min_samples: int = 1
    policy_loss: str = "ppo_clip"
    kl_apply_as: KLPlacement = "reward"
    kl_estimator: KLEstimator = "k1"
    loss_agg: LossAggregation = "token_mean"
    clip_low: float = 0.2
    clip_high: float = 0.2
    group_std_norm: bool | None = None  # default of `ppo.advantage_std_norm`; None: nothing to switch
    kl_coef: float = 0.05  # the default of kl.coef
    teacher: bool = False  # distillation: the frozen log-prob model is `rounds[i].teacher`, its pull the advantage


_REGISTRY: dict[str, AlgorithmSpec] = {}
ALGORITHMS = MappingProxyType(_REGISTRY)


def register_algorithm(spec: AlgorithmSpec) -> AlgorithmSpec:
    if spec.name in _REGISTRY:
        raise ValueError(f"algorithm {spec.name!r} is already registered")
    if spec.update == "policy_gradient" and spec.advantage is None:
        raise ValueError(f"algorithm {spec.name!r}: a policy-gradient update needs an advantage estimator")
    if spec.update != "policy_gradient" and spec.advantage is not None:
        raise ValueError(f"algorithm {spec.name!r}: a {spec.update} update uses no advantage estimator")
    if not 0 < spec.clip_low <= spec.clip_high:
        raise ValueError(f"algorithm {spec.name!r}: need 0 < clip_low <= clip_high, got {spec.clip_low}, "
                         f"{spec.clip_high}")
    if spec.teacher and (spec.update != "policy_gradient" or spec.reference):
        raise ValueError(f"algorithm {spec.name!r}: a teacher takes the reference's place in a policy-gradient update")
    _REGISTRY[spec.name] = spec
    return spec


def get_algorithm(name: str) -> AlgorithmSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown algorithm {name!r}; valid: {', '.join(sorted(_REGISTRY))}") from None


register_algorithm(AlgorithmSpec(
    "ppo", "PPO with a critic: GAE advantages, whitened (Schulman et al. 2017, arXiv 1707.06347)",
    update="policy_gradient", advantage="gae", whiten=True, critic=True))
register_algorithm(AlgorithmSpec(
    "grpo", "group-normalised outcome advantages, KL (k3) as a loss (Shao et al. 2024, arXiv 2402.03300)",
    update="policy_gradient", advantage="grpo", min_samples=2, kl_apply_as="loss", kl_estimator="k3",
    group_std_norm=True))
register_algorithm(AlgorithmSpec(
    "dr_grpo", "GRPO without std or length normalisation (Liu et al. 2025, arXiv 2503.20783)",
    update="policy_gradient", advantage="dr_grpo", min_samples=2, kl_apply_as="loss", kl_estimator="k3",
    loss_agg="seq_mean_token_sum_norm", group_std_norm=False))
register_algorithm(AlgorithmSpec(
    "gspo", "GRPO's group advantages with a sequence-level, length-normalised importance ratio, clipped "
    "per sequence (Zheng et al. 2025, arXiv 2507.18071)",
    update="policy_gradient", advantage="grpo", min_samples=2, policy_loss="gspo_clip", kl_apply_as="loss",
    kl_estimator="k3", loss_agg="seq_mean_token_mean", clip_low=3e-4, clip_high=4e-4, group_std_norm=True))
register_algorithm(AlgorithmSpec(
    "cispo", "GRPO's group advantages with a policy gradient weighted by each token's clipped, detached importance "
    "weight: no token loses its gradient to the clip (MiniMax 2025, arXiv 2506.13585)",
    update="policy_gradient", advantage="grpo", min_samples=2, policy_loss="cispo", kl_apply_as="loss",
    kl_estimator="k3", clip_low=1.0, clip_high=5.0, group_std_norm=True))
register_algorithm(AlgorithmSpec(
    "gmpo", "GRPO's group advantages with the geometric mean of the token ratios, each clipped in log space to "
    "[-0.4, 0.4]: one outlying token moves its sequence's ratio less (Zhao et al. 2025, arXiv 2507.20673)",
    update="policy_gradient", advantage="grpo", min_samples=2, policy_loss="gmpo_clip", kl_apply_as="loss",
    kl_estimator="k3", loss_agg="seq_mean_token_mean", clip_low=0.4, clip_high=0.4, group_std_norm=True))
register_algorithm(AlgorithmSpec(
    "sapo", "GRPO's group advantages with a soft, sign-dependent sigmoid gate on each token's ratio in place of "
    "the clip (Gao et al. 2025, arXiv 2511.20347)",
    update="policy_gradient", advantage="grpo", min_samples=2, policy_loss="sapo_gate", kl_apply_as="loss",
    kl_estimator="k3", loss_agg="seq_mean_token_mean", group_std_norm=True))
register_algorithm(AlgorithmSpec(
    "opo", "the group baseline weighted by response length, the policy gradient's variance-optimal one, no std "
    "division; the paper trains exactly on policy: ppo.epochs 1, one minibatch a step (Hao et al. 2025, "
    "arXiv 2505.23585)",
    update="policy_gradient", advantage="opo", min_samples=2, kl_apply_as="loss", kl_estimator="k3"))
register_algorithm(AlgorithmSpec(
    "gpg", "the plain policy gradient (no ratio, no clip) on group-centred advantages scaled by all rows over those "
    "that carry a gradient, with no KL term or reference unless kl.coef is given; the paper trains exactly on "
    "policy: ppo.epochs 1, one minibatch a step (Chu et al. 2025, arXiv 2504.02546)",
    update="policy_gradient", advantage="gpg", min_samples=2, policy_loss="vanilla", kl_apply_as="loss",
    kl_estimator="k3", kl_coef=0.0, group_std_norm=False))
register_algorithm(AlgorithmSpec(
    "rloo", "leave-one-out baseline (Ahmadian et al. 2024, arXiv 2402.14740)",
    update="policy_gradient", advantage="rloo", min_samples=2))
register_algorithm(AlgorithmSpec(
    "reinforce_pp", "REINFORCE++: return-to-go whitened over the batch (Hu 2025, arXiv 2501.03262)",
    # whiten: the estimator whitens over every row; again over the rows trained on (dynamic sampling drops
    # some), which whitening's affine invariance makes the rows-trained-on statistics exactly.
    update="policy_gradient", advantage="reinforce_pp", whiten=True))
register_algorithm(AlgorithmSpec(
    "reinforce_pp_baseline", "REINFORCE++ with a group-mean baseline (Hu 2025, arXiv 2501.03262)",
    update="policy_gradient", advantage="reinforce_pp_baseline", whiten=True, min_samples=2))
register_algorithm(AlgorithmSpec(
    "rejection_sampling", "best of n per prompt above a threshold, then SFT on those (Touvron et al. 2023)",
    update="best_of_n_sft", reference=False))
register_algorithm(AlgorithmSpec(
    "online_dpo", "iterative DPO: best vs worst of n fresh samples per prompt, DPO against the round's reference "
    "(Xu et al. 2023, arXiv 2312.16682; Dong et al. 2024, arXiv 2405.07863)",
    update="online_dpo", min_samples=2, reference_in_update=True))
register_algorithm(AlgorithmSpec(
    "distill", "on-policy distillation: the student samples, a teacher scores the sampled tokens, and each "
    "token's negative reverse KL to the teacher is its advantage (Agarwal et al. 2024, arXiv 2306.13649)",
    update="policy_gradient", advantage="per_token", reference=False, teacher=True, kl_apply_as="loss"))
