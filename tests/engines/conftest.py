"""Shared fixtures for the engine tests: a tiny model on disk, and a local Ray for the `engine` tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from alignflow.config import TinyModelConfig


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The default tiny policy (model + tokenizer), built once per session. Treat as read-only."""
    from engines.models import build_tiny_model

    return build_tiny_model(TinyModelConfig(), seed=0, out_dir=tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from engines.models import load_tokenizer

    return load_tokenizer(tiny_model)


@pytest.fixture(scope="module")
def ray_local(request):
    """A local Ray for one test module, started as the pipeline starts it (127.0.0.1, process env).

    Functions defined in the test module are shipped to Ray workers by value:
    the workers cannot import test modules by name.
    """
    import ray
    import ray.cloudpickle

    from alignflow.cluster import ray_init_kwargs
    from alignflow.config import InfraConfig

    if ray.is_initialized():
        pytest.fail("Ray is already initialised; the engine tests start their own")
    ray.cloudpickle.register_pickle_by_value(request.module)
    ray.init(**ray_init_kwargs(InfraConfig()))
    try:
        yield ray
    finally:
        ray.shutdown()
        ray.cloudpickle.unregister_pickle_by_value(request.module)
