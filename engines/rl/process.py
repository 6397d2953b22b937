"""A process reward model rewarding a round's responses, one reward per response or one per step.

Each response is split into steps at the data's separator and tokenized a step
at a time, as the model trained (engines/steps.py `solution_tensors`); the
model's scorer actor scores them. With `dense: false` a response's reward
aggregates its steps' scores (`step_aggregation`); with `dense: true` each step's
score is a reward at the policy's token that completes the step
(`step_end_tokens`), for the advantages (algos/advantages/process.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

import algos
from engines.rollout.base import Rollout
from engines.rollout.texts import CONTEXT_TOKENS, response_texts
from engines.steps import solution_tensors, step_spans


@dataclass(frozen=True)
class ProcessReward:
    sequence: torch.Tensor  # (B,): the response's reward (dense: its step rewards' sum, logged, not trained on)
    steps: algos.StepRewards | None  # dense: each step's reward at its last token, (B, T); else None
    metrics: dict[str, float]


def process_reward(score: Callable, tokenizer, rollouts: list[Rollout], separator: str, source, width: int
                   ) -> ProcessReward:
    """The process reward of `source` (a process_model RewardSourceConfig) for `rollouts`. `score(method, batch,
    *args)` calls the model's ScorerActor (engines/rl/scoring.py); `width` is the step's T (its action mask's).
    Counted: process/responses_without_steps; dense, also process/steps_per_response and
    process/steps_sharing_a_token (steps whose end falls on the token of an earlier step's, their rewards added)."""
    batch = solution_tensors(tokenizer, rollouts, separator)
    counts = batch["step_mask"].sum(1)
    metrics = {"process/responses_without_steps": float((counts == 0).sum())}
    if not source.dense:
        return ProcessReward(score("process_rewards", batch, source.step_aggregation, source.no_step_reward),
                             None, metrics)
    scores = score("step_rewards", batch)  # (B, L), read at the step ends
    rewards, ends = torch.zeros(len(rollouts), width), torch.zeros(len(rollouts), width)
    shared = 0
    for b, (r, at) in enumerate(zip(rollouts, step_end_tokens(tokenizer, rollouts, separator), strict=True)):
        got = scores[b][batch["step_mask"][b] > 0].tolist()
        if len(got) != len(at):
            raise RuntimeError(f"response {b}: {len(got)} step scores for {len(at)} steps found in its tokens")
        if not got and r.token_ids:  # no step: the whole response is one, at its last token
            got, at = [source.no_step_reward], [len(r.token_ids) - 1]
        for value, t in zip(got, at):
            shared += int(ends[b, t].item() > 0)
            rewards[b, t] += value
            ends[b, t] += 1.0  # the steps ending at t (algos.StepRewards)
    metrics.update({"process/steps_per_response": counts.float().mean().item() if len(counts) else 0.0,
                    "process/steps_sharing_a_token": float(shared)})
    return ProcessReward(rewards.sum(1), algos.StepRewards(source.weight * rewards, ends), metrics)


def step_end_tokens(tokenizer, rollouts: list, separator: str) -> list[list[int]]:
    """For each response (a round's Rollouts), the index in its token_ids of the token that completes each of
    its steps (`response_steps`' steps, in order): the first token whose text, decoded up to it as the
    response's own (engines/rollout/texts.py), reaches the step's end. Where the policy's tokens merge two
    steps' ends, both get the one token.

    A fast tokenizer decodes each response once, a token at a time, as vLLM's incremental detokenizer does (a
    `DecodeStream` primed with the prompt's last tokens, as the response's text was decoded): linear in its
    tokens. Another tokenizer: a binary search per step over decodes of the response's prefixes."""
    marks = [[end for _, end in step_spans(r.text, separator, r.finished)] for r in rollouts]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return _searched(tokenizer, rollouts, marks)
    return [_streamed(backend, r, ends) for r, ends in zip(rollouts, marks)]


def _streamed(backend, rollout: Rollout, marks: list[int]) -> list[int]:
    """The first token whose streamed text reaches each of `marks` (ascending character offsets)."""
    from tokenizers.decoders import DecodeStream

    found: list[int] = []
    if not marks:
        return found
    stream = DecodeStream(skip_special_tokens=True)
    if context := list(rollout.prompt_ids[-CONTEXT_TOKENS:]):
        stream.step(backend, context)  # the prompt's text is not the response's
    length = 0
    for i, token in enumerate(rollout.token_ids):
        length += len(stream.step(backend, token) or "")
        while len(found) < len(marks) and length >= marks[len(found)]:
            found.append(i)
        if len(found) == len(marks):
            return found
    return found + [len(rollout.token_ids) - 1] * (len(marks) - len(found))  # past the tokens' text: the last


def _searched(tokenizer, rollouts: list, marks: list[list[int]]) -> list[list[int]]:
    """`step_end_tokens` by a binary search per step, every step's decodes of a round in one batch."""
    pairs = [(b, end) for b, ends in enumerate(marks) for end in ends]
    low = [1] * len(pairs)  # the fewest tokens whose text may reach the end, and the most it takes
    high = [max(len(rollouts[b].token_ids), 1) for b, _ in pairs]
    while any(lo < hi for lo, hi in zip(low, high)):
        open_ = [i for i, (lo, hi) in enumerate(zip(low, high)) if lo < hi]
        mids = [(low[i] + high[i]) // 2 for i in open_]
        texts = response_texts(tokenizer, [rollouts[pairs[i][0]].prompt_ids for i in open_],
                               [rollouts[pairs[i][0]].token_ids[:m] for i, m in zip(open_, mids)])
        for i, m, text in zip(open_, mids, texts):
            if len(text) >= pairs[i][1]:
                high[i] = m
            else:
                low[i] = m + 1
    ends: list[list[int]] = [[] for _ in rollouts]
    for (b, _), k in zip(pairs, low):
        ends[b].append(k - 1)
    return ends
