"""Typed pipeline configuration: one pydantic model per stage, defaults here only.

A pipeline config is loaded from YAML (or the embedded `configs/tiny.yaml`),
then `key.sub=value` overrides from the command line are applied, then the
whole tree is validated before any compute starts. Unknown keys are errors,
so a typo never silently falls back to a default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A configuration problem, with the source and the field it concerns."""


class StageConfig(BaseModel):
    """Base for every config model: frozen, no unknown keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class SyntheticTaskConfig(StageConfig):
    """The bundled "largest digit" task (see alignflow.data.synthetic).

    A prompt lists `num_digits` digits; the checkable answer is the largest.
    SFT demonstrations give the correct answer with probability
    `sft_correct_fraction` and otherwise the first digit (a bad habit the RL
    rounds should remove).
    """

    seed: int = 0
    num_digits: int = Field(5, ge=2, le=12)
    num_sft: int = Field(2000, ge=1)
    num_preference: int = Field(2000, ge=1)
    num_rl_prompts: int = Field(512, ge=1)
    num_eval: int = Field(200, ge=1)
    sft_correct_fraction: float = Field(0.35, ge=0.0, le=1.0)


class DatasetSource(StageConfig):
    """User data: a JSONL/Parquet file, or any `datasets` source.

    `path` is a local path or fsspec URI ending in .jsonl/.json/.parquet, or a
    `datasets` name (loaded with `datasets.load_dataset(path, name, split=split)`).
    Rows are either prompt/response (or chosen/rejected) columns, or chat
    messages rendered with the tokenizer's chat template.
    """

    path: str
    name: str | None = None
    split: str = "train"
    prompt_key: str = "prompt"
    response_key: str = "response"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    messages_key: str | None = None
    answer_key: str | None = "answer"


class DataConfig(StageConfig):
    """Where prompts, demonstrations, preference pairs and eval prompts come from."""

    source: Literal["synthetic", "files"] = "synthetic"
    synthetic: SyntheticTaskConfig = SyntheticTaskConfig()
    sft: DatasetSource | None = None
    preference: DatasetSource | None = None
    prompts: DatasetSource | None = None
    eval: DatasetSource | None = None
    max_prompt_tokens: int = Field(64, ge=1)
    max_response_tokens: int = Field(16, ge=1)

    @model_validator(mode="after")
    def _files_present(self) -> DataConfig:
        if self.source == "files":
            missing = [k for k in ("sft", "preference", "eval") if getattr(self, k) is None]
            if missing:
                raise ValueError(f"source='files' needs data.{', data.'.join(missing)}")
        return self


class TinyModelConfig(StageConfig):
    """Shape of the locally built Qwen2-family model and its tokenizer."""

    vocab_size: int = Field(320, ge=264, description="byte-level BPE: 256 bytes + specials + merges")
    hidden_size: int = Field(128, ge=16)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    intermediate_size: int = Field(256, ge=16)
    max_position_embeddings: int = Field(128, ge=16)

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide by num_heads, num_heads by num_kv_heads")
        return self


class ModelConfig(StageConfig):
    """The base policy: the tiny local model, or any HF model directory / hub id."""

    base: str = "tiny"
    tiny: TinyModelConfig = TinyModelConfig()
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    seed: int = 0


class Placement(StageConfig):
    """Ray resources of one actor (a training worker, a rollout engine, a scorer)."""

    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)


class EngineConfig(StageConfig):
    """A DeepSpeed training engine: optimizer, ZeRO, workers and their placement."""

    learning_rate: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(10, ge=0)
    zero_stage: Literal[0, 1, 2, 3] = 0
    num_workers: int = Field(1, ge=1)
    placement: Placement = Field(default_factory=Placement, description="per worker")
    grad_clip: float = Field(1.0, gt=0)
    seed: int = 0


class TrainConfig(EngineConfig):
    """A supervised training stage (SFT, reward model): the engine plus its data loop."""

    batch_size: int = Field(32, ge=1, description="global batch, split across workers")
    epochs: float = Field(1.0, gt=0)
    max_steps: int | None = Field(None, ge=1, description="caps epochs when set")
    checkpoint_every: int = Field(50, ge=1, description="mid-stage checkpoint period (steps)")
    log_every: int = Field(10, ge=1)


class SFTConfig(TrainConfig):
    """Supervised fine-tuning: next-token loss on response tokens only."""


class RewardModelConfig(TrainConfig):
    """Bradley-Terry pairwise reward model on the SFT backbone."""

    margin: float = Field(0.0, ge=0, description="added margin in -log sigmoid(c - r - m)")


class GenerationConfig(StageConfig):
    """Sampling settings for rollouts and evaluation."""

    backend: Literal["vllm", "hf"] = "vllm"
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(16, ge=1)
    num_samples: int = Field(4, ge=1)
    seed: int = 0
    placement: Placement = Field(default_factory=Placement, description="per rollout engine")


class EvalConfig(StageConfig):
    """Held-out evaluation of every policy checkpoint and of the reward model."""

    generation: GenerationConfig = GenerationConfig()
    num_prompts: int | None = Field(None, ge=1, description="cap on held-out prompts")
    num_logged_samples: int = Field(20, ge=0)
    checker: str = Field(
        "alignflow.data.synthetic:check_answer",
        description="import path of f(response, answer) -> bool",
    )


class RewardConfig(StageConfig):
    """Where an RL round's rewards come from."""

    source: Literal["model", "rule", "remote"] = "model"
    rule: str = Field(
        "alignflow.data.synthetic:rule_reward",
        description="import path of f(prompt, response, answer) -> float (source=rule)",
    )
    url: str | None = Field(None, description="reward service endpoint (source=remote)")
    timeout_s: float = Field(10.0, gt=0)
    max_retries: int = Field(3, ge=0)
    overlong_buffer: int = Field(0, ge=0, description="DAPO soft overlong penalty buffer (0: off)")
    overlong_penalty: float = Field(1.0, ge=0)

    @model_validator(mode="after")
    def _remote_has_url(self) -> RewardConfig:
        if self.source == "remote" and not self.url:
            raise ValueError("reward.source='remote' needs reward.url")
        return self


