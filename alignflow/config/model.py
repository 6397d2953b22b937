"""The base policy: a tiny model built locally, or any HF model directory / hub id."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from alignflow.config.base import Section


class TinyModelConfig(Section):
    """Shape of the locally built Qwen2-family model and its tokenizer."""

    vocab_size: int = Field(320, ge=264, description="byte-level BPE: 256 bytes + specials + merges, at most: "
                            "merges stop where the corpus has no pair left to merge (the bundled task's: 281 "
                            "tokens), and the model's vocabulary is the tokenizer's")
    hidden_size: int = Field(128, ge=16, description="model width (divisible by num_heads)")
    num_layers: int = Field(2, ge=1, description="transformer layers")
    num_heads: int = Field(4, ge=1, description="attention (query) heads")
    num_kv_heads: int = Field(2, ge=1, description="key/value heads (grouped-query attention; divides num_heads)")
    intermediate_size: int = Field(256, ge=16, description="MLP inner width")
    max_position_embeddings: int = Field(128, ge=16, description="token positions: prompt plus response must fit")
    corpus: Literal["largest_digit", "boxes"] = Field(
        "largest_digit", description="the bundled task whose text the tokenizer is trained on (data.synthetic.task)")
    tie_word_embeddings: bool = Field(False, description="output layer shares the input embedding (as Qwen2 "
                                      "0.5B/1.5B, Llama 3.2 1B/3B and Gemma do)")

    def hf_config(self, vocab_size: int | None = None, pad: int | None = None, eos: int | None = None,
                  bos: int | None = None):
        """This shape as the Qwen2 config of the locally built model, with its tokenizer's vocabulary size (its
        length; None: vocab_size, the most it holds) and special token ids."""
        from transformers import Qwen2Config

        return Qwen2Config(
            vocab_size=vocab_size or self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=self.max_position_embeddings,
            # Untied by default; tied works too (the rollout engines' weight update repacks vLLM's CPU copy of a
            # tied output layer: STACK.md).
            tie_word_embeddings=self.tie_word_embeddings,
            pad_token_id=pad, eos_token_id=eos, bos_token_id=bos, torch_dtype="float32")

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide by num_heads, num_heads by num_kv_heads")
        return self


class ModelConfig(Section):
    """The base policy; its initialisation seed derives from the pipeline seed."""

    base: str = Field("tiny", description="tiny: build the tiny model below; else an HF model directory or hub id")
    revision: str | None = Field(
        None, description="a hub id's branch, tag or commit (None: its default branch). Pin a commit to "
        "reproduce a run: an unpinned hub id is keyed by its name, so a new upload under it is not seen")
    tiny: TinyModelConfig = Field(TinyModelConfig(), description="shape of the tiny model (base: tiny)")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="weights of every model; DeepSpeed keeps fp32 master weights and optimizer "
        "state under bfloat16/float16, and logprobs, KL and losses are computed in float32")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa", description="transformers attention kernel of every trained and scoring model "
        "(flash_attention_2 needs the flash-attn package, a GPU and dtype bfloat16 or float16)")

    @model_validator(mode="after")
    def _revision_of_a_hub_id(self) -> ModelConfig:
        if self.revision is not None and self.base == "tiny":
            raise ValueError("revision names a hub model's branch, tag or commit; the tiny model is built here")
        return self

    @model_validator(mode="after")
    def _flash_attention_dtype(self) -> ModelConfig:
        if self.attn_implementation == "flash_attention_2" and self.dtype == "float32":
            raise ValueError("attn_implementation: flash_attention_2 runs in bfloat16 or float16 only, and the "
                             "models load in dtype: float32 (the kernel would refuse the first forward): set "
                             "dtype: bfloat16, or use sdpa")
        return self
