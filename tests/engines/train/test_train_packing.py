"""Sequence packing: the layout by hand, the attention mask, and packed objectives equal to unpacked ones."""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import pytest
import torch

from alignflow.errors import DataError
from engines.batches import pad_right, right_padded
from engines.train.packing import block_causal_mask, model_inputs, pack_batch, pack_rows

# Four samples of 3, 5, 2, 4 tokens; token j of sample i is 10 * (i + 1) + j.
LENGTHS = [3, 5, 2, 4]
SEQS = [[10 * (i + 1) + j for j in range(n)] for i, n in enumerate(LENGTHS)]


def _rows(seqs, prompt_lens, pad_id=0):
    masks = [[0] * p + [1] * (len(s) - p) for s, p in zip(seqs, prompt_lens)]
    return {**right_padded(seqs, pad_id), "loss_mask": pad_right(masks, 0)}


def test_pack_layout_by_hand():
    # First-fit-decreasing into rows of 6: 5 (sample 1) opens row 0; 4 (sample 3) opens row 1;
    # 3 (sample 0) fits neither (room 1, 2): row 2; 2 (sample 2) fits row 1 (room 2).
    packed, stats = pack_rows(_rows(SEQS, [1, 2, 1, 3]), 6, pad_id=0)
    assert packed["input_ids"].tolist() == [[20, 21, 22, 23, 24, 0], [40, 41, 42, 43, 30, 31], [10, 11, 12, 0, 0, 0]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0], [0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 1, 2]]
    assert packed["sample_index"].tolist() == [[1, 1, 1, 1, 1, -1], [3, 3, 3, 3, 2, 2], [0, 0, 0, -1, -1, -1]]
    assert packed["loss_mask"].tolist() == [[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 0, 1], [0, 1, 1, 0, 0, 0]]
    assert (stats.samples, stats.rows, stats.width, stats.tokens) == (4, 3, 6, 14)
    assert stats.fill == pytest.approx(14 / 18)
    # as step metrics: (sum, count) pairs, so micro-batches and ranks add up exactly
    assert stats.as_metrics() == {"packing/fill": (14.0, 18.0), "packing/rows_per_sample": (3.0, 4.0)}
    # every token kept, each sample whole and in order, in exactly one row
    for i, seq in enumerate(SEQS):
        rows, cols = (packed["sample_index"] == i).nonzero(as_tuple=True)
        assert len(set(rows.tolist())) == 1
        assert cols.tolist() == list(range(cols[0], cols[0] + len(seq)))
        assert packed["input_ids"][rows, cols].tolist() == seq
        assert packed["position_ids"][rows, cols].tolist() == list(range(len(seq)))


def test_a_row_longer_than_max_tokens_is_an_error_naming_it():
    with pytest.raises(DataError, match="row 1 has 5 tokens, more than max_tokens=4"):
        pack_rows(_rows(SEQS, [1, 1, 1, 1]), 4)


def test_rows_must_be_right_padded():
    rows = _rows(SEQS, [1, 1, 1, 1])
    rows["attention_mask"][2] = torch.tensor([0, 1, 1, 0, 0])
    with pytest.raises(DataError, match=r"rows \[2\] are not right-padded"):
        pack_rows(rows, 8)


def test_block_causal_mask_by_hand():
    sample = torch.tensor([[3, 3, 3, 2, 2, -1]])
    mask = block_causal_mask(sample)
    expected = [[k <= q and sample[0, k] == sample[0, q] for k in range(6)] for q in range(6)]
    assert mask.shape == (1, 1, 6, 6) and mask.dtype == torch.bool
    assert mask[0, 0].tolist() == expected
    additive = block_causal_mask(sample, torch.float32)[0, 0]
    assert (additive == 0).tolist() == expected
    assert additive[3, 0].item() == torch.finfo(torch.float32).min


