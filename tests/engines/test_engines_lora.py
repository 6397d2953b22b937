"""LoRA (peft) in the DeepSpeed training engine on Ray (CPU, gloo) with the tiny model.

Only the adapters train (a small, exactly known share of the parameters); the
base stays frozen and, adapters disabled, computes the base model's numbers;
the HF export and rollout weight updates carry merged weights that plain
transformers loads; the adapter is saved beside them; resume state is the
adapter and its optimizer state, restored exactly.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load, load_file

from alignflow.config import SyntheticTaskConfig
from alignflow.config.base import EngineConfig, LoraConfig
from alignflow.data import synthetic
from alignflow.errors import ConfigError
from engines import batches
from engines.train import objectives
from engines.train.group import TrainerGroup
from engines.train.spec import EngineSpec
from engines.train.supervised import plan

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("warm_actors")]  # engines/placement/warm.py

RANK, ALPHA = 4, 8.0
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
BATCH, STEPS = 16, 6


@pytest.fixture(scope="module")
def splits():
    return synthetic.generate(SyntheticTaskConfig(num_sft=64, num_preference=32, num_rl_prompts=1, num_eval=1), seed=0)


@pytest.fixture(scope="module")
def sft_data(splits, tokenizer):
    return batches.sft_tensors(tokenizer, splits["sft"], max_prompt_tokens=64, max_response_tokens=8)[0]


def _spec(model_path, kind: str, **kw) -> EngineSpec:
    lora = LoraConfig(rank=RANK, alpha=ALPHA, target_modules=TARGETS)
    cfg = EngineConfig(learning_rate=1e-2, warmup_steps=0, lora=lora)
    spec = EngineSpec.from_config(cfg, model_path=str(model_path), kind=kind, total_steps=20, global_batch=BATCH,
                                  dtype="float32", torch_threads=1, seed=0)
    return dataclasses.replace(spec, **kw)


def _train(group, data, steps: int, start: int = 0) -> list[dict[str, float]]:
    schedule = plan(data["input_ids"].shape[0], BATCH, epochs=100, max_steps=40, seed=0)
    return [group.train_step(batches.shard(batches.take(data, schedule.indices(s)), group.world_size),
                             objectives.causal_lm_objective, weigh=objectives.response_tokens) for s in range(start, start + steps)]


@pytest.fixture(scope="module")
def lora_run(ray_local, tiny_model, sft_data):
    """One LoRA SFT group trained for STEPS steps; yields (group, per-step metrics)."""
    group = TrainerGroup(_spec(tiny_model, "causal"), num_workers=1)
    try:
        yield group, _train(group, sft_data, STEPS)
    finally:
        group.shutdown()


def _logits(model, batch):
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()


def _response_logps(model, batch):
    """log π(response | prompt) of each row: (B,)."""
    from engines.train.logits import masked_next_token_logprobs

    return masked_next_token_logprobs(model, batch, batch["loss_mask"]).sum(-1)


def _expected_trainable(model_path) -> int:
    """r·(in + out) per adapted projection, from the model's shapes."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(str(model_path))
    h, kv = c.hidden_size, c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    per_layer = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h)}
    return c.num_hidden_layers * sum(RANK * (i + o) for i, o in per_layer.values())


def test_only_the_adapters_train(lora_run, tiny_model):
    from transformers import AutoModelForCausalLM

    group, history = lora_run
    trainable = _expected_trainable(tiny_model)
    base = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(tiny_model)).parameters())
    m = group.param_metrics
    assert m["lora/trainable_params"] == trainable and m["lora/total_params"] == base + trainable
    assert m["lora/trainable_fraction"] == pytest.approx(trainable / (base + trainable))
    assert m["lora/trainable_fraction"] < 0.05
    for step in history:
        assert step["lora/trainable_fraction"] == m["lora/trainable_fraction"] and step["grad_norm"] > 0
    assert history[-1]["loss"] < history[0]["loss"]


