"""Partial rollouts in pieces (engines/rollout/pieces.py) against an engine written here: its tokens say
which weights' version wrote them, so what each piece sampled with is read off the tokens."""

from __future__ import annotations

import pytest

from engines.rollout.base import Rollout, Sampling
from engines.rollout.pieces import generate_in_pieces

EOS = 99


PROMPT_LEN = 3


class Engine:
    """Prompts of PROMPT_LEN tokens. Writes token 10 * version + position in the response; a prompt whose
    last token is 7 ends its response with EOS as its 5th token. Each token's log-prob is -version - 0.5."""

    def __init__(self):
        self.version, self.published, self.calls = 0, 0, []

    def generate(self, prompt_ids, sampling):
        self.calls.append(([list(p) for p in prompt_ids], sampling))
        out = []
        for i, p in enumerate(prompt_ids):
            for _ in range(sampling.n):
                written, ids, finished = len(p) - PROMPT_LEN, [], False
                for pos in range(written, written + sampling.max_new_tokens):
                    if p[PROMPT_LEN - 1] == 7 and pos == 4:
                        ids, finished = ids + [EOS], True
                        break
                    ids.append(10 * self.version + pos)
                out.append(Rollout(i, list(p), ids, "", [-self.version - 0.5] * len(ids), finished))
        return out


def run(engine, prompts, sampling, piece, publish_after_calls=None):
    """generate_in_pieces on `engine`; an update is published once it has had `publish_after_calls` calls."""
    def take_published():
        if publish_after_calls is not None and len(engine.calls) >= publish_after_calls:
            engine.published = 1
        engine.version = max(engine.version, engine.published)

    return generate_in_pieces(engine.generate, prompts, sampling, piece, version=lambda: engine.version,
                              take_published=take_published,
                              decode=lambda rs: [" ".join(map(str, r.token_ids)) for r in rs])


def test_an_update_published_between_pieces_writes_the_rest_of_each_response():
    engine = Engine()
    prompts = [[1, 2, 3], [4, 5, 7]]  # the second ends with EOS at its 5th token
    out = run(engine, prompts, Sampling(n=2, max_new_tokens=8), 3, publish_after_calls=1)
    assert [r.prompt_index for r in out] == [0, 0, 1, 1] and [r.prompt_ids for r in out] == [[1, 2, 3]] * 2 + [[4, 5, 7]] * 2
    # First piece: 3 tokens at version 0; then every later piece at version 1.
    assert out[0].token_ids == [0, 1, 2, 13, 14, 15, 16, 17]
    assert out[0].token_versions == [0, 0, 0, 1, 1, 1, 1, 1] and out[0].policy_version == 0
    assert out[0].logprobs == [-0.5] * 3 + [-1.5] * 5 and not out[0].finished
    assert out[2].token_ids == [0, 1, 2, 13, EOS] and out[2].finished and out[2].token_versions == [0, 0, 0, 1, 1]
    assert out[0].text == " ".join(map(str, out[0].token_ids))
    # The pieces: n samples first, then each unfinished response alone from its prompt and tokens so far.
    samplings = [s for _, s in engine.calls]
    assert [(s.n, s.max_new_tokens) for s in samplings] == [(2, 3), (1, 3), (1, 2)]
    assert engine.calls[1][0][0] == [1, 2, 3, 0, 1, 2] and len(engine.calls[2][0]) == 2  # the EOS one is done


def test_without_an_update_the_pieces_are_one_generation():
    engine = Engine()
    out = run(engine, [[1, 2, 3]], Sampling(n=1, max_new_tokens=7), 3)
    assert out[0].token_ids == list(range(7)) and out[0].token_versions == [0] * 7 and not out[0].finished
    whole = run(Engine(), [[1, 2, 3]], Sampling(n=1, max_new_tokens=7), 7)
    assert whole[0].token_ids == out[0].token_ids and len(whole) == 1


@pytest.mark.parametrize("piece", [1, 8, 20])
def test_every_piece_size_gives_whole_responses(piece):
    out = run(Engine(), [[1, 2, 3]], Sampling(n=3, max_new_tokens=8), piece, publish_after_calls=1)
    assert [len(r.token_ids) for r in out] == [8, 8, 8]
    first = min(piece, 8)
    assert all(r.token_versions == [0] * first + [1] * (8 - first) for r in out)
    assert all(r.logprobs == [-0.5] * first + [-1.5] * (8 - first) for r in out)