def test_flash_attention_gets_varlen_segments_and_no_mask():
    packed, _ = pack_rows(_rows(SEQS, [1, 1, 1, 1]), 6)
    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))
    inputs = model_inputs(model, packed)
    assert "attention_mask" not in inputs
    # segments of the flattened 3 x 6 tokens: 5 | pad 1 | 4 | 2 | 3 | pad 3
    assert inputs["cu_seq_lens_q"].tolist() == [0, 5, 6, 10, 12, 15, 18]
    assert inputs["cu_seq_lens_q"].dtype == torch.int32
    assert inputs["max_length_q"] == inputs["max_length_k"] == 5
    assert torch.equal(inputs["position_ids"], packed["position_ids"])
    sdpa = model_inputs(SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa")), packed)
    assert sdpa["attention_mask"].shape == (3, 1, 6, 6) and "cu_seq_lens_q" not in sdpa


# ---- a tiny model ------------------------------------------------------------------------


def _batch(tokenizer, n: int = 7, seed: int = 0) -> dict[str, torch.Tensor]:
    """Samples of 6..40 tokens (prompts of 2..5), no special token inside."""
    gen = torch.Generator().manual_seed(seed)
    first, vocab = len(tokenizer.all_special_ids) + 8, len(tokenizer)
    seqs, prompts = [], []
    for _ in range(n):
        length = int(torch.randint(6, 41, (1,), generator=gen))
        seqs.append(torch.randint(first, vocab, (length,), generator=gen).tolist())
        prompts.append(int(torch.randint(2, 6, (1,), generator=gen)))
    return _rows(seqs, prompts, tokenizer.pad_token_id)


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def policy(request, tiny_model):
    from engines.models import load_policy

    return load_policy(tiny_model, attn=request.param)


@pytest.fixture(scope="module")
def reward_model(tiny_model, tokenizer):
    from engines.models import load_scalar_model

    model = load_scalar_model(tiny_model, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():  # the fresh head is zero: give it weights, so the scores differ
        model.score.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(1))
    return model


@pytest.mark.parametrize("wider", [1, 3])
def test_packed_sft_loss_and_gradients_equal_unpacked(policy, tokenizer, wider):
    from engines.train.objectives import causal_lm_objective
    from engines.train.packed_objectives import packed_causal_lm_objective

    batch = _batch(tokenizer)
    width = batch["input_ids"].shape[1]
    packed, _ = pack_batch(batch, width * wider)
    assert packed["input_ids"].shape[0] < batch["input_ids"].shape[0]  # several samples per row

    grads = []
    for objective in (causal_lm_objective, lambda m, b: packed_causal_lm_objective(m, b, max_tokens=width * wider)):
        policy.zero_grad()
        loss, metrics = objective(policy, batch)
        loss.backward()
        grads.append({k: p.grad.clone() for k, p in policy.named_parameters() if p.grad is not None})
        grads[-1]["_loss"], grads[-1]["_tokens"] = loss.detach(), tuple(map(float, metrics["response_length"]))
    plain, packed_grads = grads
    expected_tokens = float(batch["loss_mask"][:, 1:].sum())
    assert plain["_tokens"] == packed_grads["_tokens"] == (expected_tokens, batch["input_ids"].shape[0])
    assert abs(plain["_loss"].item() - packed_grads["_loss"].item()) < 1e-5
    assert plain.keys() == packed_grads.keys()
    for k in plain:
        torch.testing.assert_close(packed_grads[k], plain[k], rtol=1e-4, atol=1e-6, msg=k)


def test_dft_packed_equals_unpacked_and_logs_the_nll_beside_it(policy, tokenizer):
    from engines.train.objectives import causal_lm_objective
    from engines.train.packed_objectives import packed_causal_lm_objective

    batch = _batch(tokenizer)
    width = batch["input_ids"].shape[1]
    nll, _ = causal_lm_objective(policy, batch)
    dft, metrics = causal_lm_objective(policy, batch, loss="dft")
    packed, packed_metrics = packed_causal_lm_objective(policy, batch, max_tokens=2 * width, loss="dft")
    assert metrics["nll"].item() == pytest.approx(nll.item(), abs=1e-6)
    assert packed_metrics["nll"].item() == pytest.approx(nll.item(), abs=1e-5)
    assert packed.item() == pytest.approx(dft.item(), abs=1e-6)
    assert 0 < dft.item() <= 1 / math.e and dft.item() < nll.item()  # -p log p per token: in [0, 1/e], below -log p


def test_neftune_noise_reaches_the_embeddings_at_each_samples_own_scale(policy, tokenizer):
    """The packed rows' lengths are each sample's own (not its row's); inside the context each embedding moves by
    at most alpha / sqrt(n d), padding not at all, and on leaving the hook is gone."""
    from engines.train.logits import embedding_noise, token_lengths
    from engines.train.objectives import causal_lm_objective

    batch = _batch(tokenizer)
    own = batch["attention_mask"].sum(1)
    packed, _ = pack_batch(batch, 2 * batch["input_ids"].shape[1])
    lengths = token_lengths(packed)
    real = packed["sample_index"] >= 0
    assert torch.equal(lengths[real], own[packed["sample_index"][real]]) and (lengths[~real] == 0).all()

    emb, ids, alpha = policy.get_input_embeddings(), batch["input_ids"], 5.0
    with torch.no_grad():
        clean = emb(ids)
        with embedding_noise(policy, alpha, batch):
            noisy = emb(ids)
        assert torch.equal(emb(ids), clean)
    scale = alpha / torch.sqrt(token_lengths(batch).clamp(min=1).float() * clean.shape[-1])
    moved = (noisy - clean).abs().amax(-1)
    pad = batch["attention_mask"] == 0
    assert (moved <= scale * 1.01).all() and (moved[pad] == 0).all() and (moved[~pad] > scale[~pad] / 2).all()
    from engines.train.packed_objectives import packed_causal_lm_objective

    width = 2 * batch["input_ids"].shape[1]
    for objective in (causal_lm_objective, functools.partial(packed_causal_lm_objective, max_tokens=width)):
        torch.manual_seed(3)  # the objective draws from torch's global generator, which the trainer seeds
        first, _ = objective(policy, batch, neftune_alpha=alpha)
        torch.manual_seed(3)
        again, _ = objective(policy, batch, neftune_alpha=alpha)
        plain, _ = objective(policy, batch)
        assert first.item() == again.item() != plain.item()


def test_the_judge_trains_packed_where_its_config_says(policy, tokenizer):
    """judge.packing takes the packed next-token loss (tasks/stages/train.py causal_lm_objective, which the judge stage
    and SFT share); the judge used to train unpacked whatever it said."""
    from alignflow.config import JudgeConfig
    from engines.train.packed_objectives import packed_causal_lm_objective
    from tasks.stages.train import causal_lm_objective

    batch = _batch(tokenizer)
    width = batch["input_ids"].shape[1]
    packed = causal_lm_objective(JudgeConfig(packing=True, packing_max_tokens=3 * width))
    assert packed.func is packed_causal_lm_objective and packed.keywords == {"max_tokens": 3 * width}
    with torch.no_grad():
        (loss, _), (plain, _) = packed(policy, batch), causal_lm_objective(JudgeConfig())(policy, batch)
    assert abs(loss.item() - plain.item()) < 1e-5


def test_packed_token_and_sequence_logps_equal_unpacked(policy, tokenizer):
    from engines.train.logits import masked_next_token_logprobs, scatter
    from engines.train.packed_objectives import packed_sequence_logps, packed_token_logprobs

    batch = _batch(tokenizer, n=8, seed=2)
    width = batch["input_ids"].shape[1]
    with torch.no_grad():
        per_token = masked_next_token_logprobs(policy, batch, batch["loss_mask"])
        expected = (per_token.double() * batch["loss_mask"][:, 1:]).sum(1)
        logprobs, sample, position = packed_token_logprobs(policy, pack_batch(batch, 2 * width)[0])
        got = packed_sequence_logps(policy, batch, max_tokens=2 * width)
    # token by token, placed back in the unpacked (B, L - 1) layout
    assert logprobs.numel() == int(batch["loss_mask"][:, 1:].sum())
    unpacked = scatter(logprobs, sample, position - 1, tuple(per_token.shape))
    assert (unpacked - per_token).abs().max().item() < 1e-5
    # sums of ~35 float32 terms of ~-5: one float32 ulp at |200| is 1.5e-5, so relative
    assert got.shape == (8,)
    assert ((got.double() - expected).abs() / expected.abs()).max().item() < 1e-6
    assert expected.std() > 1.0  # the samples differ: a permuted result would not pass


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_packing_keeps_a_sliding_window_models_window(family, attn, tokenizer):
    """transformers takes a 4-D mask as given, in sliding-window layers too: a packed forward of a model whose
    every layer slides (Mistral) or some do (Gemma 2) gets the window in its mask, so each sample longer than
    the window is computed as unpacked (a window of 4 here, samples of 6..40 tokens)."""
    import transformers

    from engines.train.logits import masked_next_token_logprobs, scatter
    from engines.train.packed_objectives import packed_token_logprobs

    common = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, sliding_window=4,
                  attn_implementation=attn)
    config, cls = {"mistral": (transformers.MistralConfig(**common), transformers.MistralForCausalLM),
                   "gemma2": (transformers.Gemma2Config(head_dim=16, **common), transformers.Gemma2ForCausalLM)}[family]
    torch.manual_seed(0)
    model = cls(config).eval()
    batch = _batch(tokenizer, n=8, seed=2)
    with torch.no_grad():
        per_token = masked_next_token_logprobs(model, batch, batch["loss_mask"])
        logprobs, sample, position = packed_token_logprobs(model, pack_batch(batch, 2 * batch["input_ids"].shape[1])[0])
        full = model_inputs(model, pack_batch(batch, 2 * batch["input_ids"].shape[1])[0])
    unpacked = scatter(logprobs, sample, position - 1, tuple(per_token.shape))
    assert (unpacked - per_token).abs().max().item() < 1e-5
    assert isinstance(full["attention_mask"], dict) == (family == "gemma2")  # a mask by layer kind where mixed


