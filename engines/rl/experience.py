"""Experience making as pure functions over one immutable, typed batch.

`Experience` holds a step's tensors under the `algos` names; each phase
returns a new one (`exp.with_(...)`), and nothing here touches Ray, vLLM or
DeepSpeed: the round orchestrator (engines/rl/round.py) only moves batches between
actors and calls these. Shapes: B rollouts, L = longest prompt + response,
T = longest response.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

import algos
from engines.batches import right_padded
from engines.rollout.base import Rollout

if TYPE_CHECKING:
    from alignflow.config import RoundConfig


@dataclass(frozen=True)
class Experience:
    """A step's batch. Fields after `finished` are filled by the phases, in this order:

        input_ids, attention_mask  (B, L)  prompt + response, right-padded
        response_index             (B, T)  position of response token t in the next-token (L-1) layout
        action_mask                (B, T)  1 on real response tokens
        rollout_logprobs           (B, T)  the sampler's logprobs (truncated IS, sync checks)
        prompt_index               (B,)    the step's prompt; a prompt's n samples are contiguous
        finished                   (B,)    ended with EOS/stop rather than the length limit
        turn_rewards               (B, T)  episodes: each environment reward at the last token of its turn
                                           (their sum is in the sequence reward too); None: single turns
        rewards                    (B,)    sequence reward (task reward + overlong shaping)
        task_rewards               (B,)    the reward model's / rule's / service's reward, before any shaping
        step_rewards, step_ends    (B, T)  a dense process reward: each step's reward at the token that ends it,
                                           and the steps ending there (not in the sequence reward); None: none
        ref_logprobs               (B, T)  reference policy (algorithms with a KL term); a distillation
                                           round's teacher
        old_logprobs               (B, T)  the trained policy before this step's updates (None when the
                                           step is one optimizer step: the training forward's own)
        values                     (B, T)  critic (algorithms with a critic)
        token_rewards              (B, T)  reward at the last token, minus the per-token KL where KL is a reward
        advantages, returns        (B, T)
    """

    input_ids: Tensor
    attention_mask: Tensor
    response_index: Tensor
    action_mask: Tensor
    rollout_logprobs: Tensor
    prompt_index: Tensor
    finished: Tensor
    turn_rewards: Tensor | None = None
    rewards: Tensor | None = None
    task_rewards: Tensor | None = None
    step_rewards: Tensor | None = None
    step_ends: Tensor | None = None
    ref_logprobs: Tensor | None = None
    old_logprobs: Tensor | None = None
    values: Tensor | None = None
    token_rewards: Tensor | None = None
    advantages: Tensor | None = None
    returns: Tensor | None = None

    def with_(self, **fields: Tensor) -> Experience:
        return dataclasses.replace(self, **fields)

    def tensors(self) -> dict[str, Tensor]:
        """The filled fields, as the dict the trainer's objectives and the scorers take."""
        return {f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}

    def select(self, rows: Tensor) -> Experience:
        return dataclasses.replace(self, **{k: v[rows] for k, v in self.tensors().items()})

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def from_rollouts(rollouts: list[Rollout], pad_id: int) -> Experience:
    """Pad rollouts (grouped per prompt, in order) into an Experience. An episode's action mask is 1 only on
    the tokens the policy sampled (`Rollout.sampled`), and its environment rewards sit at their turns' ends
    (`turn_rewards`)."""
    if not rollouts:
        raise ValueError("no rollouts to batch")
    B, T = len(rollouts), max(1, max(len(r.token_ids) for r in rollouts))
    index = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T)
    logprobs = torch.zeros(B, T)
    turns = torch.zeros(B, T) if any(r.turn_rewards is not None for r in rollouts) else None
    for b, r in enumerate(rollouts):
        n, p = len(r.token_ids), len(r.prompt_ids)
        index[b, :n] = torch.arange(p - 1, p - 1 + n)
        mask[b, :n] = 1.0 if r.sampled is None else torch.tensor(r.sampled, dtype=torch.float32)
        logprobs[b, :n] = torch.tensor(r.logprobs, dtype=torch.float32)
        for t, reward in r.turn_rewards or ():
            turns[b, t] += reward
    padded = right_padded([r.prompt_ids + r.token_ids for r in rollouts], pad_id)
    return Experience(
        input_ids=padded["input_ids"], attention_mask=padded["attention_mask"], response_index=index,
        action_mask=mask, rollout_logprobs=logprobs,
        prompt_index=torch.tensor([r.prompt_index for r in rollouts]),
        finished=torch.tensor([r.finished for r in rollouts]), turn_rewards=turns,
    )


