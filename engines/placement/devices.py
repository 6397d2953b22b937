"""The one device rule of every actor.

1. An actor's device comes from its Ray placement: the GPUs Ray assigned it
   (`ray.get_gpu_ids()`), or the CPU when it was given none. Its models live
   there for its whole life.
2. Whatever crosses an actor boundary (a batch in, logprobs, values or
   scores out) travels as CPU tensors, and is moved on arrival
   (`to_device`) or before leaving (`to_cpu`). Weights travel through the
   weight transport (engines/transport/), never as device tensors.

Ray normally isolates an actor's GPUs: it sets `CUDA_VISIBLE_DEVICES` to
them, so the actor's first GPU is `cuda:0` and its LOCAL_RANK is 0. Where
isolation is turned off (`RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`, as
when several ranks must address each other's GPUs), the process sees every
GPU and its own is found by position in `CUDA_VISIBLE_DEVICES` (or by its
physical id when that variable is unset). A vLLM engine is the exception: with one GPU
it always takes `cuda:0`, so its process is narrowed to its own GPU first
(`isolate_engine_gpus`); the CUDA IPC transport maps a handle to the
receiver's numbering (engines/transport/wire.py).
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from alignflow.errors import ConfigError, InsufficientResourcesError


def _visible(cuda_visible_devices: str) -> list[str]:
    """CUDA_VISIBLE_DEVICES's entries, in order."""
    return [d.strip() for d in cuda_visible_devices.split(",") if d.strip()]


def placement_device(gpu_ids: Sequence[str | int], cuda_visible_devices: str | None, cuda_count: int) -> torch.device:
    """The device of an actor that Ray assigned `gpu_ids` (empty: none).

    cuda_visible_devices: the process's CUDA_VISIBLE_DEVICES (None: unset).
    cuda_count: how many CUDA devices torch sees in this process.
    """
    if not gpu_ids:
        return torch.device("cpu")
    if cuda_count == 0:
        raise InsufficientResourcesError(
            f"Ray placed this actor on GPU {list(gpu_ids)} but torch sees no CUDA device "
            f"(torch {torch.__version__}: a CPU-only build, or a driver mismatch)")
    first = str(gpu_ids[0])
    if cuda_visible_devices is None:
        index = int(first)
    else:
        visible = _visible(cuda_visible_devices)
        if first not in visible:
            raise InsufficientResourcesError(
                f"Ray assigned GPU {first} but CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} hides it")
        index = visible.index(first)
    if index >= cuda_count:
        raise InsufficientResourcesError(f"GPU index {index} is beyond the {cuda_count} CUDA devices torch sees")
    return torch.device("cuda", index)


def actor_device() -> torch.device:
    """This process's device by the rule above (CPU outside a Ray worker that holds no GPU)."""
    import ray

    gpu_ids = ray.get_gpu_ids() if ray.is_initialized() else []
    count = torch.cuda.device_count() if gpu_ids else 0
    device = placement_device(gpu_ids, os.environ.get("CUDA_VISIBLE_DEVICES"), count)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def engine_visible_devices(gpu_ids: Sequence[str | int], cuda_visible_devices: str | None) -> str | None:
    """The CUDA_VISIBLE_DEVICES that shows an engine's process only the GPUs Ray assigned it, where Ray left
    more visible (`RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`); None where nothing need change: no GPU of its
    own (a tensor-parallel engine's GPUs are its vLLM workers'), or exactly its own already visible. Ray's ids
    are entries of the node's CUDA_VISIBLE_DEVICES where that is set, so they are written back as they are."""
    if not gpu_ids:
        return None
    wanted = [str(g) for g in gpu_ids]
    if cuda_visible_devices is not None:
        visible = _visible(cuda_visible_devices)
        if visible == wanted:
            return None
        hidden = [g for g in wanted if g not in visible]
        if hidden:
            raise InsufficientResourcesError(
                f"Ray assigned GPUs {wanted} but CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} hides {hidden}")
    return ",".join(wanted)


def isolate_engine_gpus() -> str | None:
    """Narrow this process to the GPUs Ray assigned it (`engine_visible_devices`), before CUDA starts in it:
    vLLM's single-GPU executor puts its model on `cuda:0`, which under NOSET is the node's first GPU, whoever
    holds it. What it set CUDA_VISIBLE_DEVICES to; None where it changed nothing."""
    import ray

    gpu_ids = ray.get_gpu_ids() if ray.is_initialized() else []
    value = engine_visible_devices(gpu_ids, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if value is None:
        return None
    if torch.cuda.is_initialized():
        raise RuntimeError(f"CUDA already started in this engine process: it cannot be narrowed to GPUs {value}")
    os.environ["CUDA_VISIBLE_DEVICES"] = value
    return value


def local_rank(device: torch.device) -> int:
    """LOCAL_RANK as DeepSpeed and torch.distributed read it: the index of the rank's GPU among
    those the process sees (0 under Ray's isolation); 0 on the CPU."""
    return (device.index or 0) if device.type == "cuda" else 0


def to_device(tree: Any, device: torch.device | str) -> Any:
    """Every tensor of a (nested dict/list/tuple) batch moved to `device`; other values as they are."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device, non_blocking=False)
    if isinstance(tree, dict):
        return {k: to_device(v, device) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_device(v, device) for v in tree)
    return tree


def to_cpu(tree: Any) -> Any:
    """What an actor returns: every tensor detached and on the CPU."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {k: to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_cpu(v) for v in tree)
    return tree


def placement_group_id() -> str | None:
    """The Ray placement group this actor runs in (None: none), for device reports."""
    import ray

    return ray.get_runtime_context().get_placement_group_id() if ray.is_initialized() else None


def actor_options(num_cpus: float, num_gpus: float, scheduling_strategy=None,
                  resources: dict[str, float] | None = None) -> dict[str, Any]:
    """Ray actor options of a placement: its CPUs and GPUs, custom resources (placement.resources), and
    where a placement group puts it (its bundle then holds the resources: the actor asks for none)."""
    opts: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus}
    if scheduling_strategy is not None:
        opts["scheduling_strategy"] = scheduling_strategy
    elif resources:
        opts["resources"] = dict(resources)
    return opts


def pin_cpu_cores(cores: Sequence[int] | None, threads: int) -> int:
    """Pin this process (and every thread it starts from now on) to `cores` (`placement.cpu_cores`) and
    return the thread count for its math libraries: one per core; `threads` where `cores` is None.
    vLLM's CPU backend binds its OpenMP threads within this affinity."""
    if cores is None:
        return threads
    available = os.sched_getaffinity(0)
    missing = sorted(set(cores) - available)
    if missing:
        raise ConfigError(f"placement.cpu_cores: cores {missing} are not available to this actor's process on "
                          f"node {socket.gethostname()} (available: {sorted(available)})")
    os.sched_setaffinity(0, cores)
    os.environ["OMP_NUM_THREADS"] = str(len(cores))
    return len(cores)


def cpu_report() -> dict[str, Any]:
    """The cores this process may run on and its torch threads (device reports; tests assert them)."""
    return {"cpu_affinity": sorted(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads()}


def announce_cpu_accelerator(device: torch.device) -> torch.device:
    """On the CPU, tell DeepSpeed so up front (it then does not warn that it fell back to it)."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return device


@contextlib.contextmanager
def quiet_stdout() -> Iterator[None]:
    """A library's prints off the console while the CLI runs quiet (ALIGNFLOW_QUIET=1, flows/console.py)."""
    if os.environ.get("ALIGNFLOW_QUIET") != "1":
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()):
        yield