def test_packed_reward_scores_equal_unpacked(reward_model, tokenizer):
    from engines.train.objectives import pairwise_objective, scalar_scores
    from engines.train.packed_objectives import packed_pairwise_objective, packed_scalar_scores

    batch = _batch(tokenizer, n=8, seed=3)
    batch.pop("loss_mask")  # as pair_tensors makes them
    with torch.no_grad():
        expected = scalar_scores(reward_model, batch)
        got = packed_scalar_scores(reward_model, batch, max_tokens=2 * batch["input_ids"].shape[1])
        loss, metrics = pairwise_objective(reward_model, batch, margin=0.5)
        packed_loss, packed_metrics = packed_pairwise_objective(reward_model, batch, 0.5)
    assert (got - expected).abs().max().item() < 1e-5
    assert expected.std() > 0.1
    assert abs(loss.item() - packed_loss.item()) < 1e-5
    assert packed_metrics["accuracy"] == metrics["accuracy"]


def test_a_response_is_scored_at_its_eos_where_the_pad_token_is_eos(reward_model, tokenizer):
    # Llama's and Qwen2.5 base's tokenizers have no pad token: load_tokenizer pads with EOS. transformers'
    # pooling (the last token that is not the pad id) then scored the token before a response's EOS.
    from engines.train.objectives import scalar_scores
    from engines.train.packed_objectives import packed_scalar_scores

    eos, pad = tokenizer.eos_token_id, reward_model.config.pad_token_id
    gen = torch.Generator().manual_seed(5)
    first, vocab = len(tokenizer.all_special_ids) + 8, len(tokenizer)
    rows = [torch.randint(first, vocab, (n,), generator=gen).tolist() + [eos] for n in (5, 9, 14)]
    batch = _rows(rows, [2, 2, 2], pad_id=eos)
    batch.pop("loss_mask")
    assert (batch["input_ids"][:, -1] == eos).all() and (batch["attention_mask"][:, -1] == 0).any()
    try:
        reward_model.config.pad_token_id = eos
        with torch.no_grad():
            got = scalar_scores(reward_model, batch)
            packed = packed_scalar_scores(reward_model, batch, max_tokens=2 * batch["input_ids"].shape[1])
            alone, cut = [], []
            for row in rows:  # each row by itself, no padding: the head at its last token, and at the one before
                hidden = reward_model(input_ids=torch.tensor([row]), output_hidden_states=True).hidden_states[-1][0]
                alone.append(reward_model.score(hidden[-1]).item())
                cut.append(reward_model.score(hidden[-2]).item())
    finally:
        reward_model.config.pad_token_id = pad
    assert got.tolist() == pytest.approx(alone, abs=1e-5)
    assert packed.tolist() == pytest.approx(alone, abs=1e-5)
    assert min(abs(a - c) for a, c in zip(alone, cut)) > 1e-3  # the EOS is what is scored


