"""LoRA adapters through peft: a frozen base, trainable low-rank updates, merged weights for export.

    apply             peft LoRA on a loaded model (a scalar model's score head trains in full)
    param_metrics     trainable vs total parameters (`lora/trainable_fraction`)
    pin_frozen_output_layer   ZeRO-3: the frozen output layer stays gathered through backward
    full_state_dict   the weights under the base model's HF names, W + (alpha/rank)·B·A where adapted,
                      computed into a fresh dict (the training model is not merged in place)
    weight_entries    the same tensors one at a time, for the weight transport's buckets
    save_adapter      adapter_model.safetensors + adapter_config.json in `adapter/`
    load_adapter      the adapter (and score head) back, exactly
    adapters_disabled the base model, for reference log-probabilities from the same weights

Everything takes the module under the DeepSpeed engine (`engine.module`) and works without LoRA too
(a plain HF model), so the trainer has one path. Under ZeRO-3 every rank must call the gathering
functions (`full_state_dict`, `save_adapter`, `load_adapter`; engines/train/state.py `load_weights`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from alignflow.config.base import LoraConfig
from alignflow.config.lora_targets import HEADS, layers_of, target_problem
from alignflow.errors import ConfigError

ADAPTER = "default"  # peft's name of the one adapter
ADAPTER_DIR = "adapter"


def is_lora(module: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(module, PeftModel)


def hf_model(module: torch.nn.Module) -> torch.nn.Module:
    """The HF model under the adapters (its `save_pretrained` writes HF names)."""
    return module.get_base_model() if is_lora(module) else module


def apply(model: torch.nn.Module, cfg: LoraConfig, kind: str) -> torch.nn.Module:
    """`model` with LoRA adapters on `cfg.target_modules`, every base weight frozen; for a scalar model
    (kind != "causal") its head is a full trainable copy (peft `modules_to_save`)."""
    import peft

    heads = [h for h in HEADS if kind != "causal" and isinstance(getattr(model, h, None), torch.nn.Module)]
    if kind != "causal" and not heads:
        raise ConfigError(f"lora: the scalar model {type(model).__name__} has no head named {' or '.join(HEADS)}")
    targets = cfg.target_modules
    if targets != "all-linear" and (problem := target_problem(targets, *layers_of(model), tuple(heads))):
        raise ConfigError(f"lora.target_modules: {problem}")
    config = peft.LoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
        target_modules=list(targets) if isinstance(targets, tuple) else targets,
        modules_to_save=heads or None, task_type="CAUSAL_LM" if kind == "causal" else "SEQ_CLS")
    # Adapters in the model's dtype: DeepSpeed keeps fp32 master weights under bf16/fp16.
    return peft.get_peft_model(model, config, autocast_adapter_dtype=False)


def param_metrics(module: torch.nn.Module) -> dict[str, float]:
    """With LoRA: trainable parameters, all parameters (base + adapters) and their ratio; {} without."""
    if not is_lora(module):
        return {}
    def numel(p: torch.nn.Parameter) -> int:
        return getattr(p, "ds_numel", p.numel())  # ZeRO-3: the whole parameter, not this rank's partition

    trainable = sum(numel(p) for p in module.parameters() if p.requires_grad)
    total = sum(numel(p) for p in module.parameters())
    return {"lora/trainable_params": float(trainable), "lora/total_params": float(total),
            "lora/trainable_fraction": trainable / total}


def pin_frozen_output_layer(module: torch.nn.Module, zero_stage: int) -> None:
    """ZeRO-3 with LoRA: keep the frozen output layer gathered after its forward (DeepSpeed's
    `is_external_param`; it is released again with every parameter at the step).

    engines/train/logits.py runs the output layer in chunks under a non-reentrant activation checkpoint.
    A frozen weight is saved there by reference, not detached, so by recomputation time ZeRO-3 has
    released it (shape [0]) and torch's metadata check fails; a trainable weight is saved detached
    and keeps its storage. Pinned, the weight costs its full size on every rank during the step."""
    if zero_stage != 3 or not is_lora(module):
        return
    head = module.get_output_embeddings()
    for p in head.parameters() if head is not None else []:
        if not p.requires_grad:
            p.ds_persist = p.is_external_param = True


def _wrapped(base: torch.nn.Module) -> dict[str, tuple[str, Any]]:
    """Module name -> (the infix of the tensors it keeps under its HF names, the module), for every
    module peft replaced: LoRA layers keep `base_layer.` (their `lora_*` tensors are not HF weights),
    head copies keep `modules_to_save.default.` (their `original_module.` is the untrained head)."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    out = {}
    for name, m in base.named_modules():
        if isinstance(m, ModulesToSaveWrapper):
            out[name] = (f"modules_to_save.{ADAPTER}.", m)
        elif isinstance(m, LoraLayer):
            out[name] = ("base_layer.", m)
    return out