def shaped_rewards(task_rewards: Tensor, action_mask: Tensor, *, max_response_tokens: int, overlong_buffer: int,
                   overlong_penalty: float) -> Tensor:
    """r_b + p(len_b): DAPO's soft overlong punishment when `overlong_buffer` > 0 (`algos.overlong_penalty`), with
    len_b the row's sampled tokens (an episode's observations are not the model's length) against
    `max_response_tokens` (RoundConfig.max_response_tokens).

    Shapes: `task_rewards` (B,), `action_mask` (B, T); returns (B,) float32.
    """
    rewards = task_rewards.float()
    if not overlong_buffer:
        return rewards
    return rewards + algos.overlong_penalty(action_mask.sum(-1), max_len=max_response_tokens, buffer_len=overlong_buffer,
                                            penalty_factor=overlong_penalty)


@dataclass(frozen=True)
class ShapedRewards:
    rewards: Tensor  # (B,)
    stats: algos.RunningMeanStd | None  # the running statistics with this batch merged in (normalize on)
    metrics: dict[str, float]


def shape_rewards(task_rewards: Tensor, action_mask: Tensor, finished: Tensor, *, max_response_tokens: int,
                  overlong_buffer: int, overlong_penalty: float, truncation_penalty: float = 0.0,
                  clip: float | None = None, stats: algos.RunningMeanStd | None = None) -> ShapedRewards:
    """A step's sequence rewards from its task rewards, in this order:

        r = task;  stats = stats.update(r), r = (r - mean) / sqrt(var + 1e-8)   (`stats` given: reward.normalize)
        r = clip(r, -clip, clip)                                                (`clip` given)
        r = r + overlong_penalty(len)                                           (`shaped_rewards`)
        r = r - truncation_penalty * [not finished]

    Shapes: `task_rewards` (B,), `action_mask` (B, T), `finished` (B,) bool; rewards (B,) float32.
    Metrics: reward/task_mean, reward/truncated (responses cut by the length limit), reward/clipped
    (rewards the clip changed), and with `stats` reward/running_mean and reward/running_std.
    """
    task = task_rewards.float()
    r, n_clipped = task, 0
    if stats is not None:
        stats = stats.update(r)
        r = stats.normalize(r)
    if clip is not None:
        r, n_clipped = algos.clip_rewards(r, clip)
    r = shaped_rewards(r, action_mask, max_response_tokens=max_response_tokens, overlong_buffer=overlong_buffer,
                       overlong_penalty=overlong_penalty)
    if truncation_penalty:
        r = r + algos.truncation_penalty(finished, truncation_penalty)
    metrics = {"reward/task_mean": task.mean().item() if len(task) else 0.0,
               "reward/truncated": float((~finished.bool()).sum()), "reward/clipped": float(n_clipped)}
    if stats is not None:
        metrics.update({"reward/running_mean": stats.mean, "reward/running_std": stats.std})
    return ShapedRewards(r, stats, metrics)


def with_advantages(exp: Experience, *, estimator: str, whiten: bool, group_size: int, gamma: float, lam: float,
                    kl_coef: float, kl_estimator: str, kl_clamp: float | None,
                    std_norm: bool | None = None, teacher: bool = False, rows: Tensor | None = None) -> Experience:
    """Token rewards, then advantages and returns, through the `algos` registry.

        token_rewards = kl_penalized_rewards(rewards, old_logprobs, ref_logprobs, kl_coef)  (kl_coef = 0: none)
        token_rewards = distillation_token_rewards(student, ref_logprobs)     (`teacher`: ref_logprobs are its)
        token_rewards = rewards_at_turns(token_rewards, turn_rewards)        (episodes: each turn's reward at its end)
        advantages, returns = estimator(token_rewards, values, ..., steps);  advantages whitened when `whiten`

    `steps`: a dense process reward's step rewards (`step_rewards`, `step_ends`), which the estimator adds to
    its returns or, a group estimator, as their process advantage (algos/advantages/process.py).

    A teacher's pull is taken at the student's log-probs of its samples: the old ones where the step
    measured them, else the sampler's (`rollout_logprobs`: a synchronous round's sampler holds the policy
    the step trains; an asynchronous round measures them, engines/rl/updates.py `on_policy`).

    `std_norm` (group estimators: divide by the group std or not) reaches the estimator only when
    set; None leaves the estimator's own default. Needs `rewards` (`old_logprobs` and `ref_logprobs`
    when kl_coef > 0, `values` for "gae"). `rows`: the rows the step trains on (after dynamic sampling);
    whitening takes its mean and variance over their tokens alone, and leaves 0 on the others.
    """
    mask = exp.action_mask
    if kl_coef and (exp.ref_logprobs is None or exp.old_logprobs is None):
        raise ValueError("a KL penalty in the reward needs ref_logprobs and old_logprobs")
    if teacher:
        if exp.ref_logprobs is None:
            raise ValueError("a distillation step needs the teacher's log-probs (ref_logprobs)")
        student = exp.rollout_logprobs if exp.old_logprobs is None else exp.old_logprobs
        token_rewards = algos.distillation_token_rewards(student, exp.ref_logprobs, mask)
    elif kl_coef:
        token_rewards = algos.kl_penalized_rewards(exp.rewards, exp.old_logprobs, exp.ref_logprobs, mask,
                                                   kl_coef=kl_coef, kind=kl_estimator, clamp=kl_clamp)
    else:  # the sequence reward at the last token alone
        zeros = torch.zeros_like(mask, dtype=torch.float32)
        token_rewards = algos.kl_penalized_rewards(exp.rewards, zeros, zeros, mask, kl_coef=0.0)
    if exp.turn_rewards is not None and not teacher:  # a teacher's pull holds no sequence reward to move
        token_rewards = algos.rewards_at_turns(token_rewards, exp.turn_rewards, mask)
    options = {} if std_norm is None else {"std_norm": std_norm}
    if exp.step_rewards is not None:
        options["steps"] = algos.StepRewards(exp.step_rewards, exp.step_ends)
    out = algos.get_advantage_estimator(estimator)(
        token_rewards=token_rewards, action_mask=mask, values=exp.values, group_size=group_size, gamma=gamma,
        lam=lam, eps=1e-6, **options)
    trained = mask
    if rows is not None:
        trained = torch.zeros_like(mask)
        trained[rows] = mask[rows]
    advantages = algos.masked_whiten(out.advantages, trained) if whiten else out.advantages
    return exp.with_(token_rewards=token_rewards, advantages=advantages, returns=out.returns)


