"""A response's text from its token ids, decoded once when the response is complete.

vLLM detokenizes incrementally by default: every sampled token of every
sequence goes through the tokenizer inside the engine loop, whether or not
anyone reads the text, and the loop waits for it (the engine runs
in-process, engines/rollout/actors.py). Rollouts here ask vLLM for token
ids only (`detokenize=False`) and decode each finished response here, in
one batch. On issue 14's bench work (256 responses of 32 tokens) that took
`generate` from 2.41 to 2.23 s on one CPU core, and from 1.61 to 1.51 s in
the bench on two; on GPUs, where the forward is fast and the engine loop is
bound by the host, the share is larger.

The text is the one vLLM's incremental detokenizer gives (a
`tokenizers.decoders.DecodeStream` primed with the prompt): what the
response adds to its prompt's text (decoded after the prompt's last few
tokens), special tokens skipped, so

  - a SentencePiece-style response keeps the space its first token opens
    with (decoded alone, the decoder would strip it as a sequence start);
  - a response cut inside a multi-byte character (byte-level vocabularies)
    does not end in U+FFFD: the stream holds such bytes back until the
    character is complete, so they never reach the text.

Both engines use it, so a reward function sees the same text from either.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"
# Prompt tokens decoded with each response: enough context for a decoder's start-of-text rules (the
# space SentencePiece strips) and a character the prompt leaves open; the rest of the prompt cannot
# change how the response's tokens decode, so a long prompt costs no more than a short one.
CONTEXT_TOKENS = 8


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _without_open_character(tokenizer, ids: list[int], text: str, keep: int) -> tuple[str, int]:
    """`text` = decode(ids); while it ends in U+FFFD, one token fewer (never fewer than `keep`)."""
    n = len(ids)
    while text.endswith(REPLACEMENT) and n > keep:
        n -= 1
        text = _decode(tokenizer, ids[:n])
    return text, n


def response_texts(tokenizer, prompts: list[list[int]], responses: list[list[int]]) -> list[str]:
    """The text of each response after its prompt: decode(c + response)[len(decode(c)):], c the prompt's
    last `CONTEXT_TOKENS` tokens, where each decode first drops trailing tokens that leave it ending
    in U+FFFD (an open multi-byte character), as an incremental decoder withholds them; a character
    the prompt leaves open and the response completes is the response's. prompts[i] goes with
    responses[i].

    Raises ValueError where a tokenizer's decode of c + response does not begin with the decode of c
    (the response's text cannot be told apart), naming the response."""
    if len(prompts) != len(responses):
        raise ValueError(f"response_texts: {len(prompts)} prompts for {len(responses)} responses")
    if not responses:
        return []
    prompts = [list(p[-CONTEXT_TOKENS:]) for p in prompts]
    heads: dict[tuple[int, ...], str] = {}  # each context's complete characters, decoded once
    for p in map(tuple, prompts):
        if p not in heads:
            heads[p] = _without_open_character(tokenizer, list(p), _decode(tokenizer, list(p)), 0)[0]
    fulls = tokenizer.batch_decode([p + r for p, r in zip(prompts, responses)], skip_special_tokens=True,
                                   clean_up_tokenization_spaces=False)
    texts = []
    for i, (p, r, full) in enumerate(zip(prompts, responses, fulls)):
        head = heads[tuple(p)]
        full, n = _without_open_character(tokenizer, p + r, full, len(p))
        if n == len(p):  # nothing of the response is a complete character yet
            texts.append("")
            continue
        if not full.startswith(head):
            raise ValueError(f"response {i}: the tokenizer's decode of prompt + response ({full[:60]!r}...) "
                             f"does not begin with the prompt's decode ({head[-60:]!r}), so the response's "
                             f"text cannot be cut from it")
        texts.append(full[len(head):])
    return texts
