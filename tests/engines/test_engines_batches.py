"""Canonical records -> token tensors: loss masks, pair layout, prompt-length accounting, sharding."""

from __future__ import annotations

import logging

import pytest
import torch

from engines.batches import (
    LengthReport,
    PromptTooLongError,
    encode_response,
    minibatches,
    pair_tensors,
    rows_per_pass,
    shard,
    sft_tensors,
    split_pairs,
)
from engines.micro_batching import micro_batches


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _prompt_ids(tok, prompt) -> list[int]:
    """Prompt tokens computed independently: render to text, then tokenize the text."""
    if isinstance(prompt, list):
        text = "".join(f"<|{m['role']}|>{m['content']}" for m in prompt) + "<|assistant|>"
    else:
        text = prompt
    return tok(text, add_special_tokens=False)["input_ids"]


def _response_ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


RECORDS = [
    {"prompt": _chat("Which digit is largest? 3 1 4 1 5"), "response": "5"},
    {"prompt": "Plain text prompt, used verbatim", "response": "a longer answer here"},
    {"prompt": _chat("Hi"), "response": "7"},
]


def test_sft_tensors_layout_and_loss_mask(tokenizer):
    batch, report = sft_tensors(tokenizer, RECORDS, max_prompt_tokens=64, max_response_tokens=64)
    assert report == LengthReport(total=3, overlong=0, max_prompt_tokens=64)
    n = len(RECORDS)
    expected = [(_prompt_ids(tokenizer, r["prompt"]), _response_ids(tokenizer, r["response"])) for r in RECORDS]
    width = max(len(p) + len(r) for p, r in expected)
    assert batch["input_ids"].shape == batch["attention_mask"].shape == batch["loss_mask"].shape == (n, width)
    assert batch["input_ids"].dtype == torch.long
    for row, (p, r) in enumerate(expected):
        length = len(p) + len(r)
        ids = batch["input_ids"][row].tolist()
        assert ids[:length] == p + r
        assert ids[length:] == [tokenizer.pad_token_id] * (width - length)
        assert batch["attention_mask"][row].tolist() == [1] * length + [0] * (width - length)
        # 1 exactly on the response tokens and the EOS that ends them.
        assert batch["loss_mask"][row].tolist() == [0] * len(p) + [1] * len(r) + [0] * (width - length)
        assert ids[length - 1] == tokenizer.eos_token_id


def test_chat_prompts_end_with_the_assistant_marker(tokenizer):
    batch, _ = sft_tensors(tokenizer, RECORDS[:1], max_prompt_tokens=64, max_response_tokens=16)
    mask = batch["loss_mask"][0]
    first_response = int(mask.nonzero()[0])
    assistant = tokenizer.convert_tokens_to_ids("<|assistant|>")
    assert batch["input_ids"][0, first_response - 1] == assistant
    assert batch["input_ids"][0, 0] == tokenizer.convert_tokens_to_ids("<|user|>")


def test_response_truncation(tokenizer):
    long = "a b c d e f g h i j"
    full = _response_ids(tokenizer, long)
    assert len(full) > 4
    assert encode_response(tokenizer, long, 4) == full[:4]  # EOS does not fit
    assert encode_response(tokenizer, "7", 4) == _response_ids(tokenizer, "7")
    batch, _ = sft_tensors(tokenizer, [{"prompt": "p", "response": long}], max_prompt_tokens=64, max_response_tokens=4)
    assert int(batch["loss_mask"].sum()) == 4
    assert tokenizer.eos_token_id not in batch["input_ids"][0].tolist()


