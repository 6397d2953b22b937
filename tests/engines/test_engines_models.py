"""The tiny model factory and HF loading: policy, tokenizer, chat template, scalar head."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from alignflow.config import TinyModelConfig
from engines import models


def test_directory_loads_with_transformers(tiny_model):
    names = {p.name for p in tiny_model.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not any(n.endswith((".bin", ".pt", ".pkl")) for n in names)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model))
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    ids = torch.tensor([tok("Which digit is largest? 3 1 4", add_special_tokens=False)["input_ids"]])
    logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()
    assert model.dtype == torch.float32


def test_config_is_qwen2_with_untied_embeddings(tiny_model):
    raw = json.loads((tiny_model / "config.json").read_text())
    cfg = TinyModelConfig()
    assert raw["model_type"] == "qwen2"
    assert raw["architectures"] == ["Qwen2ForCausalLM"]
    assert raw["tie_word_embeddings"] is False
    assert raw["hidden_size"] == cfg.hidden_size
    assert raw["num_hidden_layers"] == cfg.num_layers
    assert raw["num_attention_heads"] == cfg.num_heads
    assert raw["num_key_value_heads"] == cfg.num_kv_heads
    assert raw["intermediate_size"] == cfg.intermediate_size
    assert raw["max_position_embeddings"] == cfg.max_position_embeddings
    # Untied means two distinct tensors in the file, not one saved once.
    weights = load_file(str(tiny_model / "model.safetensors"))
    assert "lm_head.weight" in weights
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])


def test_tokenizer_specials(tiny_model):
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    raw = json.loads((tiny_model / "config.json").read_text())
    assert tok.pad_token == "<|pad|>" and tok.eos_token == "<|end|>" and tok.bos_token == "<|begin|>"
    assert len({tok.pad_token_id, tok.eos_token_id, tok.bos_token_id}) == 3
    assert raw["pad_token_id"] == tok.pad_token_id
    assert raw["eos_token_id"] == tok.eos_token_id
    assert raw["vocab_size"] == len(tok)
    for role in ("<|system|>", "<|user|>", "<|assistant|>"):
        (tid,) = tok(role, add_special_tokens=False)["input_ids"]
        assert tok.convert_ids_to_tokens(tid) == role
    gen = json.loads((tiny_model / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_token_id
    assert gen["pad_token_id"] == tok.pad_token_id


def test_loaded_tokenizer_is_the_built_one(tiny_model):
    # transformers loads any Qwen2 model's tokenizer as Qwen2Tokenizer, with its
    # own pre-tokenizer and default unk token: what was trained must survive that.
    built = models.build_tiny_tokenizer(TinyModelConfig().vocab_size)
    loaded = AutoTokenizer.from_pretrained(str(tiny_model))
    assert len(loaded) == len(built)
    assert loaded.get_vocab() == built.get_vocab()
    texts = ["Which digit is largest? 3 1 4 9 0", "<|user|>hi<|assistant|>7<|end|>", "héllo 世界 12345", "<|endoftext|>"]
    for text in texts:
        assert loaded(text, add_special_tokens=False)["input_ids"] == built(text, add_special_tokens=False)["input_ids"]


def test_every_token_id_has_an_embedding(tiny_model):
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    raw = json.loads((tiny_model / "config.json").read_text())
    assert max(tok.get_vocab().values()) < raw["vocab_size"]
    for special in tok.all_special_tokens:
        assert tok.convert_tokens_to_ids(special) < raw["vocab_size"]


def test_load_tokenizer_pads_right(tiny_model):
    tok = models.load_tokenizer(tiny_model)
    assert tok.padding_side == "right"
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id


@pytest.mark.parametrize("text", ["Which digit is largest? 9 0 1 2 3", "7", "héllo, 世界! <b>", "  two  spaces\n"])
def test_tokenizer_round_trips_any_text(tiny_model, text):
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id is None or tok.unk_token_id not in ids
    assert tok.decode(ids) == text


def test_chat_template(tiny_model):
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    user = [{"role": "user", "content": "Which digit is largest? 3 1 4"}]
    text = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    assert text == "<|user|>Which digit is largest? 3 1 4<|assistant|>"
    assert text.endswith("<|assistant|>")
    assert tok.apply_chat_template(user, add_generation_prompt=False, tokenize=False) == "<|user|>Which digit is largest? 3 1 4"
    convo = [{"role": "system", "content": "Be brief."}, *user, {"role": "assistant", "content": "4"}]
    assert tok.apply_chat_template(convo, tokenize=False) == "<|system|>Be brief.<|user|>Which digit is largest? 3 1 4<|assistant|>4<|end|>"
    # The role markers are single special tokens, and the assistant turn ends with EOS.
    ids = tok(tok.apply_chat_template(convo, tokenize=False), add_special_tokens=False)["input_ids"]
    assert ids[-1] == tok.eos_token_id
    assert ids[0] == tok.convert_tokens_to_ids("<|system|>")


def test_build_is_deterministic_for_a_seed(tiny_model, tmp_path):
    same = load_file(str(models.build_tiny_model(TinyModelConfig(), 0, tmp_path / "a") / "model.safetensors"))
    other = load_file(str(models.build_tiny_model(TinyModelConfig(), 1, tmp_path / "b") / "model.safetensors"))
    ref = load_file(str(tiny_model / "model.safetensors"))
    assert same.keys() == ref.keys() == other.keys()
    assert all(torch.equal(same[k], ref[k]) for k in ref)
    assert any(not torch.equal(other[k], ref[k]) for k in ref)
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tiny_model / "tokenizer.json").read_text()


def test_build_follows_the_config(tmp_path):
    cfg = TinyModelConfig(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=96)
    model = models.load_policy(models.build_tiny_model(cfg, 0, tmp_path))
    assert model.config.hidden_size == 64
    assert len(model.model.layers) == 1
    assert model.model.layers[0].mlp.up_proj.weight.shape == (96, 64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_policy_dtype(tiny_model, dtype):
    assert models.load_policy(tiny_model, dtype).dtype == models.DTYPES[dtype]


# ---- scalar head (reward model / critic) -------------------------------------------------------


def _batch(tok, texts):
    seqs = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
    return {"input_ids": ids, "attention_mask": (torch.arange(width)[None] < torch.tensor([[len(s)] for s in seqs])).long()}


TEXTS = ["Which digit is largest? 3 1 4", "7", "a much longer sequence than the others"]


def test_scalar_model_scores_shape_and_fresh_head_is_neutral(tiny_model, tokenizer):
    model = models.load_scalar_model(tiny_model, pad_token_id=tokenizer.pad_token_id).eval()
    assert model.config.num_labels == 1
    with torch.no_grad():
        scores = model(**_batch(tokenizer, TEXTS)).logits
    assert scores.shape == (len(TEXTS), 1)
    # A fresh head (from a causal-LM checkpoint) is zero: a new critic starts neutral.
    assert torch.equal(scores, torch.zeros_like(scores))


def test_scalar_model_scores_the_last_real_token(tiny_model, tokenizer):
    model = models.load_scalar_model(tiny_model, pad_token_id=tokenizer.pad_token_id).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        model.score.weight.normal_()
        padded = model(**_batch(tokenizer, TEXTS)).logits[:, 0]
        alone = torch.stack([model(**_batch(tokenizer, [t])).logits[0, 0] for t in TEXTS])
    # Right padding does not change a sequence's score.
    assert torch.allclose(padded, alone, atol=1e-5)
    assert len(set(alone.tolist())) == len(TEXTS)


def test_scalar_model_save_and_reload_gives_identical_scores(tiny_model, tokenizer, tmp_path):
    model = models.load_scalar_model(tiny_model, pad_token_id=tokenizer.pad_token_id).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        model.score.weight.normal_()
        for p in model.model.layers[0].parameters():
            p.add_(0.01 * torch.randn_like(p))
        before = model(**_batch(tokenizer, TEXTS)).logits
    models.save_pretrained(model, tokenizer, tmp_path / "rm")
    reloaded = models.load_scalar_model(tmp_path / "rm", pad_token_id=tokenizer.pad_token_id).eval()
    with torch.no_grad():
        after = reloaded(**_batch(tokenizer, TEXTS)).logits
    assert after.shape == (len(TEXTS), 1)
    # Bit-identical weights; the forward may differ in the last ulp (kernel choice
    # can depend on memory layout), so scores are compared to fp32 precision.
    original, loaded = model.state_dict(), reloaded.state_dict()
    assert original.keys() == loaded.keys()
    assert all(torch.equal(original[k], loaded[k]) for k in original)
    torch.testing.assert_close(after, before, rtol=1e-6, atol=1e-6)
    assert not torch.equal(after, torch.zeros_like(after))  # the saved head was loaded, not re-zeroed


def test_gpu_small_config_builds_a_half_billion_qwen2(tokenizer):
    """configs/gpu-small.yaml: a Qwen2 shape of about 0.5B parameters, tied, counted without allocating it."""
    from transformers import Qwen2ForCausalLM

    from alignflow.config import load_config
    from engines.models import tiny_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "gpu-small.yaml")
    config = tiny_config(cfg.model.tiny, tokenizer)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    assert 0.45e9 < params < 0.55e9, params
    assert config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert (config.num_attention_heads, config.num_key_value_heads) == (16, 2)
    assert cfg.model.dtype == "bfloat16" and all(r.colocate_all for r in cfg.rounds)
