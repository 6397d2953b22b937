"""How alignflow starts or joins Ray, in one place (flows and tasks both use it)."""

from __future__ import annotations

import os
from typing import Any

from alignflow.config import InfraConfig

# Set in the driver before Ray starts; Ray workers inherit them.
PROCESS_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    # Seen to keep every Ray port on 127.0.0.1 (STACK.md).
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    # vLLM in-process inside its Ray actor: 3-5 s start instead of ~30 s.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    # The first logprobs request would otherwise JIT-compile for 12-15 s.
    "TORCH_COMPILE_DISABLE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_LOGGING_LEVEL": "WARNING",
}

# Forwarded to Ray workers explicitly (they may run on other nodes). Never
# credentials: runtime_env is recorded by Ray; workers of a local Ray inherit
# the driver's environment, and a cluster's nodes carry their own.
FORWARDED_ENV = ("PREFECT_API_URL", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "MLFLOW_S3_ENDPOINT_URL")


def apply_process_env() -> None:
    for k, v in PROCESS_ENV.items():
        os.environ.setdefault(k, v)


def ray_init_kwargs(infra: InfraConfig) -> dict[str, Any]:
    """`ray.init` arguments: a local Ray on 127.0.0.1, or the configured cluster."""
    apply_process_env()
    env = {k: os.environ[k] for k in (*PROCESS_ENV, *FORWARDED_ENV) if k in os.environ}
    kwargs: dict[str, Any] = {"runtime_env": {"env_vars": env}}
    if infra.ray_address:
        return {"address": infra.ray_address, **kwargs}
    return {
        "num_cpus": infra.ray_num_cpus,
        "include_dashboard": False,
        "object_store_memory": 512 * 2**20,
        "_node_ip_address": "127.0.0.1",
        **kwargs,
    }


def ensure_ray(infra: InfraConfig) -> None:
    """Inside a RayTaskRunner worker Ray is already up; otherwise start or join one."""
    import ray

    if not ray.is_initialized():
        ray.init(**ray_init_kwargs(infra))
