"""Nested training state <-> (safetensors file, JSON skeleton); a checkpoint's model weights back.

Optimizer and RNG states are nested dicts/lists of tensors and plain
values. Tensors go into a safetensors file (never a pickle); everything else
into a JSON skeleton where each tensor is replaced by a reference. Values
that are neither (an unknown object) are an error rather than a silent loss.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import random
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from engines.lora import gathered

_REF = "__tensor__"
_TUPLE = "__tuple__"


def _encode(obj: Any, tensors: dict[str, torch.Tensor], path: str) -> Any:
    if isinstance(obj, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = obj.detach().cpu().clone().contiguous()  # no shared storage in safetensors
        return {_REF: name}
    if isinstance(obj, enum.Enum):
        return obj.value
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, dict):
        if not all(isinstance(k, (str, int)) for k in obj):
            raise TypeError(f"state at {path}: dict keys must be str or int")
        # JSON keys are strings: remember which were ints.
        return {"__dict__": [[k, _encode(v, tensors, f"{path}.{k}")] for k, v in obj.items()]}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return {f: _encode(getattr(obj, f), tensors, f"{path}.{f}") for f in obj._fields}
    if dataclasses.is_dataclass(obj):
        return {f.name: _encode(getattr(obj, f.name), tensors, f"{path}.{f.name}") for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return {_TUPLE: [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]
    raise TypeError(f"state at {path}: cannot store {type(obj).__name__} without pickle")


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if _REF in obj:
            return tensors[obj[_REF]]
        if _TUPLE in obj:
            return tuple(_decode(v, tensors) for v in obj[_TUPLE])
        if "__dict__" in obj:
            return {k: _decode(v, tensors) for k, v in obj["__dict__"]}
        return {k: _decode(v, tensors) for k, v in obj.items()}
    return obj


def save_state(state: Any, directory: str | Path, name: str) -> None:
    """Write `name.safetensors` and `name.json` into `directory`."""
    directory = Path(directory)
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(state, tensors, name)
    save_file(tensors, str(directory / f"{name}.safetensors"))
    (directory / f"{name}.json").write_text(json.dumps(skeleton))


def load_state(directory: str | Path, name: str) -> Any:
    directory = Path(directory)
    tensors = load_file(str(directory / f"{name}.safetensors"))
    return _decode(json.loads((directory / f"{name}.json").read_text()), tensors)


def optimizer_state(engine, zero_stage: int) -> dict[str, Any]:
    """A DeepSpeed engine's optimizer state as `save_state` stores it: ZeRO keeps its LossScaler
    object in the state, stored as its scale, a number."""
    optimizer = engine.optimizer.state_dict()
    if zero_stage > 0:
        scaler = optimizer.pop("loss_scaler", None)
        optimizer["loss_scale"] = float(getattr(scaler, "cur_scale", 1.0))
    return optimizer


def load_optimizer_state(engine, zero_stage: int, rank: int, world_size: int, directory: str | Path,
                         own: dict[str, Any] | None) -> None:
    """Restore what `optimizer_state` saved; `own`: this rank's. ZeRO restores a rank from its own
    partition alone, the list's `rank`-th entry (DeepSpeed's rigid checkpoints, its default). Only an
    elastic one (`zero_optimization.elastic_checkpoint`, stages 1-2) merges every saved rank's, so only
    then are the other ranks' files (`trainer-rank{r}` in `directory`) read: each holds a partition of the
    fp32 master weights and Adam moments, and reading them all on every rank would hold the whole
    optimizer state (12 bytes a parameter) in each rank's host memory. Without ZeRO the state is whole and the
    same on every rank: rank 0's file holds it, the others' `own` is None."""
    if zero_stage == 0:
        whole = own if own is not None else load_state(directory, "trainer-rank0")["optimizer"]
        engine.optimizer.load_state_dict(whole)
        return
    merged = getattr(engine.optimizer, "elastic_checkpoint", False)
    parts = [own if r == rank or not merged else load_state(directory, f"trainer-rank{r}")["optimizer"]
             for r in range(world_size)]
    scale = own.get("loss_scale", 1.0)
    for part in {id(p): p for p in parts}.values():
        part.pop("loss_scale", None)
        part["loss_scaler"] = engine.optimizer.loss_scaler
    engine.optimizer.load_state_dict(parts, load_optimizer_states=True, load_from_fp32_weights=True)
    engine.optimizer.loss_scaler.cur_scale = scale


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's random state: Python's, torch's on the CPU and, on a GPU, that GPU's (dropout, LoRA's
    included, draws there): what a resumed step needs to draw the same numbers."""
    state = {"torch_rng": torch.get_rng_state(), "python_rng": list(random.getstate()[1])}
    if device.type == "cuda":
        state["cuda_rng"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    """Set what `rng_state` saved (a checkpoint saved without a GPU's state leaves that GPU's as it is)."""
    torch.set_rng_state(state["torch_rng"])
    python = random.getstate()
    random.setstate((python[0], tuple(state["python_rng"]), python[2]))
    if device.type == "cuda" and "cuda_rng" in state:
        torch.cuda.set_rng_state(state["cuda_rng"], device)


def weight_files(directory: str | Path) -> dict[str, Path]:
    """Each weight name of the HF model directory and the safetensors file holding it: `model.safetensors`, or
    the shards `model.safetensors.index.json` maps (save_pretrained shards a model past its max_shard_size,
    50 GB in transformers 5: a 14B model in fp32, a 32B one in bf16)."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return {k: directory / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return dict.fromkeys(f.keys(), directory / "model.safetensors")


def load_weights(module: torch.nn.Module, zero_stage: int, directory: str | Path, rank: int = 0) -> None:
    """A full model's weights from the HF directory (one safetensors file, or its shards) into `module`: the
    trainer's resume without LoRA. Tied output embeddings are saved once; any other name missing or unexpected
    is an error. Under ZeRO-3 one weight at a time, gathered on every rank and set by rank 0 alone from the
    file: no GPU holds the whole model (below stage 3 each rank reads its own full copy)."""
    from safetensors import safe_open

    state, files = module.state_dict(keep_vars=True), weight_files(directory)
    # Tied: the very tensor of a saved name (transformers' class-level _tied_weights_keys names lm_head
    # whether or not this model ties it, so an untied head missing from the files would pass by it).
    saved = {id(state[k]) for k in files if k in state}
    missing = [k for k in state if k not in files and id(state[k]) not in saved]
    unexpected = sorted(set(files) - set(state))
    if unexpected or missing:
        raise RuntimeError(f"weights in {directory} do not match the model: missing={missing} unexpected={unexpected}")
    done: set[int] = set()
    for path in sorted(set(files.values())):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                t = state[key]
                if id(t) in done:
                    continue
                done.add(id(t))
                param = isinstance(t, torch.nn.Parameter)
                with gathered([t] if param else [], zero_stage, modifier_rank=0):
                    if zero_stage < 3 or rank == 0 or not param:  # buffers are whole on every rank
                        t.data.copy_(f.get_tensor(key))
