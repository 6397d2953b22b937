"""Token lengths of a dataset's splits, and the prompt/response limits they call for.

The data stage measures every split with the base model's tokenizer and
settles the two limits once, for every later stage (generation may lower
the prompt limit further to leave room for its new tokens, tasks/stages/data.py):

    max_prompt_tokens   = the config's value, or ("auto") the longest prompt
                          of any split, at most `positions - 1`
    max_response_tokens = the config's value, or ("auto") the longest response
                          (EOS included) of a row the prompt limit keeps, at
                          most what the positions leave

Prompts longer than the limit are left out (counted, per split); responses
longer than theirs are cut (counted, per split). Cutting a larger share of
a split's rows than `data.max_cut_fraction` allows is a DataError naming
the field, the limit and the length that keeps every row.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from alignflow.config import DataConfig
from alignflow.errors import DataError
from engines.batches import render_prompt

log = logging.getLogger("alignflow")

RESPONSE_KEYS = {"sft": ("response",), "preference": ("chosen", "rejected"), "preference_unpaired": ("response",),
                 "eval_preference": ("chosen", "rejected")}
# Step-labelled solutions: a response is its steps, each tokenized apart (as engines/steps.py does). One past the
# limit loses its last steps, counted and warned about (data/<split>_responses_cut), never failing.
STEP_SPLITS = ("process", "eval_process")


def percentile(values: list[int], q: float) -> int:
    """Nearest-rank percentile: the smallest value with at least q% of values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


@dataclass(frozen=True)
class SplitLengths:
    """Per row: prompt tokens, and the longest of its responses in tokens (EOS included; 0 if none)."""

    prompt: list[int]
    response: list[int]

    def stats(self) -> dict[str, int]:
        out = {f"prompt_tokens_{k}": v for k, v in _summary(self.prompt).items()}
        if any(self.response):
            out.update({f"response_tokens_{k}": v for k, v in _summary(self.response).items()})
        return out


def _summary(values: list[int]) -> dict[str, int]:
    return {"p50": percentile(values, 50), "p95": percentile(values, 95), "max": max(values)}


def measure(tokenizer, splits: dict[str, list[dict]]) -> dict[str, SplitLengths]:
    """Token lengths of every row of every split, as the training code tokenizes them."""
    out = {}
    for name, records in splits.items():
        if not records:
            continue
        prompts = [len(_rendered(tokenizer, r, name, i)) for i, r in enumerate(records)]
        keys = RESPONSE_KEYS.get(name, ())
        responses = [0] * len(records)
        if name in STEP_SPLITS:
            responses = [sum(map(len, tokenizer(r["steps"], add_special_tokens=False)["input_ids"])) for r in records]
        for key in keys:
            texts = [r[key] for r in records]
            ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
            responses = [max(a, len(b) + 1) for a, b in zip(responses, ids)]  # + EOS
        out[name] = SplitLengths(prompts, responses)
    return out


def _rendered(tokenizer, record: dict, split: str, i: int) -> list[int]:
    """A record's prompt ids, or a DataError naming the split, record and first words where the chat template
    refuses its messages (Gemma's refuses a system role; Llama-2's wants user and assistant in turn)."""
    from jinja2.exceptions import TemplateError

    try:
        return render_prompt(tokenizer, record["prompt"], record.get("tools"))
    except (TemplateError, ValueError) as err:  # ValueError: a tokenizer without a chat template
        first = record["prompt"][0] if isinstance(record["prompt"], list) else {}
        said = f"{first.get('role')}: {str(first.get('content'))[:60]!r}" if first else ""
        raise DataError(f"data split {split!r}, record {i + 1} (starting {said}): the tokenizer's chat template "
                        f"refuses its messages: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
                        ) from None


