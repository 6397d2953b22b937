"""Partial rollouts: a generation written in pieces, with the newest published weights taken between them.

An asynchronous round publishes each update without waiting for the engines (engines/transport/sync.py:
the trainer announces it on the transport group's store, then sends it from a thread of its own). A
generation run whole would keep the weights it started with to its last token, however many updates
were published meanwhile. Run in pieces of `piece_tokens` new tokens, the engine looks between pieces
for an announced update, takes it (the trainer's send is waiting for it), and goes on: the rest of each
unfinished response is sampled, from its prompt and the tokens it has so far, by the newer weights.

Each token keeps the log-probability under the weights that sampled it (the behaviour policy the
truncated importance-sampling and IcePop corrections need) and, in `token_versions`, their version.
A rollout's `policy_version` is its first token's, the oldest: its staleness is bounded by that one.
The text is decoded once, from all the tokens, when the last piece ends (engines/rollout/texts.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from engines.rollout.base import Rollout, Sampling


def generate_in_pieces(generate: Callable[[list[list[int]], Sampling], list[Rollout]], prompt_ids: list[list[int]],
                       sampling: Sampling, piece_tokens: int, *, version: Callable[[], int],
                       take_published: Callable[[], None], decode: Callable[[list[Rollout]], list[str]]
                       ) -> list[Rollout]:
    """`generate` (an engine's) in pieces of at most `piece_tokens` new tokens, calling `take_published`
    before every piece after the first; `version()` is the weights' version a piece samples with.

    Returns the rollouts `generate(prompt_ids, sampling)` would, in its order (a prompt's n samples
    together), with `token_versions` and the text of the whole response (`decode`)."""
    first = sampling.max_new_tokens if piece_tokens >= sampling.max_new_tokens else piece_tokens
    v = version()
    out = [dataclasses.replace(r, policy_version=v, token_versions=[v] * len(r.token_ids))
           for r in generate(prompt_ids, dataclasses.replace(sampling, max_new_tokens=first))]
    while True:
        # Unfinished, and shorter than the limit: cut by a piece. They all hold the same number of tokens
        # (a piece ends a response early only with EOS); grouped by it all the same.
        left: dict[int, list[int]] = {}
        for i, r in enumerate(out):
            if not r.finished and len(r.token_ids) < sampling.max_new_tokens:
                left.setdefault(sampling.max_new_tokens - len(r.token_ids), []).append(i)
        if not left:
            break
        take_published()
        v = version()
        for remaining, rows in left.items():
            more = generate([out[i].prompt_ids + out[i].token_ids for i in rows],
                            dataclasses.replace(sampling, n=1, max_new_tokens=min(piece_tokens, remaining)))
            if len(more) != len(rows):
                raise RuntimeError(f"a piece of a partial rollout came back with {len(more)} responses for "
                                   f"{len(rows)} prompts")
            for i, c in zip(rows, more):
                if not c.token_ids and not c.finished:
                    raise RuntimeError(f"a piece of a partial rollout added no token to a response of "
                                       f"{len(out[i].token_ids)} tokens that had not ended")
                r = out[i]
                out[i] = dataclasses.replace(r, token_ids=r.token_ids + c.token_ids, logprobs=r.logprobs + c.logprobs,
                                             finished=c.finished,
                                             token_versions=r.token_versions + [v] * len(c.token_ids))
    return [dataclasses.replace(r, text=t) for r, t in zip(out, decode(out))]