class KLConfig(StageConfig):
    """KL regularisation toward the reference (SFT) policy."""

    estimator: Literal["k1", "k2", "k3"] = "k1"
    apply_as: Literal["reward", "loss"] = Field("reward", description="PPO-style penalty or GRPO-style loss")
    coef: float = Field(0.05, ge=0)
    adaptive: bool = False
    target: float = Field(1.0, gt=0, description="adaptive controller target KL (Ziegler et al. 2019)")
    horizon: int = Field(10000, ge=1)
    clamp: float | None = Field(10.0, gt=0)
    budget: float = Field(3.0, gt=0, description="max acceptable held-out KL to the reference")


class PPOConfig(StageConfig):
    """Update settings: PPO epochs over minibatches, clipping, value loss."""

    epochs: int = Field(2, ge=1)
    minibatch_size: int = Field(64, ge=1, description="rollouts per optimizer step")
    clip_low: float = Field(0.2, gt=0)
    clip_high: float = Field(0.2, gt=0, description="> clip_low: DAPO clip-higher")
    dual_clip: float | None = Field(None, gt=1)
    value_clip: float | None = Field(0.2, gt=0)
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(0.95, ge=0, le=1)
    entropy_coef: float = Field(0.0, ge=0)
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    tis_cap: float | None = Field(2.0, gt=0, description="truncated IS cap between vLLM and trainer logprobs")
    dynamic_sampling: bool = Field(False, description="DAPO: drop groups whose rewards are all equal")


class RejectionSamplingConfig(StageConfig):
    """Keep the best of n per prompt (above a threshold) and fine-tune on them."""

    threshold: float | None = Field(None, description="minimum reward of a winner")
    epochs: int = Field(1, ge=1)


# Round-specific defaults live on classes of their own: a default given as an
# instance (`actor: TrainConfig = TrainConfig(learning_rate=2e-4)`) is lost as
# soon as a user sets any one field of that section.


class ActorConfig(EngineConfig):
    """The policy's training engine in an RL round."""

    learning_rate: float = Field(2e-4, gt=0)
    warmup_steps: int = Field(0, ge=0)


class CriticConfig(EngineConfig):
    """The critic's training engine (PPO), initialised from the reward model."""

    learning_rate: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(0, ge=0)


class RolloutConfig(GenerationConfig):
    """Sampling during an RL round: n samples per prompt form its group."""

    max_new_tokens: int = Field(8, ge=1)