def test_export_is_merged_and_loads_without_peft(lora_run, tiny_model, sft_data, tmp_path):
    from transformers import AutoModelForCausalLM

    group, _ = lora_run
    group.save_hf(str(tmp_path))
    adapter = tmp_path / "adapter"
    assert {p.name for p in adapter.iterdir()} >= {"adapter_model.safetensors", "adapter_config.json"}
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == RANK and config["lora_alpha"] == ALPHA and set(config["target_modules"]) == set(TARGETS)

    # Merged = base + (alpha/r)·B·A on every adapted weight (B, A from the saved adapter); the rest is the base.
    base, merged = load_file(str(tiny_model / "model.safetensors")), load_file(str(tmp_path / "model.safetensors"))
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    assert merged.keys() == base.keys()
    adapted = [k for k in base if k.endswith(tuple(f"{t}.weight" for t in TARGETS))]
    assert len(adapted) == 2 * len(TARGETS)
    for k in base:
        if k in adapted:
            prefix = "base_model.model." + k.removesuffix(".weight")
            delta = (ALPHA / RANK) * lora[f"{prefix}.lora_B.weight"] @ lora[f"{prefix}.lora_A.weight"]
            assert delta.abs().max() > 1e-4, k  # the adapter trained
            torch.testing.assert_close(merged[k], base[k] + delta, rtol=0, atol=1e-6)
        else:
            assert torch.equal(merged[k], base[k]), k
    # A rollout weight update carries the same merged weights.
    update = load(group.weights_bytes())
    assert update.keys() == merged.keys() and all(torch.equal(update[k], merged[k]) for k in merged)

    # Plain transformers (no peft) computes the LoRA model's logits.
    batch = batches.take(sft_data, torch.arange(4))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        torch.testing.assert_close(_logits(hf, batch), group.evaluate(batch, _logits), rtol=0, atol=1e-5)


def test_adapters_disabled_is_the_base_model(lora_run, tiny_model, sft_data):
    from transformers import AutoModelForCausalLM

    group, _ = lora_run
    batch = batches.take(sft_data, torch.arange(8))
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model)).eval()
    with torch.no_grad():
        expected = _response_logps(base, batch)
    reference = group.evaluate(batch, _response_logps, without_adapters=True)
    torch.testing.assert_close(reference, expected, rtol=0, atol=1e-5)
    # The adapters are back afterwards: the trained policy is far from the base.
    assert (group.evaluate(batch, _response_logps) - expected).abs().max() > 0.5


def test_resume_restores_the_adapter_exactly(lora_run, tiny_model, sft_data, tmp_path):
    from engines.train.state import load_state

    group, _ = lora_run
    group.save_state(str(tmp_path), {"step": STEPS})
    names = {p.name for p in tmp_path.iterdir()}
    assert names == {"adapter", "trainer-rank0.safetensors", "trainer-rank0.json"}  # no full model
    # Adam's moments: two per trainable parameter, nothing for the frozen base.
    moments = load_state(tmp_path, "trainer-rank0")["optimizer"]["state"]
    assert sum(v.numel() for s in moments.values() for k, v in s.items() if k != "step") == \
        2 * _expected_trainable(tiny_model)

    resumed = TrainerGroup(_spec(tiny_model, "causal"), num_workers=1)
    try:
        probe = batches.take(sft_data, torch.arange(8))
        assert (resumed.evaluate(probe, _response_logps) - group.evaluate(probe, _response_logps)).abs().max() > 0.5
        assert resumed.load_state(str(tmp_path)) == {"step": STEPS}
        assert torch.equal(resumed.evaluate(probe, _logits), group.evaluate(probe, _logits))
        for original, again in zip(_train(group, sft_data, 2, start=STEPS), _train(resumed, sft_data, 2, start=STEPS)):
            for k in original:
                assert again[k] == pytest.approx(original[k], abs=1e-6, rel=1e-6), k
        w_original, w_resumed = load(group.weights_bytes()), load(resumed.weights_bytes())
        for k in w_original:
            torch.testing.assert_close(w_resumed[k], w_original[k], rtol=0, atol=1e-6)
    finally:
        resumed.shutdown()


def test_lora_reward_model_trains_its_head(ray_local, tiny_model, splits, tokenizer, tmp_path):
    """The scalar head is not adapted but trained in full, exported with the merged backbone."""
    from transformers import AutoModelForSequenceClassification

    pairs, _ = batches.pair_tensors(tokenizer, splits["preference"], max_prompt_tokens=64, max_response_tokens=8)
    n = pairs["input_ids"].shape[0] // 2
    group = TrainerGroup(_spec(tiny_model, "scalar"), num_workers=1)
    try:
        schedule = plan(n, BATCH, epochs=100, max_steps=4, seed=0)
        for step in range(4):
            shards = batches.shard(batches.split_pairs(pairs, schedule.indices(step), n), 1, paired=True)
            group.train_step(shards, objectives.pairwise_objective, weigh=objectives.per_row)
        hidden = json.loads((tiny_model / "config.json").read_text())["hidden_size"]
        assert group.param_metrics["lora/trainable_params"] == _expected_trainable(tiny_model) + hidden  # + score
        group.save_hf(str(tmp_path))
        assert "base_model.model.score.weight" in load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
        rm = AutoModelForSequenceClassification.from_pretrained(str(tmp_path)).eval()
        assert rm.score.weight.abs().sum() > 0  # the head started at zero and trained
        with torch.no_grad():
            hf = rm(input_ids=pairs["input_ids"], attention_mask=pairs["attention_mask"]).logits.squeeze(-1)
        torch.testing.assert_close(hf, group.evaluate(pairs, objectives.scalar_scores), rtol=0, atol=1e-5)
        # Adapters disabled, the head is the base's (zero): every score 0.
        assert group.evaluate(pairs, objectives.scalar_scores, without_adapters=True).abs().max() == 0
    finally:
        group.shutdown()