@dataclass(frozen=True)
class Limits:
    max_prompt_tokens: int
    max_response_tokens: int
    left_out: dict[str, int]  # split -> rows whose prompt is over the limit
    cut: dict[str, int]  # split -> rows whose response is cut

    def metrics(self) -> dict[str, float]:
        out = {"data/max_prompt_tokens": float(self.max_prompt_tokens),
               "data/max_response_tokens": float(self.max_response_tokens)}
        out.update({f"data/{s}_prompts_left_out": float(n) for s, n in self.left_out.items()})
        out.update({f"data/{s}_responses_cut": float(n) for s, n in self.cut.items()})
        return out


def resolve(cfg: DataConfig, lengths: dict[str, SplitLengths], positions: int) -> Limits:
    """The two limits (see the module docstring); a DataError if a split would lose too much."""
    longest_prompt = max(max(s.prompt) for s in lengths.values())
    if cfg.max_prompt_tokens == "auto":
        prompt_limit = min(longest_prompt, positions - 1)
    else:
        prompt_limit = cfg.max_prompt_tokens
    if prompt_limit >= positions:
        raise DataError(f"data.max_prompt_tokens={prompt_limit} leaves no room for a response: "
                        f"the model has {positions} positions")
    room = positions - prompt_limit
    # A row left out for its prompt is not trained on, so its response is not cut: only kept rows count.
    kept = {n: [r for p, r in zip(s.prompt, s.response) if p <= prompt_limit] for n, s in lengths.items()}
    longest_response = max((max(k, default=0) for k in kept.values()), default=1) or 1
    if cfg.max_response_tokens == "auto":
        response_limit = min(longest_response, room)
    else:
        response_limit = cfg.max_response_tokens
        if response_limit > room:
            raise DataError(f"data.max_prompt_tokens={prompt_limit} + data.max_response_tokens={response_limit} "
                            f"exceed the model's {positions} positions")
    left_out = {n: sum(p > prompt_limit for p in s.prompt) for n, s in lengths.items()}
    cut = {n: sum(r > response_limit for r in kept[n]) for n in lengths if n in RESPONSE_KEYS or n in STEP_SPLITS}
    for name, n_cut in cut.items():
        if name in STEP_SPLITS:
            if n_cut:
                log.warning("%s: %d of %d solutions are longer than data.max_response_tokens=%d; their steps past it "
                            "are not trained on or scored", name, n_cut, len(kept[name]), response_limit)
            continue
        allowed = cfg.max_cut_fraction.preference if "preference" in name else cfg.max_cut_fraction.sft
        total = len(kept[name])
        if n_cut > allowed * total:
            field = "preference" if "preference" in name else "sft"
            needed = max(kept[name])
            fit = (f"set data.max_response_tokens={needed}" if prompt_limit + needed <= positions else
                   f"the model's {positions} positions cannot hold them after {prompt_limit}-token prompts")
            raise DataError(
                f"{name}: {n_cut} of {total} responses are longer than data.max_response_tokens={response_limit} "
                f"and would be cut (allowed: data.max_cut_fraction.{field}={allowed:g}); the longest needs "
                f"{needed} tokens: {fit}, or allow the cut")
    return Limits(prompt_limit, response_limit, left_out, cut)


def describe(lengths: dict[str, SplitLengths], limits: Limits) -> list[str]:
    """One line per split: rows, token lengths, and what the limits leave out or cut."""
    lines = [f"token limits: prompt {limits.max_prompt_tokens}, response {limits.max_response_tokens}"]
    for name, s in lengths.items():
        st = s.stats()
        text = f"  {name}: {len(s.prompt)} rows, prompt p50/p95/max {st['prompt_tokens_p50']}/" \
               f"{st['prompt_tokens_p95']}/{st['prompt_tokens_max']}"
        if "response_tokens_max" in st:
            text += f", response {st['response_tokens_p50']}/{st['response_tokens_p95']}/{st['response_tokens_max']}"
        if limits.left_out.get(name):
            text += f"; {limits.left_out[name]} prompts over the limit left out"
        if limits.cut.get(name):
            text += f"; {limits.cut[name]} responses cut"
        lines.append(text)
    return lines
