"""Agents: the environment a round's episodes run in (alignflow/agents/, engines/rollout/episodes.py)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from alignflow.config.base import Section


class EnvironmentConfig(Section):
    """A multi-turn environment: one per episode, `name(**kwargs)`; each model turn is one `step`."""

    name: str | None = Field(None, description="a bundled environment (boxes) or module:Class of the user's code, "
                             "whose reset(sample) -> messages and step(message) -> (observation, reward, done, info)")
    agent: str | None = Field(None, description="instead of name: module:function(client, sample) -> reward, the "
                              "user's agent driving each episode through an OpenAI client of the engine's endpoint "
                              "(engines/rollout/agentic.py, endpoint.py); step_timeout_s bounds its own time in "
                              "an episode, outside its requests (their wait for the engine is not counted)")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the class")
    max_turns: int = Field(4, description="model turns per episode (an agent's completions); an episode not done "
                           "by then is truncated")
    max_tokens_per_turn: int | None = Field(
        None, ge=1, description="new tokens per model turn; None: generation.max_new_tokens")
    max_episode_tokens: int = Field(256, ge=1, description="tokens after the prompt (turns and observations); "
                                    "an episode with none left for another turn is truncated")
    step_timeout_s: float = Field(30.0, gt=0, description="seconds a reset or step may take; a slower one fails "
                                  "its episode (counted), the round goes on")
    failure_reward: float = Field(0.0, description="the return of an episode whose environment raised, hung or "
                                  "answered malformed")

    def turn_tokens(self, max_new_tokens: int) -> int:
        """New tokens one model turn may sample: max_tokens_per_turn, or generation's max_new_tokens."""
        return self.max_tokens_per_turn or max_new_tokens

    def episode_tokens(self, max_new_tokens: int) -> int:
        """The most sampled tokens one episode can hold: min(max_turns * turn_tokens, max_episode_tokens)."""
        return min(self.max_turns * self.turn_tokens(max_new_tokens), self.max_episode_tokens)

    @model_validator(mode="after")
    def _one_kind(self) -> EnvironmentConfig:
        if (self.name is None) == (self.agent is None):
            raise ValueError("give name (an environment class) or agent (a module:function driving the endpoint), "
                             "one of them")
        if self.agent is not None and self.kwargs:
            raise ValueError("kwargs are the environment class's (name); an agent function takes (client, sample) "
                             "only: leave kwargs out, or read your settings in the agent's module")
        return self

    @field_validator("max_turns")
    @classmethod
    def _turns(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"must be at least 1 (a single-turn round is max_turns 1), got {v}")
        return v
