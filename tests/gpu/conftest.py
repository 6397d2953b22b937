"""GPU tests: real engines on CUDA. Skipped, with the reason, where torch sees no CUDA device.

They use engines and math only (the GPU machine has torch, transformers and
peft, and Ray, DeepSpeed and pydantic from ../shared/gpu/stage.sh; no
Prefect, MLflow or vLLM). Run there with:

    source .gpu/activate.sh && python3 -m pytest -m gpu tests/gpu
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_gpu(request):
    """A local Ray that sees the machine's GPUs, started as the pipeline starts it."""
    import ray
    import ray.cloudpickle

    from alignflow.cluster import ray_init_kwargs
    from alignflow.config import InfraConfig

    ray.init(**ray_init_kwargs(InfraConfig()))
    assert ray.cluster_resources().get("GPU", 0) >= 1, ray.cluster_resources()
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def gpu_model(tmp_path_factory) -> Path:
    """A tied-embedding tiny Qwen2 (as Qwen2 0.5B and Llama 3.2 1B tie theirs)."""
    from alignflow.config import TinyModelConfig
    from engines.models import build_tiny_model

    cfg = TinyModelConfig(hidden_size=128, num_layers=2, intermediate_size=256, tie_word_embeddings=True)
    return build_tiny_model(cfg, seed=0, out_dir=tmp_path_factory.mktemp("gpu-model"))


@pytest.fixture(scope="session")
def gpu_tokenizer(gpu_model):
    from engines.models import load_tokenizer

    return load_tokenizer(gpu_model)


@pytest.fixture(scope="session")
def task_data():
    from alignflow.config import SyntheticTaskConfig
    from alignflow.data import synthetic

    return synthetic.generate(SyntheticTaskConfig(num_sft=64, num_preference=64, num_eval=8, num_rl_prompts=32),
                              seed=0)
