"""Pieces shared by several stages: the config base, placement, engines, sampling."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Section(BaseModel):
    """Base of every config model: frozen, no unknown keys (a typo is an error, not a default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Placement(Section):
    """Ray resources of one actor (a training worker, a rollout engine, a scorer)."""

    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)


class EngineConfig(Section):
    """A DeepSpeed training engine: optimizer, ZeRO, workers and their placement.

    Its random seed derives from the pipeline seed (alignflow/seeds.py).
    """

    learning_rate: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(10, ge=0)
    zero_stage: Literal[0, 1, 2, 3] = 0
    num_workers: int = Field(1, ge=1)
    placement: Placement = Field(default_factory=Placement, description="per worker")
    grad_clip: float = Field(1.0, gt=0)


class TrainConfig(EngineConfig):
    """A supervised training stage (SFT, reward model): the engine plus its data loop."""

    batch_size: int = Field(32, ge=1, description="global batch, split across workers")
    epochs: float = Field(1.0, gt=0)
    max_steps: int | None = Field(None, ge=1, description="caps epochs when set")
    checkpoint_every: int = Field(50, ge=1, description="mid-stage checkpoint period (steps)")
    log_every: int = Field(10, ge=1)


class GenerationConfig(Section):
    """Sampling settings for rollouts and evaluation (the engine seed derives from the pipeline seed)."""

    backend: Literal["vllm", "hf"] = "vllm"
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(16, ge=1)
    num_samples: int = Field(4, ge=1)
    placement: Placement = Field(default_factory=Placement, description="per rollout engine")
