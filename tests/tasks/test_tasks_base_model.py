"""The base_model stage says once what every later stage does silently with a tokenizer that has no pad token."""

from __future__ import annotations

import logging

import pytest

from alignflow.errors import ConfigError


def _tokenizer_without(tmp_path, *missing: str):
    from engines.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer(300)
    for name in missing:
        setattr(tok, name, None)
    tok.save_pretrained(tmp_path)
    return tok


def test_a_tokenizer_without_a_pad_token_is_said_to_pad_with_its_eos(tmp_path, caplog):
    from engines.models import load_tokenizer
    from tasks.base_model import say_padding

    tok = _tokenizer_without(tmp_path, "pad_token")
    with caplog.at_level(logging.WARNING, logger="alignflow"):
        say_padding(tmp_path, "my/model")
    [record] = [r for r in caplog.records if "pad token" in r.getMessage()]
    message = record.getMessage()
    assert message.startswith("model.base my/model: its tokenizer has no pad token")
    assert f"{tok.eos_token!r} (id {tok.eos_token_id})" in message
    loaded = load_tokenizer(tmp_path)  # what the stages then do, as said
    assert loaded.pad_token == tok.eos_token and loaded.pad_token_id == tok.eos_token_id


def test_a_tokenizer_with_a_pad_token_is_not_mentioned(tmp_path, caplog):
    from tasks.base_model import say_padding

    _tokenizer_without(tmp_path)
    with caplog.at_level(logging.WARNING, logger="alignflow"):
        say_padding(tmp_path, "my/model")
    assert not [r for r in caplog.records if "pad token" in r.getMessage()]


def test_a_tokenizer_with_neither_pad_nor_eos_is_refused_naming_the_model(tmp_path):
    from tasks.base_model import say_padding

    _tokenizer_without(tmp_path, "pad_token", "eos_token")
    with pytest.raises(ConfigError, match=r"model.base my/model: its tokenizer has neither a pad token nor an EOS"):
        say_padding(tmp_path, "my/model")
