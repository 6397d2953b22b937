"""One RL round: rollouts, rewards, the algorithm's update, weight sync.

A step:
  1. the rollout engines sample n responses per prompt, with logprobs;
  2. rewards: the reward model, a rule or a remote service (+ overlong shaping);
  3. the update of the round's algorithm spec (engines/rl/updates.py) completes
     the experience (reference and actor logprobs, values, KL, advantages:
     pure functions in engines/rl/experience.py) and trains on it;
  4. the new weights are pushed into the running rollout engines.

With `async_rollouts`, generation runs up to `max_staleness` steps ahead of the
update, beside steps 2-3: step 4 publishes the weights without waiting (the
engines take them between generations), so a sample is at most `max_staleness`
updates old, which the round checks before training on it. The scorer actors
score each generation (reference log-probs, reward-model scores) as soon as it
ends (engines/rl/scoring.py `scorers_ahead`), the process reward model too.

The round reads its algorithm's spec and never branches on its name; it
only moves batches between actors. Resumable state: the actor's (and
critic's) training state, the update's state (KL coefficient), the
running reward statistics (reward.normalize), the step.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import algos
from alignflow.store.artifacts import WEIGHT_FILES, Entries, Source, child, local_dir, merge_entries, writing
from alignflow.config import RoundConfig
from alignflow.seeds import derive_seed
from engines.batches import rows_per_pass
from engines.rl import experience
from engines.rollout.episodes import episode_metrics, report_failures
from engines.rl.experience import Experience
from engines.rl.judge import Judge
from engines.rl.process import ProcessReward, process_reward
from engines.rl.rewards import RemoteReward, RuleReward, ScoredText, prompt_text
from engines.rl.round_models import start_round_models
from engines.rl.round_placement import RoundSetup
from engines.rl.scoring import collect_scores, scorers_ahead, submit_scores
from engines.rl.updates import UPDATES
from engines.rollout.base import Rollout, Sampling
from engines.train.supervised import Schedule

log = logging.getLogger("alignflow")


@dataclass(frozen=True)
class StepOutcome:
    metrics: dict[str, float]
    experience: Experience  # completed by the update
    trained_rows: torch.Tensor  # the rows the update trained on (all, the kept groups, or the winners)
    rollouts: list[Rollout]


class _Clock:
    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.times[f"time/{phase}"] = now - self._last
        self._last = now


def scored_texts(rollouts: list[Rollout], records: list[dict]) -> list[ScoredText]:
    """What rules, reward services and judges read of each rollout: its record's prompt (`prompt_text`:
    messages one per line, as the judge stage calibrates on; not the decoded chat template, whose role words
    and default system prompt would be left in), the response text and the record's answer."""
    return [ScoredText(prompt_text(records[r.prompt_index]["prompt"]), r.text, records[r.prompt_index].get("answer"))
            for r in rollouts]


def text_rewards(cfg: RoundConfig) -> dict[str, Callable[[list[ScoredText]], list[float]]]:
    """The rules and remote services a round scores text with, by component name (reward/<name>); the
    reward model, which scores tokens, is not among them."""
    made = {"rule": lambda c: RuleReward(c.rule), "remote": lambda c: RemoteReward(c.url, c.timeout_s, c.max_retries)}
    return {c.label: made[c.source](c) for c in cfg.reward.components if c.source in made}


