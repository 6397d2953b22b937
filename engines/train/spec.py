"""What a training engine is built from: its spec, DeepSpeed config and learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from alignflow.store.artifacts import Source
from alignflow.config import EngineConfig
from alignflow.config.base import LoraConfig, fp32_gradient_sums


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """What a DeepSpeed optimizer holds beside the model's own weights, at ZeRO-0 and ZeRO-3: the fp32
    master weights it keeps for bf16/fp16 weights (ZeRO-0 with torch's AdamW: `fp32_groups`, a fused
    optimizer: `fp32_groups_flat`; ZeRO-3: `fp32_partitioned_groups_flat`) and the torch optimizer's
    per-parameter moments (not scalars: Adam's `step` stays where the optimizer keeps it). In fp32 at
    ZeRO-0 the optimizer steps the model's weights themselves: moments only."""
    masters = [p for group in getattr(optimizer, "fp32_groups", None) or [] for p in group]
    for name in ("fp32_groups_flat", "fp32_partitioned_groups_flat"):
        masters += list(getattr(optimizer, name, None) or [])
    inner = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed wraps the torch optimizer
    moments = [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return masters + moments


def move_training_state(engine, zero_stage: int, *, offload: bool, device) -> None:
    """A DeepSpeed engine's optimizer state (ZeRO: its partitions and fp32 master weights) to CPU
    memory (`offload`), or back to `device`, the rank's own (not `offload`).

    ZeRO-3's `offload_states` moves master weights and Adam moments only for DeepSpeed's own FusedAdam
    (it asserts so) and the trainer's optimizer is torch's AdamW: at stage 3 DeepSpeed moves the
    gradient partitions and buckets, and the master partitions and moments move here, as at stage 0
    (`optimizer_tensors`; in bf16 the masters are 4 of the 12 bytes per parameter)."""
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as State

    device = "cpu" if offload else device
    if zero_stage in (1, 2):
        if offload:  # not lp_params: the weight transport reads the training weights right after (weight_sync.py)
            engine.offload_states(include=[State.optim_states, State.hp_params, State.lp_grads,
                                           State.contiguous_grad_buffer])
        else:
            engine.reload_states()
        return _release_cache()
    if zero_stage == 3 and offload:
        engine.offload_states(include=[State.lp_grads, State.contiguous_grad_buffer])
    elif zero_stage == 3:
        engine.reload_states()
    for t in optimizer_tensors(engine.optimizer):  # in place (.data): the optimizer's state stays keyed by them
        t.data = t.data.to(device, non_blocking=True)
    _release_cache()


def _release_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class EngineSpec:
    """What a training engine is built from (all plain values, Ray-shippable)."""

    model_path: Source  # a directory on the worker's node, or a ref each worker fetches on its own
    kind: str  # "causal" (policy) or "scalar" (reward model / critic)
    learning_rate: float
    weight_decay: float
    warmup_steps: int
    total_steps: int
    zero_stage: int
    global_batch: int
    grad_clip: float
    seed: int
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    micro_batch_size: int | None = None  # rows per forward/backward; None: no cap on rows
    micro_batch_tokens: int | None = None  # padded tokens per forward/backward; None: no cap on tokens
    gradient_checkpointing: bool = False
    dropout: bool = False  # False: the model's dropout off in training (models.disable_dropout)
    offload: str = "none"  # "none" | "optimizer" | "optimizer_and_params"
    torch_threads: int = 2
    num_cpus_per_worker: float = 1.0
    cpu_cores: tuple[int, ...] | None = None  # placement.cpu_cores: each worker pinned to them
    num_gpus_per_worker: float = 0.0
    resources_per_worker: dict[str, float] = field(default_factory=dict)  # placement.resources
    lora: LoraConfig | None = None  # LoRA adapters on a frozen base (engines/lora.py); None: full fine-tuning

    @classmethod
    def from_config(cls, cfg: EngineConfig, *, model_path: Source, kind: str, total_steps: int, global_batch: int,
                    dtype: str, torch_threads: int, seed: int, attn_implementation: str = "sdpa") -> EngineSpec:
        """The spec of an engine configured by `cfg` (optimizer, ZeRO, memory, placement)."""
        return cls(
            model_path=model_path, kind=kind, learning_rate=cfg.learning_rate, weight_decay=cfg.weight_decay,
            warmup_steps=cfg.warmup_steps, total_steps=total_steps, zero_stage=cfg.zero_stage,
            global_batch=global_batch, grad_clip=cfg.grad_clip, seed=seed, dtype=dtype,
            attn_implementation=attn_implementation, micro_batch_size=cfg.micro_batch_size,
            micro_batch_tokens=cfg.micro_batch_tokens,
            gradient_checkpointing=cfg.gradient_checkpointing, dropout=cfg.dropout, offload=cfg.offload,
            torch_threads=torch_threads, num_cpus_per_worker=cfg.placement.num_cpus,
            cpu_cores=tuple(cfg.placement.cpu_cores) if cfg.placement.cpu_cores is not None else None,
            num_gpus_per_worker=cfg.placement.num_gpus, resources_per_worker=cfg.placement.resources, lora=cfg.lora,
        )

    @property
    def fp32_grad_sums(self) -> bool:
        """DeepSpeed told to sum micro-batch gradients in fp32 (alignflow.config.base.fp32_gradient_sums): a half
        dtype at ZeRO-2/3 without offload."""
        return self.dtype != "float32" and fp32_gradient_sums(self.zero_stage, self.offload, self.dtype)

    def ds_config(self, world_size: int) -> dict[str, Any]:
        """The DeepSpeed config. Gradient accumulation over micro-batches is driven by the worker
        (`set_gradient_accumulation_boundary`), so DeepSpeed sees one accumulation step of the
        worker's whole share; bf16/fp16 keep fp32 master weights and optimizer state, and at ZeRO-2/3
        sum the micro-batches' gradients in fp32 (DeepSpeed's default is the model's dtype: each add
        rounded to 8 bits of mantissa in bf16, ~1 % off over 64 micro-batches). ZeRO-0 cannot (DeepSpeed
        refuses the mix) and ZeRO-1 would swap in its BF16_Optimizer, which has no loss scaler or state
        offload for the checkpoints and colocated rounds to drive: preflight says so (preflight/unused.py). Nor
        under offload: DeepSpeed keeps the fp32 sums on the GPU (4 bytes a parameter per rank), the memory
        offload is there to free."""
        zero: dict[str, Any] = {"stage": self.zero_stage, "stage3_param_persistence_threshold": 0}
        if self.offload != "none":
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if self.offload == "optimizer_and_params":
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        return {
            "train_micro_batch_size_per_gpu": self.global_batch // world_size,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": self.grad_clip,
            "zero_optimization": zero,
            # On a CPU-only run the offloaded optimizer is torch's AdamW (`make_optimizer`), which DeepSpeed would refuse.
            **({"zero_force_ds_cpu_optimizer": False} if self.offload != "none" else {}),
            **({"data_types": {"grad_accum_dtype": "fp32"}} if self.fp32_grad_sums else {}),
            "bf16": {"enabled": self.dtype == "bfloat16"},
            "fp16": {"enabled": self.dtype == "float16"},
            "steps_per_print": 10**9,
        }


def steps_with_cpu_adam(offload: str, device: torch.device) -> bool:
    """Whether an engine's optimizer is DeepSpeed's CPU Adam: under ZeRO-Offload on a GPU, where the step
    runs on the CPU over fp32 partitions and DeepSpeed's vectorised, multi-threaded Adam is what makes
    offload usable (OpenRLHF's `--adam_offload` chooses it too). It is built on first use (a C++ compile:
    ~65 s on 2 cores), then cached in TORCH_EXTENSIONS_DIR: inside the virtual environment for a local Ray
    (alignflow/cluster.py), torch's ~/.cache/torch_extensions on a cluster's nodes. On a CPU-only run
    offload moves nothing, and torch's AdamW steps without a build."""
    return offload != "none" and device.type == "cuda"


def make_optimizer(params: list[torch.nn.Parameter], spec: EngineSpec, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over `params` at the spec's learning rate and weight decay: DeepSpeed's CPU Adam in AdamW mode
    where `steps_with_cpu_adam`, torch's otherwise (betas (0.9, 0.999), eps 1e-8 in both)."""
    if steps_with_cpu_adam(spec.offload, device):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, lr=spec.learning_rate, weight_decay=spec.weight_decay, adamw_mode=True)
    return torch.optim.AdamW(params, lr=spec.learning_rate, weight_decay=spec.weight_decay)


def lr_lambda(warmup: int, total: int) -> Callable[[int], float]:
    """Linear warmup, then cosine decay to 10% of the peak."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return f
