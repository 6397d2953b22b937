"""Generative judges: the judge stage (a policy trained by SFT to give verdicts) and a round's judge reward.

A judge reads `template` filled with the round's prompt, a response and the reference answer, and
answers with a verdict. The judge stage trains on the preference pairs: the chosen response's
verdict is `yes`, the rejected one's `no`. A round parses each verdict into a score (a regex whose
first group is looked up in `scores` or read as a number, or a JSON object's `json_key`), averaging
over `generation.num_samples` votes; a verdict that does not parse is counted and scores
`unparsed_reward`.
"""

from __future__ import annotations

import re
import string
from typing import Literal

from pydantic import Field, field_validator, model_validator

from alignflow.config.base import GenerationConfig, Section, TrainConfig

JUDGE_TEMPLATE = "{prompt} Answer: {response}. Right?"
VERDICTS = {True: "yes", False: "no"}  # what the judge stage trains a right / wrong response's verdict to be
PLACEHOLDERS = ("prompt", "response", "answer")


def check_template(template: str) -> str:
    """Only {prompt}, {response} and {answer}, each at most once, and {response} present."""
    try:
        names = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as err:
        raise ValueError(f"template {template!r} does not parse: {err}") from None
    unknown = sorted(set(names) - set(PLACEHOLDERS))
    if unknown:
        raise ValueError(f"template {template!r} names {unknown}; it may use {{prompt}}, {{response}} and {{answer}}")
    if "response" not in names:
        raise ValueError(f"template {template!r} has no {{response}}: the judge would not see what it judges")
    return template


def _unanswered(template: str) -> str:
    if "answer" in (f for _, f, _, _ in string.Formatter().parse(template)):  # {answer}, {answer!r}; not {{answer}}
        raise ValueError("the judge stage trains on the preference pairs, which carry no answer: {answer} would be "
                         "empty in every prompt it trains on, and filled in every one it judges in a round. Leave it "
                         "out, or judge with a model trained elsewhere (reward.judge.model), whose template may use it")
    return template


class JudgeConfig(TrainConfig):
    """The judge stage: SFT of the SFT policy (or the base model) on verdicts of the preference pairs."""

    template: str = Field(JUDGE_TEMPLATE, description="the judge's prompt: {prompt} and {response} (it trains on "
                          "preference pairs, which carry no {answer})")

    _template = field_validator("template")(classmethod(lambda cls, v: _unanswered(check_template(v))))


class JudgeGeneration(GenerationConfig):
    """How the judge's verdicts are sampled: greedy, one vote, a few tokens, by default."""

    temperature: float = Field(0.0, ge=0, description="0: greedy; > 0 to sample several votes")
    max_new_tokens: int = Field(4, ge=1, description="tokens of each verdict")
    num_samples: int = Field(1, ge=1, description="votes per response, averaged (temperature > 0 for more than 1)")
    max_model_len: int | None = Field(
        None, ge=2, description="positions the judge's engine holds, a judge prompt and its verdict together; "
        "vLLM needs KV cache for one such sequence to start, so lower it for a long-context judge on a shared "
        "GPU. Longer judge prompts are counted (judge/overlong) and score unparsed_reward; None: in a round, what "
        "its prompts can need (the longest with a response of the round's most tokens, a tenth more, and the "
        "verdict) where the judge shares the policy's vocabulary, else the judge model's max_position_embeddings")

    def engine_positions(self, model_positions: int) -> int:
        """The judge engine's positions: max_model_len, or the model's own; more than the model has is a
        ValueError (preflight and the round both ask it)."""
        if self.max_model_len is not None and self.max_model_len > model_positions:
            raise ValueError(f"{self.max_model_len} positions, more than the judge model's {model_positions}")
        return model_positions if self.max_model_len is None else self.max_model_len

    @model_validator(mode="after")
    def _greedy_once(self) -> JudgeGeneration:  # GenerationConfig's, said of votes
        if self.num_samples > 1 and self.temperature == 0:
            raise ValueError(f"{self.num_samples} greedy votes are one vote repeated: set temperature > 0, or "
                             f"num_samples 1")
        return self

    @model_validator(mode="after")
    def _room_for_a_verdict(self) -> JudgeGeneration:
        if self.max_model_len is not None and self.max_model_len <= self.max_new_tokens:
            raise ValueError(f"max_model_len {self.max_model_len} leaves no position for a prompt before a "
                             f"verdict of max_new_tokens {self.max_new_tokens}")
        return self


class JudgeRewardConfig(Section):
    """A round's generative judge (reward.source: judge, or a `judge` component of reward.sources)."""

    model: str | None = Field(
        None, description="a judge checkpoint (directory or hub id); None: the pipeline's judge stage")
    revision: str | None = Field(None, description="the hub judge's branch, tag or commit (as model.revision)")
    template: str = Field(JUDGE_TEMPLATE, description="the judge's prompt: {prompt}, {response}, {answer} (the "
                          "pipeline's judge: its judge.template)")
    parse: Literal["regex", "json"] = Field("regex", description="how a verdict becomes a score")
    pattern: str = Field(r"^\s*(yes|no)\b", description="parse=regex: its first group is looked up in `scores`, "
                         "else read as a number")
    scores: dict[str, float] = Field(default_factory=lambda: {"yes": 1.0, "no": 0.0},
                                     description="parse=regex: the score of each verdict word (case-insensitive)")
    json_key: str = Field("score", description="parse=json: the key of the score in the verdict's JSON object")
    unparsed_reward: float = Field(
        0.0, description="the reward of a response none of whose verdicts parse (each counted: judge/unparsed)")
    generation: JudgeGeneration = Field(default_factory=JudgeGeneration,
                                        description="the judge's engines: backend, sampling, votes, placement")

    _template = field_validator("template")(classmethod(lambda cls, v: check_template(v)))

    @field_validator("pattern")
    @classmethod
    def _pattern(cls, pattern: str) -> str:
        try:
            groups = re.compile(pattern).groups
        except re.error as err:
            raise ValueError(f"pattern {pattern!r} is no regular expression: {err}") from None
        if groups < 1:
            raise ValueError(f"pattern {pattern!r} has no group: its first group is the verdict")
        return pattern

    @model_validator(mode="after")
    def _votes(self) -> JudgeRewardConfig:
        if self.revision is not None and self.model is None:
            raise ValueError("revision pins a judge model named by hub id: the pipeline's judge has none")
        return self
