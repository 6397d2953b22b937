"""A response's text decoded once at the end (engines/rollout/texts.py) against incremental decoding.

The reference is `tokenizers.decoders.DecodeStream` primed with the prompt and fed the response
one token at a time: the decoder vLLM runs when it detokenizes (its FastIncrementalDetokenizer).
"""

from __future__ import annotations

import random

import pytest


def _streamed(tokenizer, prompt: list[int], response: list[int]) -> str:
    from tokenizers.decoders import DecodeStream

    stream = DecodeStream(ids=prompt, skip_special_tokens=True)
    return "".join(stream.step(tokenizer._tokenizer, t) or "" for t in response)


def _metaspace_tokenizer():
    """A SentencePiece-style BPE (▁ for spaces, the first one stripped when decoding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    corpus = ["the answer is forty two", "hello there general kenobi", "which number is largest"] * 20
    tok.train_from_iterator(corpus, trainer=trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


def test_byte_level_random_tokens_match_the_incremental_decoder(tokenizer):
    from engines.rollout.texts import REPLACEMENT, response_texts

    rng = random.Random(0)
    vocab = len(tokenizer)
    words = ["Which", " digit", " is", " largest", "?", " 7", " héllo", " 日本", "\n"]
    prompts = [tokenizer.encode("".join(rng.choices(words, k=rng.randrange(1, 8)))) for _ in range(200)]
    responses = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 12))] for _ in range(200)]
    texts = response_texts(tokenizer, prompts, responses)
    assert texts == [_streamed(tokenizer, p, r) for p, r in zip(prompts, responses)]
    # The cases that make the two ways of decoding differ occur in this sample.
    whole = tokenizer.batch_decode([p + r for p, r in zip(prompts, responses)], skip_special_tokens=True)
    assert sum(w.endswith(REPLACEMENT) and not t.endswith(REPLACEMENT) for w, t in zip(whole, texts)) >= 5


def test_a_response_cut_inside_a_character_keeps_only_complete_characters(tokenizer):
    from engines.rollout.texts import REPLACEMENT, response_texts

    prompt = tokenizer.encode("Which digit is largest?")
    answer = tokenizer.encode(" héllo wörld 日本語 ✓", add_special_tokens=False)
    cuts = [answer[:k] for k in range(len(answer) + 1)]
    texts = response_texts(tokenizer, [prompt] * len(cuts), cuts)
    assert texts == [_streamed(tokenizer, prompt, c) for c in cuts]
    assert texts[-1] == " héllo wörld 日本語 ✓"
    assert not any(t.endswith(REPLACEMENT) for t in texts)
    # Somewhere a token ends inside a character, so a cut there holds bytes back.
    assert any(tokenizer.decode(c).endswith(REPLACEMENT) for c in cuts)


def test_a_character_the_prompt_leaves_open_belongs_to_the_response(tokenizer):
    from engines.rollout.texts import response_texts

    ids = tokenizer.encode("日本", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    complete = tokenizer.decode(ids[:cut]).rstrip("\ufffd")  # what the prompt holds of "日本"
    prompt = tokenizer.encode("hello") + ids[:cut]
    assert response_texts(tokenizer, [prompt], [ids[cut:]]) == ["日本"[len(complete):]]


def test_special_tokens_are_skipped(tokenizer):
    from engines.rollout.texts import response_texts

    prompt = tokenizer.encode("hello")
    body = tokenizer.encode(" 42", add_special_tokens=False)
    assert response_texts(tokenizer, [prompt], [body + [tokenizer.eos_token_id]]) == [" 42"]


def test_sentencepiece_style_response_keeps_its_leading_space():
    from engines.rollout.texts import CONTEXT_TOKENS, response_texts

    tok = _metaspace_tokenizer()
    short, long = tok.encode("hello there"), tok.encode("which number is largest the answer is hello there")
    assert len(long) > CONTEXT_TOKENS
    response = tok.encode("general kenobi")  # "▁general ...": a word after the prompt's last
    assert tok.decode(response).startswith("general")  # decoded alone, the space goes
    texts = response_texts(tok, [short, long], [response, response])
    assert texts == [_streamed(tok, short, response), _streamed(tok, long, response)]
    assert texts == [" general kenobi"] * 2


def test_prompts_and_responses_must_pair_up(tokenizer):
    from engines.rollout.texts import response_texts

    with pytest.raises(ValueError, match="2 prompts for 1 responses"):
        response_texts(tokenizer, [[1], [2]], [[3]])
    assert response_texts(tokenizer, [], []) == []


class _SumTokenizer:
    """A decoder whose text for more tokens does not extend its text for fewer: the sum of the ids."""

    def decode(self, ids, **_):
        return str(sum(ids))

    def batch_decode(self, seqs, **_):
        return [self.decode(s) for s in seqs]


def test_a_decode_that_does_not_extend_the_prompts_is_an_error_naming_the_response():
    from engines.rollout.texts import response_texts

    with pytest.raises(ValueError, match=r"response 1: .*does not begin with the prompt's decode \('3'\)"):
        response_texts(_SumTokenizer(), [[1, 1], [1, 2]], [[0], [7]])