def test_overlong_prompts_are_counted_and_left_out(tokenizer, caplog):
    lengths = [len(_prompt_ids(tokenizer, r["prompt"])) for r in RECORDS]
    limit = sorted(lengths)[1]  # the longest prompt does not fit; one exactly at the limit does
    long_rows = [i for i, n in enumerate(lengths) if n > limit]
    assert len(long_rows) == 1
    with caplog.at_level(logging.WARNING, logger="engines.batches"):
        batch, report = sft_tensors(tokenizer, RECORDS, max_prompt_tokens=limit, max_response_tokens=16)
    assert report == LengthReport(total=3, overlong=1, max_prompt_tokens=limit)
    assert report.as_metrics("sft") == {"data/sft_rows": 3, "data/sft_overlong_prompts": 1}
    kept = [r for i, r in enumerate(RECORDS) if i not in long_rows]
    assert batch["input_ids"].shape[0] == 2
    for row, r in enumerate(kept):
        p = _prompt_ids(tokenizer, r["prompt"])
        assert batch["input_ids"][row, : len(p)].tolist() == p  # kept rows in order, never cut
    assert "1 of 3 prompts exceed max_prompt_tokens" in caplog.text


def test_all_overlong_raises(tokenizer):
    with pytest.raises(PromptTooLongError) as err:
        sft_tensors(tokenizer, RECORDS, max_prompt_tokens=2, max_response_tokens=16)
    assert "sft" in str(err.value)
    assert "data.max_prompt_tokens=2" in str(err.value)
    assert "all 3 prompts" in str(err.value)
    pairs = [{"prompt": "a long enough prompt", "chosen": "1", "rejected": "2"}]
    with pytest.raises(PromptTooLongError, match=r"^preference: .*data\.max_prompt_tokens=1"):
        pair_tensors(tokenizer, pairs, max_prompt_tokens=1, max_response_tokens=16)


PAIRS = [
    {"prompt": _chat("Which digit is largest? 3 1 4"), "chosen": "4", "rejected": "3"},
    {"prompt": _chat("Which digit is largest? 9 8"), "chosen": "9", "rejected": "a much longer rejected answer"},
    {"prompt": "x " * 60, "chosen": "1", "rejected": "2"},  # overlong
    {"prompt": "short", "chosen": "good and long", "rejected": "bad"},
]


def test_pair_tensors_layout(tokenizer):
    batch, report = pair_tensors(tokenizer, PAIRS, max_prompt_tokens=32, max_response_tokens=64)
    assert report == LengthReport(total=4, overlong=1, max_prompt_tokens=32)
    kept = [PAIRS[0], PAIRS[1], PAIRS[3]]
    n = len(kept)
    assert set(batch) == {"input_ids", "attention_mask"}
    assert batch["input_ids"].shape[0] == 2 * n
    for i, r in enumerate(kept):
        p = _prompt_ids(tokenizer, r["prompt"])
        for row, key in ((i, "chosen"), (n + i, "rejected")):
            seq = p + _response_ids(tokenizer, r[key])
            assert batch["input_ids"][row, : len(seq)].tolist() == seq
            assert int(batch["attention_mask"][row].sum()) == len(seq)
            assert batch["input_ids"][row, len(seq):].eq(tokenizer.pad_token_id).all()


def _numbered(n_rows: int, width: int = 3) -> dict[str, torch.Tensor]:
    ids = torch.arange(n_rows * width).reshape(n_rows, width)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": ids % 2}


def test_shard_rows():
    batch = _numbered(6)
    shards = shard(batch, 3)
    assert len(shards) == 3
    for r, s in enumerate(shards):
        for k in batch:
            assert torch.equal(s[k], batch[k][2 * r : 2 * r + 2])


def test_shard_keeps_pairs_together():
    # 4 pairs: rows 0-3 chosen, rows 4-7 rejected (pair i = rows i and 4+i).
    batch = _numbered(8)
    shards = shard(batch, 2, paired=True)
    assert [s["input_ids"].shape[0] for s in shards] == [4, 4]
    for r, s in enumerate(shards):
        pairs = [2 * r, 2 * r + 1]
        expected_rows = pairs + [p + 4 for p in pairs]  # chosen half first, then the same pairs' rejected
        assert torch.equal(s["input_ids"], batch["input_ids"][expected_rows])
        assert torch.equal(s["loss_mask"], batch["loss_mask"][expected_rows])


