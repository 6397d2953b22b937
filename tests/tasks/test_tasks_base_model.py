"""The base_model stage says once what every later stage does silently with a tokenizer that has no pad token."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from alignflow.errors import ConfigError


def _tokenizer_without(directory, *missing: str):
    """The tokenizer saved in `directory` (the tiny one where there is none) without the special tokens
    `missing`."""
    from transformers import AutoTokenizer

    from engines.models import build_tiny_tokenizer

    tok = AutoTokenizer.from_pretrained(directory) if (directory / "tokenizer.json").exists() else \
        build_tiny_tokenizer(300)
    for name in missing:
        setattr(tok, name, None)
    tok.save_pretrained(directory)
    return tok


def test_a_model_whose_tokenizer_has_no_pad_token_is_said_to_pad_with_its_eos(tmp_path, caplog):
    """The base_model stage on a user's model directory (run in this process, as the flow's task runs it)."""
    from alignflow.config import TinyModelConfig, load_config
    from engines.models import build_tiny_model, load_tokenizer
    from tasks.context import RunContext
    from tasks.plan import plan_pipeline
    from tasks.runner import run_stage

    user = build_tiny_model(TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                            intermediate_size=64), seed=0, out_dir=tmp_path / "user")
    tok = _tokenizer_without(user, "pad_token")
    cfg = load_config(None, [f"model.base={user}", f"infra.storage.root={tmp_path / 'artifacts'}",
                             f"infra.storage.cache_dir={tmp_path / 'cache'}",
                             f"infra.mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    with caplog.at_level(logging.WARNING, logger="alignflow"):
        model = run_stage(plan_pipeline(cfg).stages["base_model"], {}, RunContext(infra=cfg.infra))
    [record] = [r for r in caplog.records if "pad token" in r.getMessage()]
    message = record.getMessage()
    assert message.startswith(f"model.base {user}: its tokenizer has no pad token")
    assert f"{tok.eos_token!r} (id {tok.eos_token_id})" in message
    loaded = load_tokenizer(model.uri)  # what the stages then do, as said
    assert loaded.pad_token == tok.eos_token and loaded.pad_token_id == tok.eos_token_id


def test_a_tokenizer_with_a_pad_token_is_not_mentioned(tmp_path, caplog):
    from tasks.stages.base_model import say_padding

    _tokenizer_without(tmp_path)
    with caplog.at_level(logging.WARNING, logger="alignflow"):
        say_padding(str(tmp_path))
    assert not [r for r in caplog.records if "pad token" in r.getMessage()]


def test_a_tokenizer_with_neither_pad_nor_eos_is_refused_naming_the_model(tmp_path):
    from tasks.stages.base_model import say_padding

    _tokenizer_without(tmp_path, "pad_token", "eos_token")
    with pytest.raises(ConfigError, match=rf"model.base {tmp_path}: its tokenizer has neither a pad token nor an EOS"):
        say_padding(str(tmp_path))


def test_a_model_directory_named_as_a_file_uri_with_pickled_weights_is_committed_as_safetensors(tmp_path):
    """model.base as file://… (or ~/…) is the directory preflight and the plan's fingerprint read, not a hub
    id; a directory holding pytorch_model.bin alone is committed as safetensors, with the same weights."""
    import torch
    from safetensors.torch import load_file

    from alignflow.config import TinyModelConfig, load_config
    from engines.models import build_tiny_model, load_policy
    from tasks.context import RunContext
    from tasks.plan import plan_pipeline
    from tasks.runner import run_stage

    user = build_tiny_model(TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                            intermediate_size=64), seed=0, out_dir=tmp_path / "user")
    weights = load_file(str(user / "model.safetensors"))
    (user / "model.safetensors").unlink()
    torch.save(weights, user / "pytorch_model.bin")
    cfg = load_config(None, [f"model.base=file://{user}", f"infra.storage.root={tmp_path / 'artifacts'}",
                             f"infra.storage.cache_dir={tmp_path / 'cache'}",
                             f"infra.mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    model = run_stage(plan_pipeline(cfg).stages["base_model"], {}, RunContext(infra=cfg.infra))
    committed = sorted(p.name for p in Path(model.uri).iterdir())
    assert "model.safetensors" in committed and not [n for n in committed if n.endswith((".bin", ".pt"))], committed
    loaded = load_policy(model.uri).state_dict()
    for name, value in weights.items():
        assert torch.equal(loaded[name], value), name
