"""Typed pipeline configuration: one pydantic model per stage, defaults here only.

    base.py      the config base, placement, training engines, sampling
    data.py      data sources          model.py   the base policy
    preference.py  DPO's family / KTO    evaluation.py  held-out evaluation
    process.py   the process reward model (step labels)
    round/       one RL round: its checks, rewards, judge, updates, environment
    pipeline.py  which stages exist, infra     lora_targets.py  what LoRA may adapt
    loading.py   YAML + overrides -> a validated PipelineConfig

Unknown keys are errors, so a typo never silently falls back to a default.
"""

from alignflow.config.base import (EngineConfig, GenerationConfig, LoraConfig, Placement, Section, TrainConfig,
                                   VLLMConfig)
from alignflow.config.data import DataConfig, DatasetSource, StepwiseSource, SyntheticTaskConfig
from alignflow.config.process import ProcessRewardModelConfig
from alignflow.config.loading import (
    DEFAULT_CONFIG,
    RESOURCE_FIELDS,
    apply_overrides,
    cache_relevant,
    config_from_parameter,
    default_config_path,
    load_config,
    parse_override,
    resolve_paths,
    validate_config,
)
from alignflow.config.model import ModelConfig, TinyModelConfig
from alignflow.config.evaluation import EvalConfig
from alignflow.config.pipeline import (
    InfraConfig,
    PipelineConfig,
    RewardModelConfig,
    SFTConfig,
    StorageConfig,
)
from alignflow.config.round.agent import EnvironmentConfig
from alignflow.config.distill import OfflineDistillConfig
from alignflow.config.round.judge import JudgeConfig, JudgeRewardConfig
from alignflow.config.preference import PreferenceConfig
from alignflow.config.round.rl import (
    ActorConfig,
    OnlineDPOConfig,
    CriticConfig,
    KLConfig,
    PPOConfig,
    RejectionSamplingConfig,
    RewardConfig,
    RolloutConfig,
    RoundConfig,
)
from alignflow.errors import ConfigError

__all__ = [
    "EnvironmentConfig",
    "DEFAULT_CONFIG", "RESOURCE_FIELDS", "ActorConfig", "ConfigError", "CriticConfig", "DataConfig",
    "DatasetSource", "EngineConfig", "EvalConfig", "GenerationConfig", "InfraConfig", "JudgeConfig", "JudgeRewardConfig", "KLConfig", "LoraConfig", "ModelConfig",
    "OfflineDistillConfig", "OnlineDPOConfig", "PPOConfig", "PipelineConfig", "PreferenceConfig", "Placement",
    "ProcessRewardModelConfig", "StepwiseSource", "RejectionSamplingConfig", "RewardConfig", "RewardModelConfig",
    "RolloutConfig", "RoundConfig", "SFTConfig", "Section", "StorageConfig", "SyntheticTaskConfig",
    "TinyModelConfig", "TrainConfig", "VLLMConfig", "apply_overrides", "cache_relevant", "config_from_parameter", "default_config_path", "load_config",
    "parse_override", "resolve_paths", "validate_config",
]