def test_shard_must_divide():
    with pytest.raises(ValueError, match="does not split across 4 workers"):
        shard(_numbered(6), 4)
    with pytest.raises(ValueError, match="batch of 3 does not split across 2 workers"):
        shard(_numbered(6), 2, paired=True)  # 3 pairs


def test_shard_single_worker_is_the_batch():
    batch = _numbered(4)
    (only,) = shard(batch, 1, paired=True)
    assert torch.equal(only["input_ids"], batch["input_ids"])


def test_split_pairs():
    batch = _numbered(10)  # 5 pairs
    out = split_pairs(batch, torch.tensor([3, 0]), 5)
    assert out["input_ids"][:, 0].tolist() == [9, 0, 24, 15]  # rows 3, 0, 8, 5


def test_minibatches_draw_rows_at_random_and_keep_each_chunk_in_batch_order():
    gen = torch.Generator().manual_seed(0)
    chunks = list(minibatches(64, 16, epochs=2, generator=gen))
    assert [len(c) for c in chunks] == [16] * 8
    for epoch in (chunks[:4], chunks[4:]):  # each pass covers every row once
        assert sorted(torch.cat(epoch).tolist()) == list(range(64))
    assert all(c.tolist() == sorted(c.tolist()) for c in chunks)
    # Random membership: not the batch cut into consecutive runs, and the two passes differ.
    assert any(c.tolist() != list(range(int(c[0]), int(c[0]) + 16)) for c in chunks)
    assert [c.tolist() for c in chunks[:4]] != [c.tolist() for c in chunks[4:]]


def test_minibatches_drop_the_remainder_and_cut_to_a_multiple_of_the_ranks():
    gen = torch.Generator().manual_seed(1)
    assert [len(c) for c in minibatches(70, 32, epochs=1, generator=gen)] == [32, 32]  # 6 rows dropped
    assert [len(c) for c in minibatches(10, 32, epochs=1, generator=gen, multiple_of=4)] == [8]
    assert list(minibatches(3, 32, epochs=1, generator=gen, multiple_of=4)) == []


@pytest.mark.parametrize("n, size, ranks", [(70, 32, 1), (100, 64, 1), (50, 64, 4), (10, 32, 4), (3, 32, 4),
                                           (96, 30, 4), (64, 16, 2)])
def test_rows_per_pass_is_what_one_pass_of_minibatches_trains_on(n, size, ranks):
    chunks = list(minibatches(n, size, epochs=1, generator=torch.Generator().manual_seed(2), multiple_of=ranks))
    assert rows_per_pass(n, size, ranks) == sum(len(c) for c in chunks)


