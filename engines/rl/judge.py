"""A generative judge as a reward source: a language model reads the round's prompt, a response and
the reference answer through `reward.judge.template`, and its verdict becomes a score.

The judge runs in rollout engines of its own (vLLM or HF, engines/rollout/actors.py) whose weights
never change. Verdicts are read by `alignflow.config.round.verdicts.parse_verdict`. A response none of whose verdicts
parse scores `unparsed_reward`, and is counted: never a silent zero.
"""

from __future__ import annotations

import time

import torch

from alignflow.config.round.judge import JudgeRewardConfig
from alignflow.errors import ConfigError
from alignflow.config.round.verdicts import parse_verdict
from engines.batches import render_prompt
from engines.rl.rewards import ScoredText, prompt_text
from engines.rollout.base import Sampling


def judge_positions(model_positions: int, generation, field: str) -> int:
    """The judge engine's positions (its max_model_len, JudgeGeneration.engine_positions), a refusal
    naming `field`."""
    try:
        return generation.engine_positions(model_positions)
    except ValueError as err:
        raise ConfigError(f"{field}: {err}") from None


LONGEST_RENDERED = 256  # prompts rendered to find the longest judge prompt: the longest by characters


def round_judge_positions(model_positions: int, cfg: JudgeRewardConfig, field: str, *, judge_tokenizer,
                          policy_tokenizer, records: list[dict], response_tokens: int) -> int:
    """A round's judge engine positions. `max_model_len` where set; else, where the judge reads the policy's
    tokens (one vocabulary), what its prompts can need: the longest judge prompt of the round's prompts with an
    empty response, plus `response_tokens` (a response's most: max_new_tokens, an episode's tokens) and a
    tenth more for text retokenised at the template's seams, plus the verdict; at most the model's positions.
    vLLM holds KV cache for one sequence of max_model_len to start: a long-context judge's whole context
    (131072 for Llama 3.1) would not fit a shared GPU. A judge of another vocabulary counts a response's
    tokens otherwise: it keeps the model's positions (longer prompts are counted as judge/overlong either way)."""
    g = cfg.generation
    if g.max_model_len is not None or judge_tokenizer.get_vocab() != policy_tokenizer.get_vocab():
        return judge_positions(model_positions, g, field)
    longest = sorted(records, key=lambda r: len(prompt_text(r["prompt"])) + len(r.get("answer") or ""))
    items = [ScoredText(prompt_text(r["prompt"]), "", r.get("answer")) for r in longest[-LONGEST_RENDERED:]]
    empty = max((len(ids) for ids in Judge.prompt_ids(judge_tokenizer, cfg, items)), default=0)
    return min(model_positions, empty + response_tokens + -(-response_tokens // 10) + g.max_new_tokens)


def judge_messages(template: str, item: ScoredText) -> list[dict]:
    """The judge's prompt for one response, as one user message (rendered by the judge's chat template)."""
    content = template.format(prompt=item.prompt, response=item.response, answer=item.answer or "")
    return [{"role": "user", "content": content}]


class Judge:
    """Scores (prompt, response, answer) items with a judge model in `engines` (a RolloutEngines)."""

    def __init__(self, engines, tokenizer, cfg: JudgeRewardConfig, max_prompt_tokens: int):
        self.engines, self.tokenizer, self.cfg, self.max_prompt_tokens = engines, tokenizer, cfg, max_prompt_tokens

    @staticmethod
    def prompt_ids(tokenizer, cfg: JudgeRewardConfig, items: list[ScoredText]) -> list[list[int]]:
        """The judge's prompt of each item, rendered by its chat template: token ids."""
        return [render_prompt(tokenizer, judge_messages(cfg.template, item)) for item in items]

    def verdicts(self, items: list[ScoredText], ids: list[list[int]] | None = None) -> tuple[list[list[str]], int]:
        """Each item's verdict texts (`generation.num_samples` of them; none for a judge prompt over the
        judge's positions), and how many prompts were too long. `ids`: the items' prompt_ids, where the
        caller has rendered them already."""
        g = self.cfg.generation
        ids = self.prompt_ids(self.tokenizer, self.cfg, items) if ids is None else ids
        fits = [i for i, x in enumerate(ids) if len(x) <= self.max_prompt_tokens]
        texts: list[list[str]] = [[] for _ in items]
        if fits:
            sampling = Sampling(n=g.num_samples, temperature=g.temperature, top_p=g.top_p,
                                max_new_tokens=g.max_new_tokens)
            for r in self.engines.generate([ids[i] for i in fits], sampling):
                texts[fits[r.prompt_index]].append(r.text)
        return texts, len(items) - len(fits)

    def score(self, items: list[ScoredText]) -> tuple[torch.Tensor, dict[str, float]]:
        """(B,) scores: each item's parsed votes averaged, `unparsed_reward` where none parses; with metrics
        judge/unparsed (verdicts that did not parse), judge/unscored (items given unparsed_reward),
        judge/overlong (judge prompts over its positions, unscored too), judge/verdicts_per_s."""
        start = time.perf_counter()
        texts, overlong = self.verdicts(items)
        scores, unparsed, unscored = [], 0, 0
        for votes in texts:
            parsed = [v for v in (parse_verdict(t, self.cfg) for t in votes) if v is not None]
            unparsed += len(votes) - len(parsed)
            if parsed:
                scores.append(sum(parsed) / len(parsed))
            else:
                scores.append(self.cfg.unparsed_reward)
                unscored += 1
        seconds = time.perf_counter() - start
        n_verdicts = sum(len(v) for v in texts)
        metrics = {"judge/unparsed": float(unparsed), "judge/unscored": float(unscored),
                   "judge/overlong": float(overlong), "judge/verdicts_per_s": n_verdicts / max(seconds, 1e-9)}
        return torch.tensor(scores, dtype=torch.float32), metrics
