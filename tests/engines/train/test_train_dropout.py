"""Dropout is off in training unless a stage keeps it (`dropout: true`): the log-probs and scores a step
trains on are then those the reference, the scorers and the engines compute, all without dropout."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from alignflow.config import TrainConfig
from engines.train.spec import EngineSpec
from engines.train.worker import load_trainable


@pytest.fixture(scope="module")
def dropout_models(tiny_model, tmp_path_factory):
    """The tiny Qwen2 with attention dropout 0.1 (a float its attention modules keep), and a tiny GPT-2
    with every dropout 0.1 (nn.Dropout modules)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    qwen = tmp_path_factory.mktemp("qwen-dropout")
    shutil.copytree(tiny_model, qwen, dirs_exist_ok=True)
    config = json.loads((qwen / "config.json").read_text())
    (qwen / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    gpt2 = tmp_path_factory.mktemp("gpt2-dropout")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.1,
                               embd_pdrop=0.1, attn_pdrop=0.1)).save_pretrained(gpt2)
    return {"qwen2": qwen, "gpt2": gpt2}


def _spec(path, kind: str, dropout: bool) -> EngineSpec:
    return EngineSpec(model_path=str(path), kind=kind, learning_rate=1e-3, weight_decay=0.0, warmup_steps=0,
                      total_steps=1, zero_stage=0, global_batch=2, grad_clip=1.0, seed=0, torch_threads=1,
                      dropout=dropout)


def _two_forwards(model) -> tuple[torch.Tensor, torch.Tensor]:
    model.train()
    ids = torch.arange(3, 19).reshape(2, 8)
    with torch.no_grad():
        return tuple(model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
                     .hidden_states[-1] for _ in range(2))  # (a fresh scalar head is zero: not its scores)


@pytest.mark.parametrize("name, kind", [("qwen2", "causal"), ("qwen2", "scalar"), ("gpt2", "causal")])
def test_dropout_is_off_in_training_unless_kept(dropout_models, name, kind):
    path = dropout_models[name]
    off = load_trainable(_spec(path, kind, dropout=False), pad_token_id=0)
    a, b = _two_forwards(off)
    assert torch.equal(a, b)
    kept = load_trainable(_spec(path, kind, dropout=True), pad_token_id=0)
    c, d = _two_forwards(kept)
    assert not torch.equal(c, d)
    field = "attention_dropout" if name == "qwen2" else "attn_pdrop"
    assert getattr(off.config, field) == 0.1  # the config a checkpoint saves is the model's own


def test_the_stage_config_carries_the_choice_to_the_engine():
    assert TrainConfig().dropout is False
    spec = EngineSpec.from_config(TrainConfig(dropout=True), model_path="m", kind="causal", total_steps=1,
                                  global_batch=2, dtype="float32", torch_threads=1, seed=0)
    assert spec.dropout is True
