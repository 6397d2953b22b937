"""Held-out evaluation of policies (sampled answers, their checker and vote, KL) and of the reward model."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, field_validator, model_validator

from alignflow.config.base import GenerationConfig, Placement, Section
from alignflow.config.round.agent import EnvironmentConfig


class EvalConfig(Section):
    """Held-out evaluation of every policy checkpoint and of the reward model."""

    generation: GenerationConfig = Field(GenerationConfig(), description="sampling of the held-out prompts")
    scorer_placement: Placement = Field(default_factory=Placement,
                                        description="the reference and reward models that score samples")
    micro_batch_size: int | None = Field(64, ge=1, description="sequences per scoring forward; None: all at once")
    num_prompts: int | None = Field(None, ge=1, description="cap on held-out prompts")
    num_logged_samples: int = Field(20, ge=0, description="samples saved per evaluation (samples/<name>.json); 0: none")
    checker: str = Field(
        "alignflow.data.synthetic:check_answer",
        description="import path of f(response, answer) -> bool (answer None for a row without one); the default "
        "is the bundled tasks' exact match (alignflow.rewards:math_correct checks a response's final mathematical "
        "answer)",
    )
    vote_on: str | None = Field(
        None, description="import path of f(response) -> its final answer (str, or None: no answer, no vote), what "
        "eval/majority_accuracy's vote compares, as self-consistency votes on answers, not reasoning "
        "(alignflow.rewards:final_answer for math); None: the whole response, whitespace collapsed (right "
        "where a response is its answer, as in the bundled tasks)")
    environment: EnvironmentConfig | None = Field(
        None, description="evaluate policies as agents: episodes in this environment, eval/accuracy their success "
        "rate (the checker unused), with turns, tool calls, invalid calls, truncated and failed episodes")
    engine_lifetime: Literal["auto", "stage", "run"] = Field(
        "auto", description="run: one process hosts the rollout engine of every evaluation in a pipeline run (an "
        "engine built fresh for each, the libraries loaded once: ~8 s less per evaluation on 2 CPU cores), and holds "
        "generation.placement for the whole run; stage: a process per evaluation; auto: run where the engine takes "
        "no GPU, stage where it does (a GPU held for the run would be taken from the rounds)")
    rm_margin_bins: list[float] = Field(
        default_factory=lambda: [0.0, 0.5, 1.0, 2.0],
        description="edges of the reward model's |chosen - rejected| score-gap bins, its held-out pairwise accuracy "
        "reported per bin: [0, 0.5, 1, 2] means [0,0.5), [0.5,1), [1,2), [2,inf); strictly increasing from 0")

    @field_validator("rm_margin_bins")
    @classmethod
    def _margin_bins(cls, edges: list[float]) -> list[float]:
        if not edges or edges[0] != 0.0 or any(b <= a for a, b in zip(edges, edges[1:])) \
                or not all(math.isfinite(e) for e in edges):
            raise ValueError(f"must be finite, strictly increasing and start at 0 (every gap in one bin), got {edges}")
        return edges

    @model_validator(mode="after")
    def _lifetime(self) -> EvalConfig:
        if self.engine_lifetime == "run" and self.generation.vllm.tensor_parallel_size > 1:
            raise ValueError("engine_lifetime: run hosts one engine process; a tensor-parallel engine "
                             "(generation.vllm.tensor_parallel_size > 1) needs a process group per evaluation: use stage")
        return self

    @property
    def keeps_engine(self) -> bool:
        """Whether the run's evaluations share one engine process (`engine_lifetime`, `auto` resolved)."""
        if self.engine_lifetime == "auto":
            return self.generation.placement.num_gpus == 0
        return self.engine_lifetime == "run"