def _hf_key(key: str, wrapped: dict[str, tuple[str, Any]]) -> str | None:
    """A tensor name of the peft-wrapped model -> its HF name (None: an adapter-only tensor)."""
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):  # the longest wrapped prefix
        prefix = ".".join(parts[:i])
        if prefix in wrapped:
            rest, infix = ".".join(parts[i:]), wrapped[prefix][0]
            return f"{prefix}.{rest[len(infix):]}" if rest.startswith(infix) else None
    return key


@contextlib.contextmanager
def gathered(params: list[torch.nn.Parameter], zero_stage: int, modifier_rank: int | None = None) -> Iterator[None]:
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank, enabled=zero_stage == 3):
        yield


def merged(weight: torch.Tensor, layer) -> torch.Tensor:
    """W + (alpha/rank)·B·A of a LoRA layer whose base weight is `weight`: computed in float32 and rounded
    to W's dtype once. peft's `get_delta_weight` rounds B·A to bf16 on a GPU, and the sum rounds again."""
    from peft.utils.other import transpose

    delta = layer.lora_B[ADAPTER].weight.float() @ layer.lora_A[ADAPTER].weight.float()
    delta = transpose(delta, layer.fan_in_fan_out) * layer.scaling[ADAPTER]
    return (weight.float() + delta.to(weight.device)).to(weight.dtype)


def full_state_dict(module: torch.nn.Module, zero_stage: int, keep: bool = True) -> dict[str, torch.Tensor]:
    """The full weights as CPU copies under the HF names of the base model (tied names share one copy, which
    `save_pretrained` writes once); with LoRA each adapted weight merged: W + (alpha/rank)·B·A. {} where not
    `keep` (the ranks that do not write).

    Under ZeRO-3 every rank gathers the weights one at a time (an adapted one with its adapter), in the same
    order, and only the ranks that keep one copy it to host memory: no GPU holds the whole model at once, which
    a model ZeRO-3 trains because it does not fit one GPU could not."""
    base = hf_model(module)
    wrapped = _wrapped(base) if is_lora(module) else {}
    copies: dict[int, torch.Tensor] = {}  # id of the model's tensor -> its copy (tied names: one)
    out = {}
    for key, t in base.state_dict(keep_vars=True).items():
        name = _hf_key(key, wrapped)
        if name is None:  # an adapter-only tensor
            continue
        if id(t) not in copies:
            params = [t] if isinstance(t, torch.nn.Parameter) else []
            infix, layer = wrapped.get(name.rsplit(".", 1)[0], ("", None))
            adapted = infix == "base_layer." and key.endswith("base_layer.weight")
            if adapted:
                params += [p for n, p in layer.named_parameters() if n.startswith("lora_")]
            with gathered(params, zero_stage):
                value = merged(t, layer) if adapted else t
                copies[id(t)] = value.detach().cpu().clone() if keep else torch.empty(0)
        if keep:
            out[name] = copies[id(t)]
    return out