def test_the_mask_blocks_attention_across_samples(policy, tokenizer):
    from engines.train.packed_objectives import packed_hidden

    batch = _batch(tokenizer, n=6, seed=4)
    packed, _ = pack_batch(batch, 2 * batch["input_ids"].shape[1])
    rows = packed["sample_index"].tolist()
    row = next(r for r, samples in enumerate(rows) if len(set(samples) - {-1}) > 1)  # a row of several samples
    sample = packed["sample_index"][row]
    a = sample[0].item()
    others = (sample != a) & (sample >= 0)
    changed = {k: v.clone() for k, v in packed.items()}
    changed["input_ids"][row, sample == a] = torch.flip(packed["input_ids"][row, sample == a], [0])
    with torch.no_grad():
        before, after = packed_hidden(policy, packed)[row], packed_hidden(policy, changed)[row]
        # control: the same rows under a plain causal mask do mix the samples
        plain = {k: v for k, v in model_inputs(policy, packed).items() if k != "attention_mask"}
        mixed = [policy(**{**plain, "input_ids": p["input_ids"]}, attention_mask=torch.ones_like(p["input_ids"]),
                        output_hidden_states=True).hidden_states[-1][row] for p in (packed, changed)]
    assert (after[sample == a] - before[sample == a]).abs().max() > 1e-3
    assert (after[others] - before[others]).abs().max() < 1e-6
    assert (mixed[1][others] - mixed[0][others]).abs().max() > 1e-3