class RoundConfig(StageConfig):
    """One RL round after the reward model."""

    algorithm: Literal[
        "ppo", "grpo", "dr_grpo", "reinforce_pp", "reinforce_pp_baseline", "rloo", "rejection_sampling"
    ] = "ppo"
    steps: int = Field(20, ge=1)
    prompts_per_step: int = Field(32, ge=1)
    generation: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = RewardConfig()
    kl: KLConfig = KLConfig()
    ppo: PPOConfig = PPOConfig()
    rejection: RejectionSamplingConfig = RejectionSamplingConfig()
    actor: ActorConfig = Field(default_factory=ActorConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    num_rollout_engines: int = Field(1, ge=1)
    colocate_reference_and_reward: bool = True
    scorer_placement: Placement = Field(default_factory=Placement, description="reference / reward actors")
    checkpoint_every: int = Field(10, ge=1, description="steps between resumable checkpoints")
    seed: int = 0

    @model_validator(mode="after")
    def _consistent(self) -> RoundConfig:
        critic_free = self.algorithm in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")
        if critic_free and self.generation.num_samples < 2:
            raise ValueError(f"{self.algorithm} needs generation.num_samples >= 2 (a group per prompt)")
        if self.ppo.clip_high < self.ppo.clip_low:
            raise ValueError("ppo.clip_high must be >= ppo.clip_low")
        return self


class StorageConfig(StageConfig):
    """One root URI for every artifact; credentials come from the environment."""

    root: str = "./artifacts"
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, moto)")
    cache_dir: str = Field("~/.cache/alignflow", description="local copies of remote checkpoints")


class InfraConfig(StageConfig):
    """Where the pipeline runs and reports."""

    storage: StorageConfig = StorageConfig()
    mlflow_tracking_uri: str = "sqlite:///mlflow.db"
    mlflow_experiment: str = "alignflow"
    ray_address: str | None = Field(None, description="existing cluster; None starts a local Ray")
    ray_num_cpus: int = Field(
        16, ge=1, description="logical CPU slots of the local Ray (actors and tasks each take slots; not cores)")
    prefect_api_url: str | None = Field(None, description="None: the CLI starts a local API")
    task_retries: int = Field(2, ge=0)
    retry_delay_seconds: float = Field(2.0, ge=0)
    torch_threads: int = Field(2, ge=1)


class PipelineConfig(StageConfig):
    """The whole pipeline: data -> base model -> SFT -> reward model -> RL rounds -> eval."""

    name: str = "tiny"
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    sft: SFTConfig = SFTConfig()
    reward_model: RewardModelConfig = RewardModelConfig()
    rounds: list[RoundConfig] = Field(default_factory=lambda: [RoundConfig(), RoundConfig()])
    evaluation: EvalConfig = EvalConfig()
    infra: InfraConfig = InfraConfig()


DEFAULT_CONFIG = "tiny"

# Fields that place work on the cluster without changing what it computes:
# left out of cache keys, so moving a stage to other hardware reuses its result.
RESOURCE_FIELDS = frozenset({"placement", "scorer_placement"})


def cache_relevant(cfg: BaseModel) -> dict[str, Any]:
    """A stage config as JSON, without its resource-only fields (at any depth)."""

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k not in RESOURCE_FIELDS}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    return strip(cfg.model_dump(mode="json"))


def default_config_path() -> Path:
    """The embedded default pipeline config (shipped inside the package)."""
    return Path(__file__).parent / "configs" / f"{DEFAULT_CONFIG}.yaml"


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], yaml-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.sub=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {text!r} has an empty key segment")
    return parts, yaml.safe_load(raw) if raw.strip() else None


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each `key.sub=value` in a nested dict (creating levels as needed)."""
    for text in overrides:
        parts, value = parse_override(text)
        node = tree
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part!r} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return tree


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid pipeline config ({source}):"]
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "<root>"
        lines.append(f"  {field}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def validate_config(tree: dict[str, Any], source: str = "<dict>") -> PipelineConfig:
    """Validate a raw tree; errors name every offending field."""
    try:
        return PipelineConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> PipelineConfig:
    """Load YAML (default: the embedded tiny config), apply overrides, validate."""
    path = Path(path) if path is not None else default_config_path()
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(tree).__name__}")
    return validate_config(apply_overrides(tree, overrides or []), source=str(path))


def resolve_paths(cfg: PipelineConfig, base: Path | None = None) -> PipelineConfig:
    """A copy whose local storage root and SQLite tracking file are absolute.

    Ray workers may run in another working directory; relative paths would
    then point elsewhere. Remote URIs are left as they are. (Cache keys do
    not include these paths, so resolving never changes a key.)
    """
    base = base or Path.cwd()
    infra = cfg.infra
    root = infra.storage.root
    if "://" not in root:
        root = str((base / Path(root).expanduser()).resolve())
    uri = infra.mlflow_tracking_uri
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
        uri = prefix + str((base / uri[len(prefix):]).resolve())
    storage = infra.storage.model_copy(update={"root": root})
    return cfg.model_copy(update={"infra": infra.model_copy(update={"storage": storage, "mlflow_tracking_uri": uri})})