@dataclass(frozen=True)
class WeightEntry:
    """One tensor a weight update carries: its HF name, full shape and dtype, the parameters it is
    computed from (gathered under ZeRO-3) and how to compute it (inside that gather)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    params: tuple[torch.nn.Parameter, ...]
    value: Callable[[], torch.Tensor]


def _full_shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(t, "ds_shape", t.shape))  # ZeRO-3 partitions a parameter; ds_shape is its own


def weight_entries(module: torch.nn.Module) -> list[WeightEntry]:
    """The tensors of a weight update, in the model's order (a layer's weights together), one at a
    time: what `full_state_dict` computes, restricted to `weight_names`. With LoRA an
    adapted weight is W + (alpha/rank)·B·A, computed on the model's device."""
    base = hf_model(module)
    wrapped = _wrapped(base) if is_lora(module) else {}
    own = {**dict(base.named_parameters()), **dict(base.named_buffers())}
    entries = []
    for key in base.state_dict(keep_vars=True):
        name = _hf_key(key, wrapped)
        if key not in own or name is None:  # a tied alias, an unsaved buffer, an adapter-only tensor
            continue
        t = own[key]
        params = (t,) if isinstance(t, torch.nn.Parameter) else ()
        value: Callable[[], torch.Tensor] = t.detach
        infix, layer = wrapped.get(name.rsplit(".", 1)[0], ("", None))
        if infix == "base_layer." and key.endswith("base_layer.weight"):
            params += tuple(p for n, p in layer.named_parameters() if n.startswith("lora_"))
            value = (lambda w=t, m=layer: merged(w, m).detach())
        entries.append(WeightEntry(name, _full_shape(t), t.dtype, params, value))
    return entries


def weight_names(module: torch.nn.Module) -> set[str]:
    """The HF names a weight update carries (engines/models.weight_shapes of the base model)."""
    from engines.models import weight_shapes

    base = hf_model(module)
    if not is_lora(module):
        return set(weight_shapes(base))
    wrapped = _wrapped(base)
    return {n for n in (_hf_key(k, wrapped) for k in weight_shapes(base)) if n is not None}


def save_adapter(module: torch.nn.Module, zero_stage: int, directory: str | Path, write: bool) -> None:
    """With LoRA: the adapter (and a scalar model's head) as `directory/adapter/` in peft's format
    (adapter_model.safetensors, adapter_config.json), written where `write` (rank 0). No-op without."""
    if not is_lora(module):
        return
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    with gathered([p for _, p in trainable], zero_stage):
        state = {n: p.detach().cpu().clone() for n, p in trainable}
    if write:
        module.save_pretrained(str(Path(directory) / ADAPTER_DIR), state_dict=state, safe_serialization=True,
                               save_embedding_layers=False)


def load_adapter(module: torch.nn.Module, zero_stage: int, directory: str | Path) -> None:
    """The adapter `save_adapter` wrote into `directory` back into `module` (every rank)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(str(Path(directory) / ADAPTER_DIR / "adapter_model.safetensors"))
    trainable = {n: p for n, p in module.named_parameters() if p.requires_grad}
    with gathered(list(trainable.values()), zero_stage, modifier_rank=0):
        result = set_peft_model_state_dict(module, weights, adapter_name=ADAPTER)
    missing = [k for k in result.missing_keys if k in trainable]
    if result.unexpected_keys or missing:
        raise RuntimeError(f"adapter in {directory} does not match the model: missing={missing} "
                           f"unexpected={result.unexpected_keys}")


@contextlib.contextmanager
def adapters_disabled(module: torch.nn.Module, disabled: bool = True) -> Iterator[None]:
    """Within the block, `module` computes as its base model (adapters off; a scalar head as loaded):
    the frozen reference of a LoRA-trained policy, from the same weights. `disabled=False`: no change."""
    if not disabled:
        yield
        return
    if not is_lora(module):
        raise ValueError("adapters disabled on a model without LoRA adapters: it has no frozen base to compute "
                         "(set lora on its engine, or score the reference with its own model)")
    with module.disable_adapter():
        yield
