"""The training engine's rank: `TrainWorker`, one DeepSpeed worker as a Ray actor.

`TrainerGroup` (engines/train/group.py) starts `num_workers` of them, which
form one torch.distributed group (gloo on CPU, nccl on GPU), each wrapping the
same model in a DeepSpeed engine with the configured ZeRO stage. A global batch
is split into equal row shards, one per worker; DeepSpeed averages gradients
across them.

The objective is injected: `train_step(shards, objective)` calls
`objective(model, micro_batch) -> (loss, metrics)` on every worker, once per
micro-batch, gradients accumulated; an objective with a `prepare(model,
micro_batches, device) -> kwargs` method first takes what the whole step
shares (KTO's reference point), passed to each call. The engine does not know
which algorithm it serves. Each rank's device follows engines/placement/devices.py.

Resume state (`save_state` / `load_state`) is the model in HF format (with LoRA:
the adapter only, engines/lora.py) plus, per rank, optimizer and RNG state as
safetensors + JSON (engines/train/state.py); no pickles.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import sys
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import ray
import torch

from alignflow.store.artifacts import Entries, Source, local_dir, writing
from engines import lora, models
from engines.accumulate import add_metrics, host_metrics
from engines.micro_batching import in_micro_batches
from engines.lean_imports import import_deepspeed
from engines.placement.devices import (actor_device, announce_cpu_accelerator, local_rank, pin_cpu_cores,
                                       cpu_report, placement_group_id, quiet_stdout, to_cpu, to_device)
from engines.placement.rendezvous import init_training_group, reserve_address
from engines.train.spec import EngineSpec, lr_lambda, make_optimizer, move_training_state
from engines.train.state import (load_optimizer_state, load_state, load_weights, optimizer_state, restore_rng,
                                rng_state, save_state)
from engines.transport.sync import WeightSender


def load_trainable(spec: EngineSpec, pad_token_id: int | None,
                   ds_config: dict[str, Any] | None = None) -> torch.nn.Module:
    """The model a training engine wraps (`spec`): the policy or the
    scalar model, gradient checkpointing when asked, and LoRA adapters over it when `spec.lora`; under
    ZeRO-3 (`ds_config`, the engine's DeepSpeed config) partitioned as it loads (models.partitioned_loading)."""
    with models.partitioned_loading(ds_config):
        if spec.kind == "causal":
            model = models.load_policy(spec.model_path, spec.dtype, spec.attn_implementation)
        else:
            model = models.load_scalar_model(spec.model_path, spec.dtype, pad_token_id, spec.attn_implementation)
    if not spec.dropout:
        models.disable_dropout(model)
    if spec.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if spec.lora is not None:
        model = lora.apply(model, spec.lora, spec.kind)
    return model


class TrainWorker:
    """One rank: a model under DeepSpeed. Used as a Ray actor."""

    def __init__(self, rank: int, world_size: int, torch_threads: int, cpu_cores: tuple[int, ...] | None = None):
        self.rank, self.world_size = rank, world_size
        torch.set_num_threads(pin_cpu_cores(cpu_cores, torch_threads))

    def address(self) -> tuple[str, int]:
        """A rendezvous address: this node as Ray knows it (127.0.0.1 for the local Ray, the node's
        cluster address otherwise), and a port reserved for a store this rank will serve."""
        node_id = ray.get_runtime_context().get_node_id()
        ip = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)
        return reserve_address(ip)  # listening from now on, for rank 0's store (engines/placement/rendezvous.py)

    def setup(self, spec: EngineSpec, master: tuple[str, int]) -> None:
        # The device rule (engines/placement/devices.py): the GPU Ray placed this rank on, or the CPU.
        self.device = announce_cpu_accelerator(actor_device())
        deepspeed = import_deepspeed()  # without MLflow (engines/lean_imports.py)
        from deepspeed.accelerator import get_accelerator
        os.environ.update(
            MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(local_rank(self.device)),
        )
        backend = get_accelerator().communication_backend_name()
        if not torch.distributed.is_initialized():
            init_training_group(master, self.rank, self.world_size, self.device, backend)  # served on `master` alone
            with quiet_stdout():  # on the CPU, DeepSpeed prints that its shared-memory op built
                deepspeed.init_distributed(dist_backend=backend)
        random.seed(spec.seed)
        torch.manual_seed(spec.seed)
        self.spec = spec = dataclasses.replace(spec, model_path=local_dir(spec.model_path))  # fetched on this node
        self.tokenizer = models.load_tokenizer(spec.model_path)
        ds_config = spec.ds_config(self.world_size)
        model = load_trainable(spec, self.tokenizer.pad_token_id, ds_config)  # ZeRO-3: partitioned as it loads
        self.loaded_bytes = models.held_bytes(model)
        self.param_metrics = lora.param_metrics(model)  # with LoRA: the optimizer sees the adapters only
        optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad], spec, self.device)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(spec.warmup_steps, spec.total_steps))
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
        )
        lora.pin_frozen_output_layer(self.engine.module, spec.zero_stage)
        self.sender = WeightSender(self.engine.module, spec.zero_stage, self.rank, self.device)
        self.step = 0
        return self.param_metrics

    def reset(self) -> bool:
        """End this rank's engine so that its process can set up another (engines/placement/warm.py): a published
        update waited for, the DeepSpeed engine destroyed (ZeRO's hooks taken off), all it held dropped. True
        where its model was freed; False where something still holds it (then the process should end)."""
        self.sender.sent()
        model = weakref.ref(self.engine.module)
        self.engine.destroy()
        for name in ("engine", "optimizer", "scheduler", "sender", "tokenizer", "spec", "_offloaded"):
            self.__dict__.pop(name, None)
        # ZeRO-3 leaves the last module it entered on a global stack (deepspeed/runtime/zero/parameter_offload.py).
        getattr(sys.modules.get("deepspeed.runtime.zero.parameter_offload"), "FWD_MODULE_STACK", []).clear()
        gc.collect()
        if self.device.type == "cuda":
            # cuBLAS keeps a workspace (~33 MiB on an H200) through torch's allocator once a matmul ran: the next
            # stage's engine gets it back only when cleared before the cache is emptied.
            getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()
            torch.cuda.empty_cache()
        return model() is None

    def device_report(self) -> dict[str, Any]:
        """Where this rank's model lives (tests assert it): device, parameter devices and dtypes, and the
        parameter bytes it held once loaded (ZeRO-3: its partition's)."""
        params = list(self.engine.module.parameters())
        return {"device": str(self.device), "local_rank": int(os.environ["LOCAL_RANK"]),
                "loaded_bytes": self.loaded_bytes,
                "placement_group": placement_group_id(), **cpu_report(),
                "param_devices": sorted({p.device.type for p in params}),
                "param_dtypes": sorted({str(p.dtype) for p in params})}

    def train_step(self, micro_batches: list[dict[str, Any]], objective: Callable,
                   scales: list[float]) -> dict[str, float]:
        """One optimizer step on this rank's micro-batches, each loss times its scale (accumulate.loss_scales),
        gradients accumulated. Metrics: summed as accumulate.add_metrics (the group combines the ranks')."""
        self.engine.train()
        prepare = getattr(objective, "prepare", None)
        shared = prepare(self.engine, micro_batches, self.device) if prepare is not None else {}
        sums: dict[str, Any] = {}  # device tensors until host_metrics
        for i, (micro, scale) in enumerate(zip(micro_batches, scales, strict=True)):
            # DeepSpeed reduces (ZeRO >= 1) and steps only at the boundary: the last micro-batch.
            self.engine.set_gradient_accumulation_boundary(i == len(micro_batches) - 1)
            loss, metrics = objective(self.engine, to_device(micro, self.device), **shared)
            self.engine.backward(loss * scale)
            add_metrics(sums, metrics, scale)
        # DeepSpeed reports the norm only under ZeRO >= 1; at stage 0 the full gradients are on every rank, so
        # take it before step() clears them: in a few fused kernels, left on the device for host_metrics' one read.
        if self.spec.zero_stage == 0:
            grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
            sums["grad_norm"] = torch.nn.utils.get_total_norm(grads, foreach=True).float() if grads else 0.0
        scale = reported_norm_scale(self.engine.optimizer)  # the step's loss scale, before step() updates it
        lr = self.scheduler.get_last_lr()[0]  # the rate this step takes: step() moves the schedule on
        self.engine.step()
        self.step += 1
        metrics = {**host_metrics(sums), **self.param_metrics, "lr": lr}
        if (grad_norm := self.engine.get_global_grad_norm()) is not None:
            metrics["grad_norm"] = float(grad_norm) / scale
        return metrics

    def skip_updates(self, n: int) -> None:
        """The schedule moved on by `n` steps with no optimizer step (TrainerGroup.skip_updates)."""
        with warnings.catch_warnings():  # torch's "lr_scheduler.step() before optimizer.step()", where none was yet
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(n):
                self.scheduler.step()

    @torch.no_grad()
    def evaluate(self, batch: dict[str, Any], fn: Callable, without_adapters: bool = False) -> torch.Tensor:
        """`fn(model, batch)` without gradients (logprobs, values: a tensor with a row per batch row),
        in micro-batches (`micro_batch_size` rows, `micro_batch_tokens` tokens), returned on the CPU.
        `without_adapters`: the LoRA base model computes it (the frozen reference of this policy)."""
        self.engine.eval()
        with lora.adapters_disabled(self.engine.module, without_adapters):
            return to_cpu(in_micro_batches(batch, self.spec.micro_batch_size,
                                           lambda b: fn(self.engine, to_device(b, self.device)),
                                           tokens=self.spec.micro_batch_tokens))

    def offload_states(self) -> None:
        """Optimizer state to CPU memory while colocated rollout engines generate (GPU only; under
        `offload` it lives in CPU memory already)."""
        if self.device.type == "cuda" and self.spec.offload == "none" and not getattr(self, "_offloaded", False):
            move_training_state(self.engine, self.spec.zero_stage, offload=True, device=self.device)
            self._offloaded = True

    def reload_states(self) -> None:
        if getattr(self, "_offloaded", False):
            move_training_state(self.engine, self.spec.zero_stage, offload=False, device=self.device)
            self._offloaded = False

    def save_hf(self, target: Source) -> Entries:
        """Rank 0 writes an HF directory (safetensors + tokenizer; LoRA: merged weights, and the adapter
        in `adapter/`); all ranks gather. A ref: uploaded from this node (alignflow/store/artifacts.py)."""
        state = lora.full_state_dict(self.engine.module, self.spec.zero_stage, keep=self.rank == 0)  # LoRA: merged
        with writing(target) as (directory, uploaded):  # every gather before rank 0's writes: one that fails
            lora.save_adapter(self.engine.module, self.spec.zero_stage, str(directory), write=self.rank == 0)
            if self.rank == 0:  # leaves no rank waiting in a gather
                lora.hf_model(self.engine.module).save_pretrained(directory, state_dict=state, safe_serialization=True)
                self.tokenizer.save_pretrained(directory)
        return uploaded

    def weights_bytes(self) -> bytes | None:
        """Rank 0's full weights as safetensors bytes, under the names an update carries (inspection,
        tests; updates stream through the weight transport). Every rank gathers."""
        from safetensors.torch import save

        state = lora.full_state_dict(self.engine.module, self.spec.zero_stage, keep=self.rank == 0)
        names = lora.weight_names(self.engine.module)
        return save({k: v for k, v in state.items() if k in names}) if self.rank == 0 else None

    # The weight transport's sending side (engines/transport/sync.py: WeightSender, driven by WeightSync).
    def describe_weights(self) -> dict:
        return self.sender.describe()

    def join_transport(self, address: tuple[str, int], world_size: int, backend: str, bucket_bytes: int) -> None:
        self.sender.join(address, world_size, backend, bucket_bytes)

    def send_weights(self, background: bool = False, version: int = 0) -> int:
        return self.sender.send(background, version)

    def weights_sent(self) -> None:
        self.sender.sent()

    def save_state(self, target: Source, extra: dict[str, Any]) -> Entries:
        """Model (rank 0, HF; LoRA: the adapter alone) + this rank's optimizer/scheduler/RNG state. Without ZeRO
        every rank's optimizer state is the same (all-reduced gradients): rank 0's alone is saved, and read by all."""
        with writing(target) as (directory, uploaded):
            if self.spec.lora is None:
                self.save_hf(str(directory))
            else:  # the frozen base is the spec's model
                lora.save_adapter(self.engine.module, self.spec.zero_stage, str(directory), write=self.rank == 0)
            shared = self.spec.zero_stage == 0 and self.rank > 0
            save_state({"optimizer": None if shared else optimizer_state(self.engine, self.spec.zero_stage),
                        "scheduler": self.scheduler.state_dict(), "step": self.step, **rng_state(self.device),
                        "extra": extra},
                       directory, f"trainer-rank{self.rank}")
        return uploaded

    def load_state(self, source: Source) -> dict[str, Any]:
        directory = local_dir(source)  # a checkpoint ref: fetched on this node
        if self.spec.lora is None:
            load_weights(self.engine.module, self.spec.zero_stage, directory, self.rank)
        else:
            lora.load_adapter(self.engine.module, self.spec.zero_stage, directory)
        st = load_state(directory, f"trainer-rank{self.rank}")
        load_optimizer_state(self.engine, self.spec.zero_stage, self.rank, self.world_size, directory, st["optimizer"])
        self.scheduler.load_state_dict(st["scheduler"])
        self.step = st["step"]
        restore_rng(st, self.device)
        return st["extra"]


def reported_norm_scale(optimizer) -> float:
    """What DeepSpeed's reported gradient norm is multiplied by: fp16 at ZeRO-0 with a torch optimizer
    (FP16_UnfusedOptimizer) reports the norm of the loss-scaled gradients (x 65536 at a typical scale), where
    its other optimizers unscale it first."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if not isinstance(optimizer, FP16_UnfusedOptimizer):
        return 1.0
    return float(getattr(optimizer, "loss_scale_config", optimizer).cur_scale)
