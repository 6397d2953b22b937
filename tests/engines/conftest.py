"""Shared fixtures for the engine tests: a tiny model on disk (their local Ray: tests/conftest.py `ray_local`)."""

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