def test_unknown_target_module_names_the_field_and_the_layers(tiny_model):
    from engines import lora, models

    with pytest.raises(ConfigError, match=r"lora.target_modules: 'qproj' matches no module.*k_proj, lm_head, o_proj"):
        lora.apply(models.load_policy(tiny_model), LoraConfig(target_modules=("q_proj", "qproj")), "causal")
    layers = "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj "  # no score, no lm_head
    with pytest.raises(ConfigError, match=f"'score' is the score head.*layers: {layers}"):
        lora.apply(models.load_scalar_model(tiny_model), LoraConfig(target_modules=("score",)), "scalar")


def _on_meta(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_embeddings_and_a_tied_output_layer_are_refused_as_targets():
    """Adapters are merged into linear layers for the engines and the saved model: an embedding is refused, and
    so is the output layer where it is the input embeddings' weight (tie_word_embeddings), whose merged weight
    the engines could not load for both. Untied, the output layer may be adapted; GPT-2's Conv1D layers are
    linear ones."""
    from transformers import GPT2Config, Qwen2Config

    from alignflow.config.lora_targets import layers_of, target_problem

    shape = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
             "num_key_value_heads": 1, "vocab_size": 64}
    tied, untied = (layers_of(_on_meta(Qwen2Config(**shape, tie_word_embeddings=t))) for t in (True, False))
    assert tied[1] == "lm_head" and untied[1] is None
    assert target_problem(("q_proj", "embed_tokens"), *tied) == (
        "'embed_tokens' matches model.embed_tokens, an embedding: adapters are merged into linear layers only; the "
        "model's linear layers: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj (or all-linear)")
    assert target_problem(("lm_head",), *tied).startswith(
        "'lm_head' matches the output layer lm_head, whose weight is the input embeddings' (tie_word_embeddings)")
    assert target_problem(("self_attn",), *tied).startswith("'self_attn' matches model.layers.0.self_attn, a "
                                                            "Qwen2Attention: adapters")
    assert target_problem(("q_proj", "lm_head"), *untied) is None
    gpt2 = layers_of(_on_meta(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=64, tie_word_embeddings=False)))
    assert target_problem(("c_attn", "c_proj"), *gpt2) is None


def test_merged_bf16_weights_are_rounded_once(tiny_model):
    """A bf16 LoRA layer's merged weight, in the saved checkpoint and in a weight update, is the bf16 value
    nearest W + (alpha/rank)·B·A: summed in float32 and rounded once, not the delta rounded and then summed."""
    from engines import lora, models

    model = lora.apply(models.load_policy(tiny_model, "bfloat16"), LoraConfig(rank=4, alpha=8.0,
                                                                             target_modules=("q_proj",)), "causal")
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.05)
    layer = model.get_base_model().model.layers[0].self_attn.q_proj
    w, a, b = (t.detach().float() for t in (layer.base_layer.weight, layer.lora_A["default"].weight,
                                            layer.lora_B["default"].weight))
    nearest = (w + 2.0 * b @ a).to(torch.bfloat16)
    twice = w.to(torch.bfloat16) + (2.0 * b @ a).to(torch.bfloat16)
    assert (nearest != twice).any()  # the two roundings differ here: the check below can tell them apart
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(lora.full_state_dict(model, 0)[name], nearest)
    entry = next(e for e in lora.weight_entries(model) if e.name == name)
    assert torch.equal(entry.value(), nearest) and entry.dtype == torch.bfloat16


