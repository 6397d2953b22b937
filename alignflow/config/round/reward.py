"""Where an RL round's rewards come from, and how they are shaped before the update.

A round's task reward is one source (`reward.source` with its settings: the short form) or a weighted
sum of several (`reward.sources`), each component logged on its own (`reward/<name>`).
"""

from __future__ import annotations

import posixpath
import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from alignflow.config.base import Section
from alignflow.config.round.judge import JudgeRewardConfig

Source = Literal["model", "rule", "remote", "judge", "environment", "process_model"]
# Metric names the reward shaping already logs under reward/ (engines/rl/experience.py, engines/rl/round.py).
RESERVED_NAMES = ("mean", "std", "task_mean", "truncated", "clipped", "running_mean", "running_std")
SOURCE_SETTINGS = ("source", "rule", "url", "timeout_s", "max_retries", "step_aggregation", "no_step_reward",
                   "dense")


class SourceSettings(Section):
    """What a source is and its own settings: shared by a mix's components and the one-source form. A setting
    of another source than the one chosen is refused (`check_own_settings`): `rule` beside `source: model` would
    score with the reward model while the user meant the rule."""

    source: Source = Field(
        "model", description="model: the trained reward model; rule: `rule`; remote: the service at `url`; judge: "
        "the round's generative judge (reward.judge); environment: each episode's return in the round's environment; "
        "process_model: the pipeline's process reward model, over the response's steps (step_aggregation)")
    rule: str = Field(
        "alignflow.data.synthetic:rule_reward",
        description="import path of f(prompt, response, answer) -> float (source=rule)",
    )
    url: str | None = Field(None, description="reward service endpoint (source=remote)")
    timeout_s: float = Field(10.0, gt=0, description="seconds per reward-service request (source=remote)")
    max_retries: int = Field(3, ge=0, description="retries of a failed service request, with exponential backoff")
    step_aggregation: Literal["min", "last", "mean"] = Field(
        "min", description="source=process_model: a response's reward from its steps' scores: the weakest step's, "
        "the last step's, or their mean (algos.solution_scores)")
    no_step_reward: float = Field(
        -5.0, description="source=process_model: the reward of a response without a step (empty, or separators "
        "only; counted as process/responses_without_steps), in the model's log-odds: -5 is about 1 in 150")
    dense: bool = Field(
        False, description="source=process_model: each step's score is a reward of its own at the step's last "
        "token (process supervision: GAE and REINFORCE++ take them in their returns, the group estimators add "
        "DeepSeekMath's process advantage), instead of one reward per response (step_aggregation); a response "
        "without a step gets no_step_reward at its last token")

    def changed(self, keys: tuple[str, ...] = SOURCE_SETTINGS) -> list[str]:
        """Which of the settings `keys` differ from their defaults: what the user gave (a dumped config holds every
        default, and loads again)."""
        return [k for k in keys if getattr(self, k) != SourceSettings.model_fields[k].default]

    def check_own_settings(self) -> None:
        """Raise ValueError where a setting of another source than this one is given."""
        owners = {"rule": "rule", "url": "remote", "timeout_s": "remote", "max_retries": "remote",
                  "step_aggregation": "process_model", "no_step_reward": "process_model", "dense": "process_model"}
        if unread := [k for k in self.changed(tuple(owners)) if owners[k] != self.source]:
            raise ValueError(f"{' and '.join(unread)} {'is' if len(unread) == 1 else 'are'} source "
                             f"{owners[unread[0]]}'s setting{'s' * (len(unread) > 1)}, and this source is "
                             f"{self.source}: set source: {owners[unread[0]]}, or leave {' and '.join(unread)} out")
        if self.dense and self.changed(("step_aggregation",)):
            raise ValueError("step_aggregation makes one reward of a response's steps, and dense: true gives each "
                             "step a reward of its own: leave step_aggregation out, or set dense: false")


class RewardSourceConfig(SourceSettings):
    """One source of reward: the reward model, a rule, a service or the judge, weighted in a mix."""

    weight: float = Field(1.0, description="its weight in the task reward, sum_k weight_k * reward_k")
    name: str | None = Field(None, description="its metric, reward/<name>; None: the source's name")

    @property
    def label(self) -> str:
        return self.name or self.source

    @field_validator("name")
    @classmethod
    def _a_metric_name(cls, name: str | None) -> str | None:
        """MLflow's rule for a metric's name (letters, digits, / _ - . : and spaces, a path that normalises to
        itself): the round's first log of reward/<name> raised, after a whole step's generation and training."""
        metric = f"reward/{name}"
        if name and (not re.fullmatch(r"[\w/.\- :]+", name) or posixpath.normpath(metric) != metric
                     or len(f"rl/{metric}") > 250):
            raise ValueError(f"name {name[:40]!r} would make the metric {metric[:50]}, which MLflow refuses: use "
                             f"letters, digits, spaces and _ - . : only, / between parts that are not '.' or '..', "
                             f"and at most 240 characters")
        return name

    @model_validator(mode="after")
    def _remote_has_url(self) -> RewardSourceConfig:
        self.check_own_settings()
        if self.source == "remote" and not self.url:
            raise ValueError("source 'remote' needs url")
        return self