class RLRound:
    def __init__(self, cfg: RoundConfig, setup: RoundSetup):
        from engines.models import load_tokenizer

        self.cfg, self.setup = cfg.resolved(), setup
        cfg = self.cfg
        # Cheap checks first: nothing is started if the round cannot run.
        self.text_rewards = text_rewards(cfg)
        self.tokenizer = load_tokenizer(local_dir(setup.policy_path, skip=WEIGHT_FILES))
        judge_tokenizer = (load_tokenizer(local_dir(setup.judge_path, skip=WEIGHT_FILES))
                           if cfg.reward.uses_judge else None)
        n = len(setup.prompts)
        if n < cfg.prompts_per_step:  # every step takes all n; the updates (and the LR schedule) count as many
            log.warning("prompts_per_step is %d but the round has %d prompts (after overlong ones were left out): "
                        "each step takes all %d", cfg.prompts_per_step, n, n)
            self.cfg = cfg = cfg.model_copy(update={"prompts_per_step": n})
        self.schedule = Schedule(rows=n, batch_size=cfg.prompts_per_step, total_steps=cfg.steps,
                                 seed=derive_seed(setup.seed, "prompts"))
        sched, self.never_sampled = self.schedule, self.schedule.never_trained()  # rl/prompts_never_sampled
        if sched.left_per_epoch and cfg.steps > sched.steps_per_epoch:  # past an epoch: its leftovers are cut
            log.warning("each epoch of the round's %d prompts takes %d whole steps of %d, leaving %d out (a different "
                        "set each epoch); over %d steps %d prompts are never sampled", n, sched.steps_per_epoch,
                        cfg.prompts_per_step, sched.left_per_epoch, cfg.steps, self.never_sampled)
        rollouts, p = cfg.prompts_per_step * cfg.generation.num_samples, cfg.ppo
        ranks = math.lcm(cfg.actor.num_workers, cfg.critic.num_workers if cfg.spec.critic else 1)
        fixed = cfg.spec.update == "policy_gradient" and not (p.dynamic_sampling or p.dynamic_sampling_mean_range)
        if fixed and (left := rollouts - rows_per_pass(rollouts, p.minibatch_size, ranks)):  # rl/rows_left_out
            log.warning("each step's %d rollouts (prompts_per_step x generation.num_samples) leave %d out of every "
                        "pass of ppo.minibatch_size=%d (a different set each pass)", rollouts, left, p.minibatch_size)
        update_cls = UPDATES[cfg.spec.update]
        self.models = start_round_models(cfg, setup, update_cls.updates_per_step(cfg), update_cls.rows_per_update(cfg))
        self.update = update_cls(cfg, self.models, setup.seed)
        self.judge = (Judge(self.models.judge, judge_tokenizer, cfg.reward.judge, setup.judge_max_model_len
                            - cfg.reward.judge.generation.max_new_tokens) if judge_tokenizer is not None else None)
        # reward.normalize: statistics of every reward of the round so far (checkpointed)
        self.reward_stats = algos.RunningMeanStd() if cfg.reward.normalize else None
        # async_rollouts: the scorers that score each generation as it ends, beside the step training,
        # and by step, the generations queued ahead with the scores submitted for each
        self._ahead = scorers_ahead(self.models.reference, self.models.rewarder, process=self.models.process,
                                    reference_on_batch=update_cls.reference_on_batch,
                                    model_rewards=cfg.reward.uses_model) if cfg.async_rollouts else {}
        self._process = next(((setup.step_separator, c) for c in cfg.reward.components if c.source == "process_model"),
                             None)  # how a process reward model scores, here or ahead
        self._pending: dict[int, tuple[object, list]] = {}

    def generate(self, prompt_ids: list[list[int]], records: list[dict] | None = None) -> list[Rollout]:
        """One response per prompt, or with an environment, episodes of the prompts' `records`."""
        return self.models.generate(prompt_ids, self._sampling(), self._episodes(records))

    def _episodes(self, records: list[dict] | None) -> tuple | None:
        return None if self.cfg.environment is None else (records, self.cfg.environment)

    def rewards(self, exp: Experience, rollouts: list[Rollout], records: list[dict],
                model_scores: torch.Tensor | None = None, process: ProcessReward | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, algos.StepRewards | None, dict[str, float]]:
        """Sequence rewards (B,) and the task rewards they were shaped from: the weighted sum of the
        components' rewards (the reward model on tokens, `model_scores` where it scored them ahead; rules
        and services on text; `process` where the PRM scored them ahead), each component's mean logged as
        reward/<name>; then normalisation, clipping and shaping (`experience.shape_rewards`); a dense process
        reward's step rewards (none in the sequence: its reward/<name> is each response's summed steps)."""
        parts: dict[str, torch.Tensor] = {}
        judged, counted, dense = {}, {}, None  # the judge's metrics; a process reward model's counts and steps
        if self.text_rewards or self.judge is not None:
            items = scored_texts(rollouts, records)
            parts = {name: torch.tensor(fn(items), dtype=torch.float32) for name, fn in self.text_rewards.items()}
        r = self.cfg.reward
        for c in r.components:
            if c.source == "model":
                parts[c.label] = model_scores if model_scores is not None else self.models.model_rewards(exp.tensors())
            elif c.source == "judge":
                parts[c.label], judged = self.judge.score(items)
            elif c.source == "environment":
                parts[c.label] = torch.tensor([r.episode["return"] for r in rollouts], dtype=torch.float32)
            elif c.source == "process_model":  # the response's steps, tokenized as the model was trained on them
                got = process if process is not None else process_reward(
                    self.models.process_score, self.tokenizer, rollouts, *self._process, exp.action_mask.shape[1])
                parts[c.label], dense, counted = got.sequence, got.steps, got.metrics
        task = sum((c.weight * parts[c.label].float() for c in r.components if not c.dense), torch.zeros(len(exp)))
        shaped = experience.shape_rewards(
            task, exp.action_mask, exp.finished, max_response_tokens=self.cfg.max_response_tokens,
            overlong_buffer=r.overlong_buffer, overlong_penalty=r.overlong_penalty,
            truncation_penalty=r.truncation_penalty, clip=r.clip, stats=self.reward_stats)
        self.reward_stats = shaped.stats
        return shaped.rewards, task, dense, {**shaped.metrics, **judged, **counted,
                                             **{f"reward/{k}": v.mean().item() for k, v in parts.items()}}

    def _sampling(self) -> Sampling:
        g = self.cfg.generation
        return Sampling(n=g.num_samples, temperature=g.temperature, top_p=g.top_p, max_new_tokens=g.max_new_tokens)

    def _prompts(self, step: int) -> tuple[list[list[int]], list[dict]]:
        picked = [self.setup.prompts[i] for i in self.schedule.indices(step).tolist()]
        return [p for p, _ in picked], [r for _, r in picked]

    def _rollouts(self, step: int, prompt_ids: list[list[int]], records: list[dict]) -> tuple[list[Rollout], list]:
        """This step's rollouts, and the refs of their scores made ahead. With `async_rollouts`, the
        generations of the next `max_staleness` steps are queued on the engines, to run beside this step's
        scoring and training. They are queued in step order with the published updates between them
        (engines run calls in order): step j's, queued during step j - max_staleness, samples that step's
        policy. On a round's first step (or after a resume) this step's and those ahead are queued at
        once. The scorers of `_ahead` score each generation as soon as it ends."""
        if not self.cfg.async_rollouts:
            return self.generate(prompt_ids, records), []
        if step not in self._pending:
            self._pending = {step: self._submit(prompt_ids, records)}
        for ahead in range(step + 1, min(step + self.cfg.max_staleness, self.cfg.steps - 1) + 1):
            if ahead not in self._pending:
                self._pending[ahead] = self._submit(*self._prompts(ahead))
        generation, scores = self._pending.pop(step)
        return self.models.collect(generation), scores

    def _submit(self, prompt_ids: list[list[int]], records: list[dict]) -> tuple[object, list]:
        piece = self.cfg.partial_tokens if self.cfg.partial_rollouts else None
        generation = self.models.submit(prompt_ids, self._sampling(), piece, self._episodes(records))
        return generation, submit_scores(self._ahead, generation, self.tokenizer.pad_token_id,
                                         self.cfg.generation.logprob_temperature, self._process)

    def step(self, step: int) -> StepOutcome:
        clock = _Clock()
        prompt_ids, records = self._prompts(step)
        rollouts, scores = self._rollouts(step, prompt_ids, records)
        clock.lap("generate")
        staleness = self._staleness(rollouts)
        report_failures(rollouts, f"round step {step}")
        exp = experience.from_rollouts(rollouts, self.tokenizer.pad_token_id)
        ahead = collect_scores(scores, exp)  # waiting counts as scoring
        if "ref_logprobs" in ahead:
            exp = exp.with_(ref_logprobs=ahead["ref_logprobs"])
        rewards, task, steps, reward_metrics = self.rewards(exp, rollouts, records, ahead.get("rewards"),
                                                            ahead.get("process"))
        exp = exp.with_(rewards=rewards, task_rewards=task)
        if steps is not None:
            exp = exp.with_(step_rewards=steps.rewards, step_ends=steps.ends)
        clock.lap("score")
        trained = self.update(exp, step, clock.lap)
        self.models.sync(push=trained.actor_trained)
        clock.lap("sync")
        rewards = trained.experience.rewards
        n_tokens = sum(len(r.token_ids) if r.sampled is None else sum(r.sampled) for r in rollouts)  # sampled ones
        moves, self.models.timings = self.models.timings, {}  # colocation's, the weight update's (in their phases)
        metrics = {
            **trained.metrics, **reward_metrics, **clock.times, **moves, **staleness, **episode_metrics(rollouts),
            "reward/mean": rewards.mean().item(), "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
            "response_length": exp.action_mask.sum(-1).mean().item(),
            # Asynchronous, generation runs beside the step: its rate is over the whole step.
            "tokens_per_s": n_tokens / max(sum(clock.times.values()) if self.cfg.async_rollouts
                                           else clock.times["time/generate"], 1e-9),
        }
        return StepOutcome(metrics, trained.experience, trained.rows, rollouts)

    def _staleness(self, rollouts: list[Rollout]) -> dict[str, float]:
        """How many policy versions (weight updates pushed) each sample is behind the policy that trains on
        it: 0 in a synchronous round; with async_rollouts up to max_staleness once the actor trains. An
        older sample is refused before anything trains on it."""
        ages = [self.models.updates_pushed - r.policy_version for r in rollouts]
        allowed = self.cfg.max_staleness if self.cfg.async_rollouts else 0
        if max(ages) > allowed:
            raise RuntimeError(f"rollouts {max(ages)} policy versions old reached the update; this round allows "
                               f"{allowed} (async_rollouts: {self.cfg.async_rollouts}, max_staleness: "
                               f"{self.cfg.max_staleness})")
        return {"rollout/staleness_max": float(max(ages)), "rollout/staleness_mean": sum(ages) / len(ages)}

    # ---- state ----------------------------------------------------------------------

    def save_state(self, target: Source, step: int) -> Entries:
        """The trainers write `actor/` (and `critic/`) from their nodes, this process `round.json`; a ref:
        the manifest entries of everything uploaded, for the caller to commit."""
        parts = [merge_entries([self.models.actor.save_state(child(target, "actor"), {"step": step})], "actor")]
        if self.models.critic:
            parts.append(merge_entries([self.models.critic.save_state(child(target, "critic"), {"step": step})],
                                       "critic"))
        with writing(target) as (d, uploaded):
            (d / "round.json").write_text(json.dumps({"step": step, **self.update.state(), **self._reward_state()}))
        return merge_entries([*parts, uploaded])

    def load_state(self, source: Source) -> int:
        self.models.actor.load_state(child(source, "actor"))
        if self.models.critic:
            self.models.critic.load_state(child(source, "critic"))
        d = Path(local_dir(source, skip=WEIGHT_FILES))  # round.json, here
        state = json.loads((d / "round.json").read_text())
        self.update.load(state)
        if self.reward_stats is not None:
            if "reward_stats" not in state:
                raise ValueError(f"{d / 'round.json'} holds no reward_stats, which reward.normalize needs to resume")
            self.reward_stats = algos.RunningMeanStd.from_dict(state["reward_stats"])
        self.models.sync()  # the engines started from the round's initial policy
        return int(state["step"])

    def _reward_state(self) -> dict:
        return {} if self.reward_stats is None else {"reward_stats": self.reward_stats.to_dict()}

    def engine_sleeps(self) -> int:
        """How often this round put its rollout engines to sleep (colocated: once a step), the fewest of any
        engine: what the engines counted, not what the round meant to do."""
        return min(e["counts"].get("sleep", 0) for e in self.models.engines.events())

    def save_policy(self, target: Source) -> Entries:
        self.models.settle()  # the round's last published update taken, or its failure raised
        return self.models.actor.save_hf(target)

    def shutdown(self, failed: bool = False) -> None:
        """End the round's actors (`failed`: the round raised; none is kept warm)."""
        self.models.shutdown(failed=failed)
