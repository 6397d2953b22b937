"""Where an RL round's rewards come from, and how they are shaped before the update."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from alignflow.config.base import Section


class RewardConfig(Section):
    """Where an RL round's rewards come from."""

    source: Literal["model", "rule", "remote"] = Field(
        "model", description="model: the trained reward model; rule: reward.rule; remote: the service at reward.url")
    rule: str = Field(
        "alignflow.data.synthetic:rule_reward",
        description="import path of f(prompt, response, answer) -> float (source=rule)",
    )
    url: str | None = Field(None, description="reward service endpoint (source=remote)")
    timeout_s: float = Field(10.0, gt=0, description="seconds per reward-service request (source=remote)")
    max_retries: int = Field(3, ge=0, description="retries of a failed service request, with exponential backoff")
    overlong_buffer: int = Field(0, ge=0, description="DAPO soft overlong penalty buffer (0: off)")
    overlong_penalty: float = Field(1.0, ge=0, description="DAPO overlong penalty reached at max_new_tokens")
    normalize: bool = Field(
        False, description="standardise each reward with the running mean and std of every reward of the round so "
        "far, this step's included (Welford); the statistics are kept in the round's checkpoints")
    clip: float | None = Field(
        None, gt=0, description="clip each sequence reward to [-clip, clip], after reward.normalize; None: off")
    truncation_penalty: float = Field(
        0.0, ge=0, description="subtracted from the reward of each response cut by generation.max_new_tokens "
        "(no EOS or stop string), after normalisation and clipping; 0: off")

    @model_validator(mode="after")
    def _remote_has_url(self) -> RewardConfig:
        if self.source == "remote" and not self.url:
            raise ValueError("reward.source='remote' needs reward.url")
        return self