def test_rows_longer_than_the_packing_width_are_refused_before_training():
    """A row over packing_max_tokens fails the stage before the trainer group starts (during training, the
    rank that held it would fail alone while its peers wait), naming the field, the rows and the longest."""
    from engines.train.packing import check_fits

    mask = lambda lengths: torch.tensor([[1] * n + [0] * (9 - n) for n in lengths])  # noqa: E731
    tensors = {"attention_mask": mask([3, 5, 9]), "kl_attention_mask": mask([4, 9, 2])}
    check_fits(tensors, 9, "preference.packing_max_tokens")
    with pytest.raises(DataError, match=r"preference.packing_max_tokens=8: 1 training rows are longer \(row 2: 9"):
        check_fits(tensors, 8, "preference.packing_max_tokens")
    with pytest.raises(DataError, match=r"=8: 1 KTO mismatched \(kl_\) rows are longer \(row 1: 9 tokens\)"):
        check_fits({**tensors, "attention_mask": mask([3, 5, 8])}, 8, "preference.packing_max_tokens")


def test_sft_hands_its_objective_and_noise_to_the_loss_and_keeps_its_key_at_the_defaults():
    from alignflow.config import ConfigError, SFTConfig, cache_relevant, load_config
    from engines.train.objectives import causal_lm_objective as plain
    from tasks.stages.train import causal_lm_objective

    sft = SFTConfig(objective="dft", neftune_alpha=5.0, packing=True)
    built = causal_lm_objective(sft, loss=sft.objective, neftune_alpha=sft.neftune_alpha)
    assert built.keywords == {"max_tokens": None, "loss": "dft", "neftune_alpha": 5.0}
    assert causal_lm_objective(SFTConfig()).func is plain and causal_lm_objective(SFTConfig()).keywords == {}
    assert not {"objective", "neftune_alpha"} & set(cache_relevant(SFTConfig()))  # published keys stay
    assert {k: cache_relevant(sft)[k] for k in ("objective", "neftune_alpha")} == {"objective": "dft",
                                                                                   "neftune_alpha": 5.0}
    with pytest.raises(ConfigError, match=r"sft\.neftune_alpha"):
        load_config(None, ["sft.neftune_alpha=0"])
    with pytest.raises(ConfigError, match=r"sft\.objective"):
        load_config(None, ["sft.objective=kl"])