def sequence_kl(exp: Experience) -> Tensor:
    """`algos.sequence_k1` of the old policy against the reference: (B,). 0 without a reference. Where no
    old log-probs were measured (on policy), the sampler's: a synchronous round's sampler holds the policy."""
    if exp.ref_logprobs is None:
        return torch.zeros(len(exp))
    old = exp.rollout_logprobs if exp.old_logprobs is None else exp.old_logprobs
    return algos.sequence_k1(old, exp.ref_logprobs, exp.action_mask)


def best_of_n(exp: Experience, threshold: float | None) -> Tensor:
    """Rejection sampling's winners: per prompt, the finished row of highest reward, ties broken by the task
    reward (`reward.clip` makes scores above it one), then the first; kept if its task reward reaches
    `threshold`. The task reward, not the shaped one: normalised, a right answer in a group of mostly right
    ones scores below 1, and fewer would pass as the policy improves. Row indices, in prompt order."""
    task = exp.rewards if exp.task_rewards is None else exp.task_rewards
    best: dict[int, int] = {}
    for row in range(len(exp)):
        if not exp.finished[row]:
            continue
        p = int(exp.prompt_index[row])
        if p not in best or (exp.rewards[row], task[row]) > (exp.rewards[best[p]], task[best[p]]):
            best[p] = row
    rows = [i for _, i in sorted(best.items()) if threshold is None or task[i].item() >= threshold]
    return torch.tensor(rows, dtype=torch.long)


def sft_batch(exp: Experience) -> dict[str, Tensor]:
    """input_ids, attention_mask and a `loss_mask` over input_ids that is 1 on the response tokens (B, L)."""
    loss_mask = torch.zeros_like(exp.input_ids)
    rows, t = exp.action_mask.nonzero(as_tuple=True)
    loss_mask[rows, exp.response_index[rows, t] + 1] = 1
    return {"input_ids": exp.input_ids, "attention_mask": exp.attention_mask, "loss_mask": loss_mask}


def kept_rows(rewards: torch.Tensor, cfg: RoundConfig, task_rewards: torch.Tensor | None = None,
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """The rows a policy-gradient step trains on, and how many groups each filter dropped.

    Both filters read the task rewards (`task_rewards`: the rule's, reward model's or service's, before
    normalising, clipping or penalties; `rewards` where none is given), as DAPO filters on accuracy: a group
    whose answers are all right (or all wrong) is dropped though the overlong penalty spreads its rewards.
    `ppo.dynamic_sampling` drops groups whose task rewards are all equal (`dynamic_sampling/dropped_groups`);
    `ppo.dynamic_sampling_mean_range` then drops, of the groups left, those whose mean task reward lies
    outside [low, high] (`dynamic_sampling/dropped_groups_mean_range`). Rows: (kept,) indices, in order.
    """
    n, p = cfg.generation.num_samples, cfg.ppo
    task = rewards if task_rewards is None else task_rewards
    keep, dropped, dropped_range = torch.ones(len(rewards), dtype=torch.bool), 0, 0
    if p.dynamic_sampling:
        keep, dropped = algos.dynamic_sampling_filter(task, n)
    if p.dynamic_sampling_mean_range is not None:
        low, high = p.dynamic_sampling_mean_range
        in_range, _ = algos.group_mean_filter(task, n, low=low, high=high)
        dropped_range = int((keep & ~in_range).sum().item()) // n
        keep = keep & in_range
    metrics = {"dynamic_sampling/dropped_groups": float(dropped),
               "dynamic_sampling/dropped_groups_mean_range": float(dropped_range)}
    return torch.arange(len(rewards))[keep], metrics