def test_a_prompts_samples_stay_together_in_the_micro_batches_of_a_minibatch():
    # 16 prompts x 8 samples, listed prompt by prompt as a round's batch is; a minibatch of half the
    # rows in micro-batches of 16: each micro-batch holds the few prompts its rows came from.
    n, samples = 16, 8
    batch = {"input_ids": torch.zeros(n * samples, 4, dtype=torch.long),
             "prompt_index": torch.arange(n).repeat_interleave(samples)}
    gen = torch.Generator().manual_seed(2)
    (rows, _) = minibatches(n * samples, n * samples // 2, epochs=1, generator=gen)
    part = {k: v[rows] for k, v in batch.items()}
    micros = micro_batches(part, 16)
    for micro in micros:
        prompts = micro["prompt_index"].tolist()
        assert prompts == sorted(prompts)  # each prompt's samples side by side
    # The shared-prefix forward runs a prompt once per micro-batch it is in: each prompt of the
    # minibatch once, plus at most one prompt split across each boundary between micro-batches.
    forwards = sum(len(set(m["prompt_index"].tolist())) for m in micros)
    assert forwards <= len(set(part["prompt_index"].tolist())) + len(micros) - 1


@pytest.mark.parametrize("n, ranks, expected", [(5, 2, [[0, 1, 2], [3, 4, 4]]), (4, 2, [[0, 1], [2, 3]]),
                                                (1, 2, [[0], [0]]), (7, 3, [[0, 1, 2], [3, 4, 5], [6, 6, 6]])])
def test_padded_shards_are_consecutive_and_of_one_size(n, ranks, expected):
    from engines.batches import padded_shards

    batch = {"input_ids": torch.arange(n).unsqueeze(1) * 10, "row": torch.arange(n)}
    shards = padded_shards(batch, ranks)
    assert [s["row"].tolist() for s in shards] == expected
    assert all(torch.equal(s["input_ids"][:, 0], s["row"] * 10) for s in shards)


def test_a_text_prompt_starts_with_bos_where_the_tokenizer_starts_texts_with_one(tiny_model, tokenizer):
    """Llama, Gemma and Mistral base tokenizers start a text with BOS (Qwen's and the tiny one do not): a plain
    text prompt gets it once, as the model was trained; a chat prompt's template writes its own."""
    from tokenizers.processors import TemplateProcessing

    from engines.batches import render_prompt
    from engines.models import load_tokenizer

    llama_like = load_tokenizer(tiny_model)
    bos = llama_like.bos_token_id
    llama_like.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{llama_like.bos_token} $A", special_tokens=[(llama_like.bos_token, bos)])
    assert llama_like("a")["input_ids"][0] == bos  # as Llama's tokenizer adds it
    text = "Plain text prompt, used verbatim"
    plain = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert render_prompt(tokenizer, text) == plain  # no BOS where the tokenizer adds none
    assert render_prompt(llama_like, text) == [bos, *plain]
    assert render_prompt(llama_like, llama_like.bos_token + text) == [bos, *plain]  # written in the text: once
    assert render_prompt(llama_like, _chat("Hi")) == render_prompt(tokenizer, _chat("Hi"))  # the template's own
    batch, _ = sft_tensors(llama_like, RECORDS[1:2], max_prompt_tokens=64, max_response_tokens=64)
    assert batch["input_ids"][0, :len(plain) + 1].tolist() == [bos, *plain]


def test_whether_a_tokenizer_starts_texts_with_bos_is_asked_once_per_tokenizer(tokenizer):
    """render_prompt runs for every prompt of a split and of every round: the tokenizer is asked once."""
    from engines.batches import render_prompt

    class Counting:
        def __init__(self, bos):
            self.bos_token_id, self.asked = bos, 0

        def __call__(self, text, add_special_tokens=True):
            self.asked += text == "a"
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            return {"input_ids": [self.bos_token_id, *ids] if add_special_tokens else ids}

    first, second = Counting(7), Counting(7)
    for text in ("one", "two", "three"):
        assert render_prompt(first, text)[0] == 7
    assert render_prompt(second, "one")[0] == 7 and (first.asked, second.asked) == (1, 1)
    first.bos_token_id = 9  # a BOS set after: asked again
    assert render_prompt(first, "one")[0] == 9 and first.asked == 2


def test_a_training_micro_batch_is_cut_to_its_longest_row(tiny_model, tokenizer):
    """Supervised data is padded to the longest row of its split: a training micro-batch drops the padding
    columns all its rows share (one long row no longer sets every forward's width), with its loss unchanged.
    Pairs stay pairs; a batch with other sequence-shaped tensors it cannot read is left whole."""
    from engines.micro_batching import micro_batches, trimmed
    from engines.models import load_policy
    from engines.train.objectives import causal_lm_objective

    records = [{"prompt": "Which digit is largest? " + "7 " * n, "response": "7"} for n in (30, 2, 3, 1)]
    batch, _ = sft_tensors(tokenizer, records, max_prompt_tokens=128, max_response_tokens=8)
    full = batch["input_ids"].shape[1]
    parts = micro_batches(batch, 2, trim=True)
    lengths = batch["attention_mask"].sum(1).tolist()
    assert [p["input_ids"].shape[1] for p in parts] == [full, max(lengths[2:])] and max(lengths[2:]) < full
    for p, rows in zip(parts, ([0, 1], [2, 3])):
        width = p["input_ids"].shape[1]
        assert p["attention_mask"].shape == p["loss_mask"].shape == (2, width)
        assert torch.equal(p["input_ids"], batch["input_ids"][rows, :width])
        assert p["attention_mask"][:, width:].numel() == 0 and batch["attention_mask"][rows, width:].sum() == 0
    model = load_policy(tiny_model).eval()
    with torch.no_grad():
        untrimmed = micro_batches(batch, 2)[1]
        assert torch.allclose(causal_lm_objective(model, parts[1])[0], causal_lm_objective(model, untrimmed)[0],
                              atol=1e-6)
    other = {**untrimmed, "response_index": torch.zeros(2, 3, dtype=torch.long)}  # no action_mask to read it by
    assert trimmed(other) is other


def test_an_rl_micro_batch_is_cut_to_its_longest_sequence_and_response_with_its_loss_unchanged(tiny_model):
    """An RL step's tensors are padded to its longest sequence (input_ids, attention_mask) and response (the
    per-token tensors: action_mask's T). Each training micro-batch now drops what its own rows leave unused
    of both; the PPO loss, its entropy and KL terms on it are what they were on the untrimmed one."""
    import functools

    from engines.micro_batching import micro_batches, step_micro_batches, trimmed
    from engines.models import load_policy
    from engines.rl.experience import from_rollouts
    from engines.rollout.base import Rollout
    from engines.train.objectives import policy_objective

    gen = torch.Generator().manual_seed(0)
    shapes = [(30, 12), (4, 2), (5, 3), (3, 1)]  # (prompt, response) tokens: one long row, then short ones
    rollouts = [Rollout(i, torch.randint(5, 100, (p,), generator=gen).tolist(),
                        torch.randint(5, 100, (n,), generator=gen).tolist(), "", [-1.0] * n, True)
                for i, (p, n) in enumerate(shapes)]
    batch = {k: v for k, v in from_rollouts(rollouts, 0).tensors().items() if isinstance(v, torch.Tensor)}
    B, T = batch["action_mask"].shape
    batch |= {"advantages": torch.randn(B, T, generator=gen) * batch["action_mask"],
              "old_logprobs": -torch.rand(B, T, generator=gen), "ref_logprobs": -torch.rand(B, T, generator=gen)}
    parts = micro_batches(batch, 2, trim=True)
    short = parts[1]
    assert short["input_ids"].shape == (2, 5 + 3) and short["action_mask"].shape == (2, 3)  # rows 2, 3
    assert all(short[k].shape == (2, 3) for k in ("advantages", "old_logprobs", "ref_logprobs", "response_index"))
    assert parts[0]["input_ids"].shape == (2, 42) and parts[0]["action_mask"].shape == (2, 12)  # the long row's
    objective = functools.partial(policy_objective, clip_low=0.2, clip_high=0.2, dual_clip=None, agg="token_mean",
                                  entropy_coef=0.01, kl_loss_coef=0.1, kl_estimator="k3", kl_clamp=None,
                                  tis_cap=None, loss_scale_constant=12.0)
    model = load_policy(tiny_model).eval()
    with torch.no_grad():
        whole = micro_batches(batch, 2)[1]
        (cut, cut_metrics), (full, full_metrics) = objective(model, short), objective(model, whole)
    torch.testing.assert_close(cut, full, atol=1e-6, rtol=1e-5)
    assert cut_metrics.keys() == full_metrics.keys()
    # Every rank's shard cut alike first: as many micro-batches each; a tensor of another layout, none cut
    assert [len(p) for p in step_micro_batches([{k: v[:2] for k, v in batch.items()},
                                                {k: v[2:] for k, v in batch.items()}], 1)] == [2, 2]
    other = {**whole, "values": torch.zeros(2, T + 1)}
    assert trimmed(other) is other


def test_ktos_mismatched_rows_are_cut_to_their_own_width():
    """A KTO batch carries a second set of rows (kl_*: prompts with another row's reply), padded to their split's
    longest: it was left whole (every forward at the split's widths); each set is cut to what its rows use."""
    from engines.batches import pad_right, right_padded
    from engines.micro_batching import step_micro_batches, trimmed

    def rows(lengths: list[int], width: int) -> dict[str, torch.Tensor]:
        padded = right_padded([[7] * n for n in lengths] + [[7] * width], 0)  # a split's longest row, then dropped
        padded["loss_mask"] = pad_right([[0] + [1] * (n - 1) for n in lengths] + [[0] * width], 0)
        return {k: v[:-1] for k, v in padded.items()}

    main, kl = rows([4, 6, 3, 5], 40), rows([9, 2, 7, 3], 50)
    batch = {**main, **{f"kl_{k}": v for k, v in kl.items()}, "ref_kl_logps": torch.zeros(4),
             "desirable": torch.ones(4)}
    cut = trimmed(batch)
    assert cut["input_ids"].shape == cut["loss_mask"].shape == (4, 6)
    assert cut["kl_input_ids"].shape == cut["kl_attention_mask"].shape == cut["kl_loss_mask"].shape == (4, 9)
    assert torch.equal(cut["kl_loss_mask"], batch["kl_loss_mask"][:, :9])
    assert cut["ref_kl_logps"] is batch["ref_kl_logps"]
    halves = step_micro_batches([{k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()}], 1)
    assert [[p["kl_input_ids"].shape[1] for p in ps] for ps in halves] == [[9, 2], [7, 3]]  # each micro-batch its own


def test_a_micro_batch_without_an_attended_position_is_left_as_it_is():
    from engines.micro_batching import trimmed

    empty = {"input_ids": torch.zeros(0, 4, dtype=torch.long), "attention_mask": torch.zeros(0, 4, dtype=torch.long),
             "loss_mask": torch.zeros(0, 4), "teacher_ids": torch.zeros(0, 3, 2)}
    assert trimmed(empty) is empty


def test_a_steps_token_budget_counts_its_rows_not_the_splits_longest(tokenizer):
    """Supervised data is padded to its split's longest row. A step whose rows are all short fills its
    micro-batches by their own width; every rank's shard still gets as many micro-batches."""
    from engines.batches import shard
    from engines.micro_batching import micro_batches, step_micro_batches, trimmed

    records = [{"prompt": "Which digit is largest? " + "7 " * n, "response": "7"} for n in (60, 2, 3, 1, 4, 2, 1, 3, 2)]
    split, _ = sft_tensors(tokenizer, records, max_prompt_tokens=128, max_response_tokens=8)
    step = {k: v[1:] for k, v in split.items()}  # a step without the long row, at the split's width
    full, short = split["input_ids"].shape[1], int(step["attention_mask"].sum(1).max())
    assert short * 2 < full
    tokens = 2 * short  # two of the step's rows
    shards = shard(step, 2)
    parts = step_micro_batches(shards, None, tokens=tokens)
    assert [len(p) for p in parts] == [2, 2]  # 4 rows a rank, 2 a micro-batch
    assert all(p["input_ids"].shape[1] <= short and p["input_ids"].numel() <= tokens for ps in parts for p in ps)
    assert [len(micro_batches(s, None, tokens=tokens, trim=True)) for s in shards] == [4, 4]  # by the split's width
    rows = torch.cat([p["input_ids"][:, :1] for ps in parts for p in ps])
    assert torch.equal(rows, torch.cat([s["input_ids"][:, :1] for s in shards]))  # every row, in order
    lean = {**shards[1], "attention_mask": shards[1]["attention_mask"].clone()}
    lean["attention_mask"][:, short // 2:] = 0  # a rank whose rows are all shorter: alone, 4 rows a micro-batch
    assert len(micro_batches(trimmed(lean), None, tokens=tokens, trim=True)) == 1
    assert [len(p) for p in step_micro_batches([shards[0], lean], None, tokens=tokens)] == [2, 2]  # in step


CONVERSATION = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello there"}, {"role": "user", "content": "And now?"},
                {"role": "assistant", "content": "Sure thing"}, {"role": "user", "content": "Largest? 3 1 4"}]


def test_multi_turn_sft_trains_every_assistant_turn_when_asked(tokenizer, caplog):
    """sft.train_on: assistant_turns puts the loss on each earlier assistant message of a conversation (its
    text and the template's end of turn, <|end|> in the tiny template) besides the response; by default only
    the response. Expected tokens from the template's pieces, tokenized one by one."""
    pieces = [("<|system|>Be brief<|user|>Hi<|assistant|>", 0), ("Hello there<|end|>", 1),
              ("<|user|>And now?<|assistant|>", 0), ("Sure thing<|end|>", 1), ("<|user|>Largest? 3 1 4<|assistant|>", 0)]
    prompt, mask = [], []
    for text, trained in pieces:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        prompt, mask = prompt + ids, mask + [trained] * len(ids)
    records = [{"prompt": CONVERSATION, "response": "4"}, {"prompt": "Plain text", "response": "no turns"}]
    response = _response_ids(tokenizer, "4")
    batch, report = sft_tensors(tokenizer, records, 64, 8, assistant_turns=True)
    n = len(prompt) + len(response)
    assert batch["input_ids"][0, :n].tolist() == prompt + response
    assert batch["loss_mask"][0, :n].tolist() == mask + [1] * len(response)
    assert report.assistant_turns == 2 and report.as_metrics("sft")["data/sft_assistant_turns"] == 2
    plain, _ = sft_tensors(tokenizer, records, 64, 8)
    assert plain["loss_mask"][0, :n].tolist() == [0] * len(prompt) + [1] * len(response)
    assert torch.equal(plain["loss_mask"][1], batch["loss_mask"][1])  # a text prompt: its response only
    with caplog.at_level(logging.WARNING, logger="engines.batches"):
        assert sft_tensors(tokenizer, records[1:], 64, 8, assistant_turns=True)[1].assistant_turns == 0
    assert "no sft prompt holds an assistant turn" in caplog.text
    assert "data/sft_assistant_turns" not in LengthReport(1, 0, 64).as_metrics("sft")


def test_a_template_that_rewrites_earlier_turns_fails_naming_the_row(tokenizer):
    """As Qwen3's template drops earlier turns' reasoning: the turn's tokens in the conversation are not those
    it has as the last turn, so no mask can be placed; the error names the row and the way out."""
    import copy

    from alignflow.errors import DataError

    rewriting = copy.deepcopy(tokenizer)
    rewriting.chat_template = tokenizer.chat_template.replace(
        "{{ m['content'] }}", "{{ m['content'] if m['role'] != 'assistant' or loop.last else '' }}")
    records = [{"prompt": _chat("Hi"), "response": "7"}, {"prompt": CONVERSATION, "response": "4"}]
    sft_tensors(rewriting, records, 64, 8)  # the response alone needs no turn's tokens
    with pytest.raises(DataError, match=r"sft split, record 2: assistant turn 2 .*sft.train_on: response"):
        sft_tensors(rewriting, records, 64, 8, assistant_turns=True)


# ---- step-labelled solutions (a process reward model's rows: engines/steps.py) ----------------------------


def test_step_tensors_mark_each_steps_last_token_with_its_label_and_cut_steps_past_the_limit(tokenizer, caplog):
    from engines.micro_batching import step_micro_batches
    from engines.steps import stepwise_tensors

    records = [{"prompt": "3 7 2", "steps": ["3\n", "7\n", "7\n"], "labels": [True, True, False]},
               {"prompt": _chat("9 1"), "steps": ["9\n", "1\n"], "labels": [True, False]}]
    t, report = stepwise_tensors(tokenizer, records, 64, 64)
    assert report.steps_cut == 0 and report.as_metrics("process")["data/process_steps_cut"] == 0
    for i, r in enumerate(records):
        want = _prompt_ids(tokenizer, r["prompt"])
        ends, labels = [], []
        for step, label in zip(r["steps"], r["labels"]):
            want += tokenizer(step, add_special_tokens=False)["input_ids"]  # each step tokenized on its own
            ends.append(len(want) - 1)
            labels.append(float(label))
        n = int(t["attention_mask"][i].sum())
        assert t["input_ids"][i, :n].tolist() == want and n == len(want)  # no EOS: a step ends where it ends
        assert t["step_mask"][i].nonzero().flatten().tolist() == ends
        assert t["step_labels"][i, ends].tolist() == labels and float(t["step_labels"][i].sum()) == sum(labels)
    # Micro-batches cut the step marks and labels with the rows they belong to.
    [[micro]] = step_micro_batches([t], None)
    assert {k: v.shape[1] for k, v in micro.items()} == dict.fromkeys(t, t["input_ids"].shape[1])
    # A response limit of 3 tokens keeps the first row's first step ("3" and the newline: 2 tokens), no more.
    first = len(tokenizer("3\n", add_special_tokens=False)["input_ids"])
    assert first == 2
    with caplog.at_level("WARNING", logger="alignflow"):
        cut, report = stepwise_tensors(tokenizer, records, 64, 3)
    assert report.steps_cut == 3 and int(cut["step_mask"].sum()) == 2
    assert "process: 3 steps lie past data.max_response_tokens=3 and are left out" in caplog.text


def test_the_step_objective_is_binary_cross_entropy_at_the_step_ends_of_a_scalar_model(tiny_model, tokenizer):
    import math

    from engines import models
    from engines.steps import step_scores, stepwise_objective, stepwise_tensors

    model = models.load_scalar_model(tiny_model, "float32", tokenizer.pad_token_id)
    torch.nn.init.normal_(model.score.weight, std=0.5)  # a fresh head is zero: every score 0
    records = [{"prompt": "3 7 2", "steps": ["3\n", "7\n", "7\n"], "labels": [True, True, False]},
               {"prompt": "9 1", "steps": ["9\n", "1\n"], "labels": [True, False]}]
    t, _ = stepwise_tensors(tokenizer, records, 64, 64)
    loss, metrics = stepwise_objective(model, t)
    with torch.no_grad():  # each row alone, unpadded: the head's score at each step's last token
        want, right = [], 0
        for i in range(2):
            n = int(t["attention_mask"][i].sum())
            scores = step_scores(model, {k: v[i:i + 1, :n] for k, v in t.items()})[0]
            for pos in t["step_mask"][i].nonzero().flatten().tolist():
                s, y = float(scores[pos]), float(t["step_labels"][i, pos])
                want.append(-(y * math.log(1 / (1 + math.exp(-s))) + (1 - y) * math.log(1 - 1 / (1 + math.exp(-s)))))
                right += (s > 0) == (y > 0.5)
    assert float(loss.detach()) == pytest.approx(sum(want) / 5, rel=1e-4)
    assert [float(v) for v in metrics["step_accuracy"]] == pytest.approx([right, 5])  # (sum, count)
    assert [float(v) for v in metrics["positive_fraction"]] == pytest.approx([3, 5])
    loss.backward()
    assert model.score.weight.grad.abs().sum() > 0
    # Every step cut: a zero loss that still reaches the model, and the same metrics, counting nothing, so that
    # ranks and micro-batches with and without steps combine (a rank without one failed the step's metrics).
    from engines.accumulate import add_metrics, combine_ranks, host_metrics

    none, _ = stepwise_tensors(tokenizer, records, 64, 1)
    zero, m = stepwise_objective(model, none)
    assert float(zero.detach()) == 0.0 and zero.requires_grad and set(m) == set(metrics)
    ranks = []
    for got in (metrics, m):
        sums = {}
        add_metrics(sums, {k: (v[0].detach(), v[1]) if isinstance(v, tuple) else v.detach() for k, v in got.items()},
                    1.0)
        ranks.append(host_metrics(sums))
    assert combine_ranks(ranks)["step_accuracy"] == pytest.approx(right / 5)
