"""GPU tests: real engines on CUDA. Skipped, with the reason, where torch sees no CUDA device.

They use engines and math only (the GPU machine has torch, transformers and
peft, and Ray, DeepSpeed and pydantic from ../shared/gpu/stage.sh; no
Prefect, MLflow or vLLM). Run there with:

    source .gpu/activate.sh && python3 -m pytest -m gpu tests/gpu

ALIGNFLOW_GPU_TESTS_DEVICE=cpu runs them on the CPU instead (test_gpu_engines.py says what changes).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ON_CPU = os.environ.get("ALIGNFLOW_GPU_TESTS_DEVICE") == "cpu"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() or ON_CPU:
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_gpu():
    """A local Ray that sees the machine's GPUs, started as the pipeline starts it."""
    import ray

    from alignflow.cluster import init_ray, ray_init_kwargs
    from alignflow.config import InfraConfig

    init_ray(**ray_init_kwargs(InfraConfig()))  # started again if its node times out starting
    assert ON_CPU or ray.cluster_resources().get("GPU", 0) >= 1, ray.cluster_resources()
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module", autouse=True)
def _test_functions_by_value(request):
    """Functions defined in a test module (a reward rule, a probe run through `__ray_call__`) travel to
    Ray workers by value: the workers cannot import test modules by name."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(request.module)
    try:
        yield
    finally:
        ray.cloudpickle.unregister_pickle_by_value(request.module)


@pytest.fixture(scope="session")
def gpu_model(tmp_path_factory) -> Path:
    """A tied-embedding tiny Qwen2 (as Qwen2 0.5B and Llama 3.2 1B tie theirs)."""
    from alignflow.config import TinyModelConfig
    from engines.models import build_tiny_model

    cfg = TinyModelConfig(hidden_size=128, num_layers=2, intermediate_size=256, tie_word_embeddings=True)
    return build_tiny_model(cfg, seed=0, out_dir=tmp_path_factory.mktemp("gpu-model"))


@pytest.fixture(scope="session")
def gpu_reward_model(gpu_model, tmp_path_factory) -> Path:
    """A reward model from the tiny policy with a random score head (a fresh head scores 0 everywhere:
    no reward, no advantage, nothing to learn; a critic started from it would predict 0 too)."""
    from engines import models

    tokenizer = models.load_tokenizer(gpu_model)
    reward_model = models.load_scalar_model(gpu_model, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(1)
    with torch.no_grad():
        reward_model.score.weight.normal_()
    out = tmp_path_factory.mktemp("gpu-rm")
    models.save_pretrained(reward_model, tokenizer, out)
    return out


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