@pytest.mark.parametrize("adapted", [False, True])
def test_the_full_weights_are_gathered_one_at_a_time_and_copied_where_kept(tiny_model, monkeypatch, adapted):
    """Under ZeRO-3 a save or export gathers one weight at a time (an adapted one with its two adapter
    matrices), never the whole model on every GPU; ranks that do not write copy nothing to host memory. The
    weights, tied names and merges are those of the plain state dict."""
    import contextlib

    from engines import lora, models

    model = models.load_policy(tiny_model)
    if adapted:
        model = lora.apply(model, LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj",)), "causal")
    sizes = []

    @contextlib.contextmanager
    def recording(params, zero_stage, modifier_rank=None):
        sizes.append(len(params))
        yield

    monkeypatch.setattr(lora, "gathered", recording)
    state = lora.full_state_dict(model, 3)
    assert max(sizes) == (3 if adapted else 1) and len(sizes) == len(set(map(id, state.values())))
    assert lora.full_state_dict(model, 3, keep=False) == {}
    base = lora.hf_model(model)
    expected = {n: e.value() for n, e in ((e.name, e) for e in lora.weight_entries(model))}
    assert expected.keys() <= state.keys()
    for name, value in expected.items():
        assert torch.equal(state[name], value.cpu()), name
    if not adapted:
        assert state.keys() == base.state_dict().keys()


def _streams_merged_weights(group, tiny_model, probe) -> None:
    """The weight transport under ZeRO-3 with LoRA: each bucket gathered across both ranks and merged,
    then streamed (4 KB buckets: many) into an HF rollout engine, which then samples what the trainer
    computes."""
    import ray

    from engines.rl.experience import from_rollouts
    from engines.rollout.actors import RolloutEngines, start_rollout_actor
    from engines.rollout.base import Sampling
    from engines.transport.sync import WeightSync

    engine = start_rollout_actor("hf", str(tiny_model), num_cpus=0, torch_threads=1)
    try:
        prompts = [row[:6].tolist() for row in probe["input_ids"]]
        sampling = Sampling(n=2, max_new_tokens=5)
        stale = from_rollouts(ray.get(engine.generate.remote(prompts, sampling)), pad_id=0)
        WeightSync(group, RolloutEngines([engine]), bucket_bytes=4 * 2**10).push()
        fresh = from_rollouts(ray.get(engine.generate.remote(prompts, sampling)), pad_id=0)
        for exp, close in ((fresh, True), (stale, False)):
            trainer = group.evaluate(exp.tensors(), objectives.response_logprobs)
            diff = ((exp.rollout_logprobs - trainer) * exp.action_mask).abs().max().item()
            assert (diff <= 1e-4) == close, (close, diff)
    finally:
        ray.kill(engine)


@pytest.mark.parametrize("zero_stage", [3])
def test_lora_under_zero_with_two_workers(ray_local, tiny_model, sft_data, tmp_path, zero_stage):
    """Partitioned (ZeRO-3) across two ranks: the export is merged, adapters disabled give the base, and
    the adapter with its optimizer state resumes exactly. (ZeRO-2 shards only the optimizer state, whose
    save and resume test_train_trainer checks for ZeRO-1, through the same DeepSpeed code.)"""
    from transformers import AutoModelForCausalLM

    spec = _spec(tiny_model, "causal", zero_stage=zero_stage)
    first, resumed = TrainerGroup(spec, num_workers=2), None
    try:
        _train(first, sft_data, 3)
        first.save_state(str(tmp_path / "state"), {"step": 3})
        first.save_hf(str(tmp_path / "hf"))
        probe = batches.take(sft_data, torch.arange(4))
        hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
        base = AutoModelForCausalLM.from_pretrained(str(tiny_model)).eval()
        with torch.no_grad():
            torch.testing.assert_close(_logits(hf, probe), first.evaluate(probe, _logits), rtol=0, atol=1e-5)
            torch.testing.assert_close(_response_logps(base, probe),
                                       first.evaluate(probe, _response_logps, without_adapters=True), rtol=0, atol=1e-5)
        _streams_merged_weights(first, tiny_model, probe)
        resumed = TrainerGroup(spec, num_workers=2)
        assert resumed.load_state(str(tmp_path / "state")) == {"step": 3}
        for original, again in zip(_train(first, sft_data, 2, start=3), _train(resumed, sft_data, 2, start=3)):
            for k in ("loss", "lr", "grad_norm"):
                assert again[k] == pytest.approx(original[k], abs=1e-5, rel=1e-5), k
        w_first, w_resumed = load(first.weights_bytes()), load(resumed.weights_bytes())
        assert w_first.keys() == load_file(str(tiny_model / "model.safetensors")).keys()
        for k in w_first:
            torch.testing.assert_close(w_resumed[k], w_first[k], rtol=0, atol=1e-6)
    finally:
        first.shutdown()
        if resumed is not None:
            resumed.shutdown()


def test_lora_under_zero3_with_gradient_checkpointing_trains_as_without(ray_local, tiny_model, sft_data):
    """Recomputed in backward, a ZeRO-3 layer's frozen base weights must be gathered again (they were released
    after the forward): two ranks with LoRA and gradient checkpointing take the steps they take without it."""
    runs = []
    for checkpointing in (False, True):
        group = TrainerGroup(_spec(tiny_model, "causal", zero_stage=3, gradient_checkpointing=checkpointing),
                             num_workers=2)
        try:
            runs.append(_train(group, sft_data, 2))
        finally:
            group.shutdown()
    for plain, recomputed in zip(*runs):
        for k in ("loss", "grad_norm"):
            assert recomputed[k] == pytest.approx(plain[k], abs=1e-5, rel=1e-5), k
