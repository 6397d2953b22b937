"""Agents: the environment a round's episodes run in (alignflow/agents/, engines/rollout/episodes.py)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from alignflow.config.base import Section


class EnvironmentConfig(Section):
    """A multi-turn environment: one per episode, `name(**kwargs)`; each model turn is one `step`."""

    name: str = Field(description="a bundled environment (boxes) or module:Class of the user's code, whose "
                      "reset(sample) -> messages and step(message) -> (observation, reward, done, info)")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the class")
    max_turns: int = Field(4, description="model turns per episode; an episode not done by then is truncated")
    max_tokens_per_turn: int | None = Field(
        None, ge=1, description="new tokens per model turn; None: generation.max_new_tokens")
    max_episode_tokens: int = Field(256, ge=1, description="tokens after the prompt (turns and observations); "
                                    "an episode with none left for another turn is truncated")
    step_timeout_s: float = Field(30.0, gt=0, description="seconds a reset or step may take; a slower one fails "
                                  "its episode (counted), the round goes on")
    failure_reward: float = Field(0.0, description="the return of an episode whose environment raised, hung or "
                                  "answered malformed")

    @field_validator("max_turns")
    @classmethod
    def _turns(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"must be at least 1 (a single-turn round is max_turns 1), got {v}")
        return v
