"""Model construction, loading and saving (Hugging Face format, safetensors).

- `build_tiny_model` makes a small Qwen2-family causal LM and a byte-level BPE
  tokenizer trained locally, with special tokens and a chat template, saved
  as a directory that `transformers` and `vllm` load directly.
- Any local HF model directory (or hub id, where a hub is reachable) works
  in its place: see `load_policy`.
- Reward models and critics are the LM backbone with a scalar head:
  `AutoModelForSequenceClassification(num_labels=1)`, which scores the last
  non-padding token and saves/loads like any HF model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from engines.lean_imports import deepspeed_left_unloaded, lean_transformers

lean_transformers()  # before transformers loads its model code

from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from alignflow.config import TinyModelConfig  # noqa: E402
from alignflow.data.synthetic import tokenizer_corpus  # noqa: E402

# "unk" is never produced by byte-level BPE, but transformers loads any Qwen2
# model's tokenizer as Qwen2Tokenizer, which adds its unk token if it is absent.
SPECIAL_TOKENS = {"pad": "<|pad|>", "eos": "<|end|>", "bos": "<|begin|>", "unk": "<|endoftext|>"}
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
# Roles as tokens; an assistant turn ends with the EOS token. Tools (apply_chat_template(tools=...)) are
# listed by name and parameters in a system turn first; a tool's result is a system turn; calls are
# Hermes-style <tool_call>{json}</tool_call> in the assistant's text (alignflow/agents/tools.py).
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for t in tools %} {{ t['function']['name'] }}"
    "({{ t['function']['parameters']['properties'] | join(', ') }}){% endfor %}{% endif %}"
    "{% for m in messages %}<|{{ 'system' if m['role'] == 'tool' else m['role'] }}|>{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_tiny_tokenizer(vocab_size: int, corpus: Iterable[str] | None = None) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on `corpus` (None: the bundled task's text); covers any input. The
    vocabulary reaches `vocab_size` only where the corpus has enough distinct pairs to merge.

    Normalizer and pre-tokenizer are Qwen2's: `AutoTokenizer` rebuilds them
    for any Qwen2 model, so training with others would save merges that the
    loaded tokenizer splits differently.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    specials = list(SPECIAL_TOKENS.values()) + ROLE_TOKENS
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus if corpus is not None else tokenizer_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=SPECIAL_TOKENS["pad"],
        eos_token=SPECIAL_TOKENS["eos"],
        bos_token=SPECIAL_TOKENS["bos"],
        unk_token=SPECIAL_TOKENS["unk"],
        additional_special_tokens=ROLE_TOKENS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "right"
    return fast


def tiny_config(cfg: TinyModelConfig, tokenizer) -> Qwen2Config:
    """The Qwen2 config of the locally built model: `cfg`'s shape, `tokenizer`'s vocabulary and specials."""
    return cfg.hf_config(len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id)


def build_tiny_model(cfg: TinyModelConfig, seed: int, out_dir: str | Path, corpus: Iterable[str] | None = None) -> Path:
    """Build and save the tiny policy (model + tokenizer trained on `corpus`) into `out_dir`."""
    out_dir = Path(out_dir)
    tokenizer = build_tiny_tokenizer(cfg.vocab_size, corpus)
    torch.manual_seed(seed)
    config = tiny_config(cfg, tokenizer)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id
    )
    save_pretrained(model, tokenizer, out_dir)
    return out_dir


def save_pretrained(model: PreTrainedModel, tokenizer, out_dir: str | Path) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with deepspeed_left_unloaded():  # transformers' unwrap would import DeepSpeed (engines/lean_imports.py)
        model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def load_tokenizer(path: str | Path, revision: str | None = None):
    tok = AutoTokenizer.from_pretrained(str(path), revision=revision)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    return tok


def max_positions(path: str | Path, revision: str | None = None) -> int:
    """How many token positions the model at `path` takes (its config's max_position_embeddings)."""
    cfg = AutoConfig.from_pretrained(str(path), revision=revision)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        if getattr(cfg, name, None):
            return int(getattr(cfg, name))
    raise ValueError(f"{path}: the model config names no position limit (max_position_embeddings)")


def text_config(module: torch.nn.Module):
    """The config of a model's language part: its own, or a multimodal model's text config."""
    config = module.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def hf_module(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model under a DeepSpeed engine (`.module`) and a peft wrapper (`get_base_model()`)."""
    module = getattr(model, "module", model)
    return module.get_base_model() if hasattr(module, "get_base_model") else module


def last_hidden(model: torch.nn.Module, **inputs) -> torch.Tensor:
    """The last layer's (normed) hidden states of `model(**inputs)`: (..., L, H), which
    `output_hidden_states=True` gives last, without asking for it: that keeps every layer's output alive
    to the end of the forward, (layers + 1) x B x L x H of memory under no_grad (scoring), where a hook on
    the model's body (the decoder stack the head reads) keeps one. The call still goes through `model`
    (a DeepSpeed engine's hooks); no KV cache unless `use_cache` is given."""
    module = hf_module(model)
    body = getattr(module, "base_model", module)
    inputs.setdefault("use_cache", False)  # a config's default cache is memory nothing here reads
    if body is module:  # no separate body: the model's own record of its hidden states
        return model(**inputs, output_hidden_states=True).hidden_states[-1]
    seen: list[torch.Tensor] = []
    handle = body.register_forward_hook(
        lambda m, args, out: seen.append(out[0] if isinstance(out, tuple) else out.last_hidden_state))
    try:
        model(**inputs)
    finally:
        handle.remove()
    return seen[-1]


def output_rows(path: str | Path) -> int:
    """The rows of the output layer of the model at `path` (its config's vocab_size), which may exceed
    its tokenizer's size (padded vocabularies: Qwen2.5-7B's 152064 against 0.5B's 151936)."""
    return int(AutoConfig.from_pretrained(str(path)).get_text_config().vocab_size)


def _attention(attn: str) -> str:
    """The attention implementation, checked before any weight is read."""
    if attn == "flash_attention_2":
        import importlib.util

        if importlib.util.find_spec("flash_attn") is None:
            from alignflow.errors import ConfigError

            raise ConfigError("model.attn_implementation: flash_attention_2 needs the flash-attn package "
                              "(and a GPU); it is not installed here; use sdpa")
    return attn


DROPOUT_ATTRIBUTES = ("attention_dropout", "attn_dropout", "dropout", "dropout_rate", "hidden_dropout",
                      "resid_dropout", "drop_path")


def disable_dropout(model: torch.nn.Module) -> None:
    """Every dropout of `model` off, in training too: each `nn.Dropout`, and the probabilities attention
    modules keep as plain floats (Qwen2's and Llama's `attention_dropout`, passed to sdpa when training).
    The model's config, which a checkpoint saves, is left as it is."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name in DROPOUT_ATTRIBUTES:
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)


def load_policy(path: str | Path, dtype: str = "float32", attn: str = "sdpa", revision: str | None = None,
                ) -> PreTrainedModel:
    """A causal LM from a directory or a hub id (at `revision`: a hub id's branch, tag or commit)."""
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype], attn_implementation=_attention(attn),
                                                revision=revision)


@contextlib.contextmanager
def partitioned_loading(ds_config: dict[str, Any] | None) -> Iterator[None]:
    """Models loaded inside have every parameter partitioned across the ranks as it is read (DeepSpeed's
    zero.Init through transformers), where `ds_config` is ZeRO-3's: no rank holds all the parameters at
    once (each reads the safetensors checkpoint memory-mapped), so a model larger than one GPU loads.
    Other configs (None): as they are."""
    if ds_config is None or ds_config["zero_optimization"]["stage"] != 3:
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    active = HfDeepSpeedConfig(ds_config)  # transformers holds it by a weak reference while it lives
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del active


def _whole(params: list[torch.nn.Parameter]):
    """Parameters partitioned as they loaded (`partitioned_loading`) gathered whole, and written back from
    rank 0 on leaving; other parameters as they are (and scorers, which never partition, never import
    DeepSpeed for it: lora.gathered goes by the ZeRO stage, which a loader does not know)."""
    if not any(hasattr(p, "ds_id") for p in params):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=0)


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters this process holds: of its partitions, where they are partitioned (ZeRO-3)."""
    return sum(t.numel() * t.element_size() for t in (getattr(p, "ds_tensor", p) for p in model.parameters()))


def weight_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The tensors a weight update carries, by name: the model's state dict less the aliases of tied
    weights (an output layer tied to the input embedding travels once, under the embedding's name,
    as `save_pretrained` writes it) and less buffers that are not saved."""
    state = model.state_dict()
    own = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    return {k: tuple(v.shape) for k, v in state.items() if k in own}


def load_scalar_model(path: str | Path, dtype: str = "float32", pad_token_id: int | None = None,
                      attn: str = "sdpa") -> PreTrainedModel:
    """A reward model or critic: the backbone plus a 1-output linear head.

    From a causal-LM checkpoint the head is newly initialised (to zero, so a
    fresh critic starts neutral); from a saved reward model it is loaded.
    """
    model, info = AutoModelForSequenceClassification.from_pretrained(
        str(path), num_labels=1, dtype=DTYPES[dtype], output_loading_info=True,
        attn_implementation=_attention(attn),
    )
    head = getattr(model, "score", None)
    if head is not None and any(k.startswith("score.") for k in info["missing_keys"]):
        with torch.no_grad(), _whole(list(head.parameters())):
            for p in head.parameters():
                p.zero_()
    if pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
    return model