class RewardConfig(SourceSettings):
    """Where an RL round's rewards come from (one source, or `sources`), and how they are shaped."""

    sources: list[RewardSourceConfig] | None = Field(
        None, description="a weighted mix instead of one source: [{source: rule, weight: 1.0}, {source: model, "
        "weight: 0.5}, ...], each component logged as reward/<name> (the source's name unless given); the task "
        "reward is sum_k weight_k * reward_k; None: the one source above")
    judge: JudgeRewardConfig = Field(default_factory=JudgeRewardConfig,
                                     description="the generative judge of a judge source (one per round)")
    overlong_buffer: int = Field(0, ge=0, description="DAPO soft overlong penalty buffer (0: off)")
    overlong_penalty: float = Field(1.0, ge=0, description="DAPO overlong penalty, reached at the round's longest response "
                                    "(generation.max_new_tokens; an episode's: RoundConfig.max_response_tokens)")
    normalize: bool = Field(
        False, description="standardise each reward with the running mean and std of every reward of the round so "
        "far, this step's included (Welford); the statistics are kept in the round's checkpoints")
    clip: float | None = Field(
        None, gt=0, description="clip each sequence reward to [-clip, clip], after reward.normalize; None: off")
    truncation_penalty: float = Field(
        0.0, ge=0, description="subtracted from the reward of each response cut by generation.max_new_tokens "
        "(no EOS or stop string), after normalisation and clipping; 0: off")

    @model_validator(mode="after")
    def _sources(self) -> RewardConfig:
        if self.sources is None:
            self.check_own_settings()
            if self.source == "remote" and not self.url:
                raise ValueError("reward.source='remote' needs reward.url")
            return self
        if both := self.changed():
            raise ValueError(f"reward.sources lists each source with its settings; leave out reward.{both[0]} "
                             f"(the one-source form)")
        if not self.sources:
            raise ValueError("reward.sources is empty; list at least one source, or leave it out")
        labels = [c.label for c in self.sources]
        repeated = sorted({n for n in labels if labels.count(n) > 1})
        if repeated:
            raise ValueError(f"reward.sources: two components are named {repeated[0]!r}; give each a `name`")
        reserved = [n for n in labels if n in RESERVED_NAMES]
        if reserved:
            raise ValueError(f"reward.sources: name {reserved[0]!r} is a reward metric of its own; choose another")
        if sum(c.source == "model" for c in self.sources) > 1:
            raise ValueError("reward.sources: one reward model per round (the pipeline trains one)")
        if sum(c.source == "judge" for c in self.sources) > 1:
            raise ValueError("reward.sources: one judge per round (its settings are reward.judge)")
        if sum(c.source == "process_model" for c in self.sources) > 1:
            raise ValueError("reward.sources: one process reward model per round (the pipeline trains one)")
        return self

    @property
    def components(self) -> list[RewardSourceConfig]:
        """The sources of the task reward, the one-source form as a mix of one."""
        if self.sources is not None:
            return list(self.sources)
        return [RewardSourceConfig(source=self.source, rule=self.rule, url=self.url, timeout_s=self.timeout_s,
                                   max_retries=self.max_retries, step_aggregation=self.step_aggregation,
                                   no_step_reward=self.no_step_reward, dense=self.dense)]

    @property
    def uses_judge(self) -> bool:
        """Some component asks the generative judge."""
        return any(c.source == "judge" for c in self.components)

    @property
    def uses_model(self) -> bool:
        """Some component scores with the trained reward model."""
        return any(c.source == "model" for c in self.components)

    @property
    def uses_process_model(self) -> bool:
        """Some component scores a response's steps with the pipeline's process reward model."""
        return any(c.source == "process_model" for c in self.components)

    @property
    def dense_only(self) -> bool:
        """Every component is a dense process reward: the sequence reward is 0 for every response."""
        return all(c.dense for c in self.components)

    def source_fields(self, prefix: str) -> list[tuple[str, RewardSourceConfig]]:
        """(config field, component) of each source, `prefix` (e.g. rounds.0.reward) naming this section: the
        section itself for the one-source form, `prefix.sources.k` in a mix."""
        if self.sources is None:
            return [(prefix, self.components[0])]
        return [(f"{prefix}.sources.{k}", c) for k, c in enumerate(self.sources)]
