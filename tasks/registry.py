"""Every stage kind, declared once: its config, its named inputs, its code version, its task.

The planner (tasks/plan.py) builds each stage's config from the pipeline
config, wires its inputs by name and derives its content key from the three;
the Prefect flows submit `run` with one typed inputs object; `alignflow stage
TARGET` and the per-stage deployments name a kind by its `target`.

A stage kind's `run` is `run(stage: PlannedStage, inputs: <its inputs model>,
ctx: RunContext) -> StageResult`, named by import path so that planning
imports no engine (torch, Ray, vLLM): `alignflow plan` answers in seconds.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from pydantic import Field

from alignflow.config import (DataConfig, EvalConfig, JudgeConfig, JudgeRewardConfig, ModelConfig,
                              OfflineDistillConfig, Placement, PreferenceConfig, ProcessRewardModelConfig,
                              RewardModelConfig, RoundConfig, Section, SFTConfig, StepwiseSource, SyntheticTaskConfig)
from alignflow.records import StageResult

# ---- what stages are given --------------------------------------------------------


class ModelIO(Section):
    """What every stage that tokenizes or loads models shares."""

    dtype: Literal["float32", "bfloat16", "float16"]
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"]


class DataStage(Section):
    data: DataConfig
    seed: int


class ProcessDataStage(Section):
    """The step-labelled solutions alone: data.process's file, or the bundled task's (with its seed and counts)."""
    process: StepwiseSource | None
    synthetic: SyntheticTaskConfig | None
    max_prompt_tokens: int | Literal["auto"]
    max_response_tokens: int | Literal["auto"]
    seed: int = Field(description="the data stage's: the bundled task's other splits, whose prompts are not reused")


class BaseModelStage(Section):
    model: ModelConfig
    seed: int


class SFTStage(Section):
    train: SFTConfig
    io: ModelIO
    seed: int


class RewardModelStage(Section):
    train: RewardModelConfig
    io: ModelIO
    seed: int


class ProcessRewardModelStage(Section):
    train: ProcessRewardModelConfig
    io: ModelIO
    seed: int


class PreferenceReferenceStage(Section):
    io: ModelIO
    placement: Placement
    micro_batch_size: int | None


class PreferenceStage(Section):
    train: PreferenceConfig
    io: ModelIO
    seed: int


class JudgeStage(Section):
    train: JudgeConfig
    io: ModelIO
    seed: int


class JudgeEvalStage(Section):
    judge: JudgeRewardConfig = Field(description="the template, parsing and engine a round's judge would use")
    io: ModelIO
    seed: int


class DistillTeacherStage(Section):
    io: ModelIO
    top_k: int
    placement: Placement
    # the teacher's pass in micro-batches (distill's sizes), each one's top-k off the device: resource-only,
    # so that the student's micro-batch settings do not run the teacher again
    scoring_micro_batch_size: int | None
    scoring_micro_batch_tokens: int | None


class OfflineDistillStage(Section):
    train: OfflineDistillConfig
    io: ModelIO
    seed: int


class RoundStage(Section):
    round: RoundConfig = Field(description="resolved: the algorithm's defaults filled in")
    io: ModelIO
    seed: int
    step_separator: str | None = Field(None, description="where a process reward model splits a response into "
                                       "steps (its data's); None: the round does not ask one")


class PolicyEvalStage(Section):
    evaluation: EvalConfig
    io: ModelIO
    seed: int


class RewardModelEvalStage(Section):
    io: ModelIO
    scorer_placement: Placement
    scoring_micro_batch_size: int | None = Field(description="evaluation.micro_batch_size")
    rm_margin_bins: list[float] = Field(description="evaluation.rm_margin_bins")


class ProcessRewardModelEvalStage(Section):
    io: ModelIO
    scorer_placement: Placement
    scoring_micro_batch_size: int | None = Field(description="evaluation.micro_batch_size")


# ---- what stages receive from upstream ------------------------------------------------


class NoInputs(Section):
    pass


class DataInputs(Section):
    model: StageResult = Field(description="the base model: its tokenizer measures the splits, its positions bound them")


class TrainInputs(Section):
    data: StageResult
    init: StageResult = Field(description="the model training starts from")


class PreferenceReferenceInputs(Section):
    data: StageResult
    reference: StageResult = Field(description="the frozen reference policy (the preference stage's start)")


class PreferenceInputs(Section):
    data: StageResult
    init: StageResult = Field(description="the model training starts from (also the reference)")
    reference: StageResult | None = Field(
        None, description="the reference's log-probabilities of the data (preference_reference); none for SimPO, ORPO")


class RoundInputs(Section):
    data: StageResult
    policy: StageResult = Field(description="where the round starts: the previous round, SFT or the base model")
    reference: StageResult | None = Field(None, description="the KL reference (algorithms that use one)")
    reward: StageResult | None = Field(None, description="the reward model (scoring, or a critic's start)")
    teacher: StageResult | None = Field(None, description="the teacher (algorithm distill)")
    judge: StageResult | None = Field(None, description="the generative judge (a judge reward source)")
    process_reward: StageResult | None = Field(None, description="the process reward model (a process_model source)")


class PolicyEvalInputs(Section):
    data: StageResult
    policy: StageResult
    reference: StageResult
    reward: StageResult | None = None


class DistillTeacherInputs(Section):
    data: StageResult
    student: StageResult = Field(description="the policy distillation starts from: its tokenizer renders the rows")
    teacher: StageResult


class OfflineDistillInputs(Section):
    data: StageResult
    init: StageResult = Field(description="the model training starts from (SFT)")
    teacher: StageResult = Field(description="the teacher's cached top-k log-probs of the SFT rows (distill_teacher)")


class JudgeEvalInputs(Section):
    data: StageResult
    judge: StageResult


class RewardModelEvalInputs(Section):
    data: StageResult
    reward: StageResult


class ProcessRewardModelEvalInputs(Section):
    data: StageResult
    process_reward: StageResult


# ---- the registry ---------------------------------------------------------------------


@dataclass(frozen=True)
class StageKind:
    name: str
    target: str  # `alignflow stage TARGET` and the deployment that runs it
    config: type[Section]
    inputs: type[Section]
    code_version: str  # bump when the stage's output changes for the same config and inputs
    run: str  # "module:function"
    summary: str

    def runner(self) -> Callable:
        module, _, name = self.run.partition(":")
        return getattr(importlib.import_module(module), name)


_KINDS: dict[str, StageKind] = {}
STAGE_KINDS = MappingProxyType(_KINDS)


def register_stage(kind: StageKind) -> StageKind:
    if kind.name in _KINDS:
        raise ValueError(f"stage kind {kind.name!r} is already registered")
    _KINDS[kind.name] = kind
    return kind


register_stage(StageKind(
    "data", "data", DataStage, DataInputs, "8", "tasks.stages.data:prepare_data",
    "the bundled task or user data as canonical JSONL splits, measured in tokens"))
register_stage(StageKind(
    "process_data", "process_reward_model", ProcessDataStage, DataInputs, "1", "tasks.stages.data:prepare_process_data",
    "step-labelled solutions for a process reward model, some held out, measured in tokens"))
register_stage(StageKind(
    "base_model", "base_model", BaseModelStage, NoInputs, "3", "tasks.stages.base_model:base_model",
    "the tiny local model, or the user's HF model, committed to storage"))
register_stage(StageKind(
    "sft", "sft", SFTStage, TrainInputs, "3", "tasks.stages.train:sft",
    "supervised fine-tuning on demonstrations (DeepSpeed)"))
register_stage(StageKind(
    "reward_model", "reward_model", RewardModelStage, TrainInputs, "3", "tasks.stages.train:reward_model",
    "Bradley-Terry reward model on preference pairs (DeepSpeed)"))
register_stage(StageKind(
    "process_reward_model", "process_reward_model", ProcessRewardModelStage, TrainInputs, "1",
    "tasks.stages.train:process_reward_model", "process reward model on step-labelled solutions (DeepSpeed)"))
register_stage(StageKind(
    "judge", "judge", JudgeStage, TrainInputs, "3", "tasks.stages.judge:judge",
    "a generative judge: SFT on yes/no verdicts of the preference pairs (DeepSpeed)"))
register_stage(StageKind(
    "distill_teacher", "distill", DistillTeacherStage, DistillTeacherInputs, "3",
    "tasks.stages.distill:distill_teacher",
    "the teacher's top-k next-token log-probs at every response position of the SFT rows, once"))
register_stage(StageKind(
    "offline_distill", "distill", OfflineDistillStage, OfflineDistillInputs, "2", "tasks.stages.distill:distill",
    "SFT trained toward the teacher's cached distributions: KL from its renormalised top-k (DeepSpeed)"))
register_stage(StageKind(
    "preference_reference", "preference", PreferenceReferenceStage, PreferenceReferenceInputs, "3",
    "tasks.stages.preference:preference_reference", "the reference's log-probabilities of every preference row, once"))
register_stage(StageKind(
    "preference", "preference", PreferenceStage, PreferenceInputs, "2", "tasks.stages.preference:preference",
    "DPO and its family / KTO against the cached reference, or SimPO / ORPO without one (DeepSpeed)"))
register_stage(StageKind(
    "rl_round", "rl", RoundStage, RoundInputs, "7", "tasks.stages.rl_round:rl_round",
    "one RL round of any registered algorithm (vLLM rollouts, DeepSpeed updates)"))
register_stage(StageKind(
    "evaluate_policy", "evaluation", PolicyEvalStage, PolicyEvalInputs, "6", "tasks.stages.evaluate:evaluate_policy",
    "held-out accuracy, reward, length and KL of one policy"))
register_stage(StageKind(
    "evaluate_reward_model", "evaluation", RewardModelEvalStage, RewardModelEvalInputs, "3",
    "tasks.stages.evaluate:evaluate_reward_model", "held-out pairwise accuracy of the reward model"))
register_stage(StageKind(
    "evaluate_process_reward_model", "evaluation", ProcessRewardModelEvalStage, ProcessRewardModelEvalInputs, "1",
    "tasks.stages.evaluate:evaluate_process_reward_model",
    "held-out step, solution and first-error accuracy of the process reward model"))
register_stage(StageKind(
    "evaluate_judge", "evaluation", JudgeEvalStage, JudgeEvalInputs, "2", "tasks.stages.judge:evaluate_judge",
    "held-out verdict accuracy of the judge (both responses of each pair, greedy)"))


def targets() -> list[str]:
    """Every `alignflow stage` target, in pipeline order."""
    return list(dict.fromkeys(k.target for k in _KINDS.values()))
