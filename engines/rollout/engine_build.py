"""A rollout engine in this process: the environment its process needs, then the engine of a backend.

Rollout actors (engines/rollout/actors.py) and the flow's evaluation host (engines/rollout/host.py) build
their engines this way.
"""

from __future__ import annotations

import os

import torch

from alignflow.config import VLLMConfig
from alignflow.errors import ConfigError
from engines.lean_imports import import_vllm, lean_transformers
from engines.placement.devices import isolate_engine_gpus, pin_cpu_cores
from engines.rollout.hf_engine import HFEngine
from engines.rollout.vllm_engine import VLLMEngine, vllm_build_mismatch, vllm_engine_args

BACKENDS = ("vllm", "hf")


def prepare_engine_process(torch_threads: int, cpu_cores: list[int] | None, *, on_gpu: bool = False) -> int:
    """The environment a rollout engine's process needs, set before vLLM loads; the torch threads it got.

    vLLM runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): 3-5 s to start instead of ~30 s, and
    both cores stay with the model. transformers loads without scikit-learn or scipy (engines/lean_imports.py).
    On a GPU (`on_gpu`) the engine compiles: the TORCH_COMPILE_DISABLE every process of a run inherits
    (alignflow/cluster.py, for the CPU) would turn off vLLM's torch.compile and with it its piecewise
    CUDA graphs; `vllm.enforce_eager: true` is the switch for an eager GPU engine. Its process sees only its
    own GPUs, also where Ray leaves them all visible (engines/placement/devices.py: isolate_engine_gpus).
    """
    lean_transformers()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    if on_gpu:
        os.environ.pop("TORCH_COMPILE_DISABLE", None)
        isolate_engine_gpus()
    # Else vLLM drops torch to one thread "for serving": in-process, that thread also runs the model.
    torch_threads = pin_cpu_cores(cpu_cores, torch_threads)
    os.environ["OMP_NUM_THREADS"] = str(torch_threads)
    torch.set_num_threads(torch_threads)
    return torch_threads


def build_engine(backend: str, model_path: str, *, dtype: str = "float32", seed: int = 0, max_model_len: int = 256,
                 attn_implementation: str = "sdpa", vllm: VLLMConfig | None = None, on_gpu: bool = False,
                 sleep_mode: bool = False) -> VLLMEngine | HFEngine:
    """One engine of `backend` on the model at the local path `model_path`, in this process."""
    if backend == "vllm":
        from vllm.platforms import current_platform

        mismatch = vllm_build_mismatch(current_platform.device_name, current_platform.is_cpu(), on_gpu)
        if mismatch:
            raise ConfigError(mismatch)
        import_vllm()  # the rest of vLLM, without scipy and OpenCV (engines/lean_imports.py)
        opts = vllm or VLLMConfig()
        args = vllm_engine_args(opts, model_path=model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
                                on_gpu=on_gpu, sleep_mode=sleep_mode)
        return VLLMEngine(model_path, engine_args=args)
    if backend == "hf":
        return HFEngine(model_path, dtype=dtype, seed=seed, attn_implementation=attn_implementation)
    raise ValueError(f"unknown rollout backend {backend!r}; valid: {sorted(BACKENDS)}")
