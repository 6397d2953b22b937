"""Step-labelled solutions for a process reward model: their tensors, its training objective, its step scores.

A solution is tokenized a step at a time (each step's text ends with its
separator, alignflow/data/rows.py), so a step ends on a token of its own
whatever the tokenizer would merge across steps; the model scores a step at
that last token. Whatever scores solutions later tokenizes them the same way.

    input_ids, attention_mask   (N, L)  prompt, then the steps; right-padded
    step_mask                   (N, L)  1 at each step's last token
    step_labels                 (N, L)  its label (1: still right), 0 elsewhere
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from algos.losses.process import stepwise_reward_loss
from engines.batches import LengthReport, filter_prompts, pad_right, right_padded
from engines.models import last_hidden

log = logging.getLogger("alignflow")


def _rows(tokenizer, prompts: list[list[int]], steps: list[list[str]], labels: list[list[bool]],
          max_response_tokens: int | None) -> tuple[dict[str, torch.Tensor], int]:
    """The tensors above, and how many steps lay past `max_response_tokens` (left out; None: no limit)."""
    seqs, masks, marks, cut = [], [], [], 0
    for ids, texts, rights in zip(prompts, steps, labels, strict=True):
        seq, mask, mark = list(ids), [0] * len(ids), [0.0] * len(ids)
        pieces = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        used = 0
        for k, (piece, right) in enumerate(zip(pieces, rights, strict=True)):
            if max_response_tokens is not None and used + len(piece) > max_response_tokens:
                cut += len(pieces) - k
                break
            used += len(piece)
            seq += piece
            mask += [0] * (len(piece) - 1) + [1]
            mark += [0.0] * (len(piece) - 1) + [float(right)]
        seqs.append(seq)
        masks.append(mask)
        marks.append(mark)
    tensors = {**right_padded(seqs, tokenizer.pad_token_id), "step_mask": pad_right(masks, 0),
               "step_labels": torch.nn.utils.rnn.pad_sequence([torch.tensor(x) for x in marks], batch_first=True)}
    return tensors, cut


def stepwise_tensors(tokenizer, records: list[dict], max_prompt_tokens: int, max_response_tokens: int, *,
                     split: str = "process") -> tuple[dict[str, torch.Tensor], LengthReport]:
    """The tensors above for `records` ({"prompt", "steps", "labels"}). Prompts over `max_prompt_tokens` are left
    out (counted); steps past `max_response_tokens` are dropped, counted (LengthReport.steps_cut) and warned of."""
    kept, report = filter_prompts(tokenizer, records, max_prompt_tokens, split)
    tensors, cut = _rows(tokenizer, [ids for ids, _ in kept], [r["steps"] for _, r in kept],
                         [r["labels"] for _, r in kept], max_response_tokens)
    if cut:
        log.warning("%s: %d steps lie past data.max_response_tokens=%d and are left out", split, cut,
                    max_response_tokens)
    return tensors, dataclasses.replace(report, steps_cut=cut)


def step_spans(text: str, separator: str, finished: bool) -> list[tuple[str, int]]:
    """(step, the character offset in `text` where it ends) of each of `response_steps`' steps."""
    pieces, spans, start = text.split(separator), [], 0
    if not finished:
        pieces = pieces[:-1]  # '' where the cut fell right after a separator
    for piece in pieces:
        end = min(start + len(piece) + len(separator), len(text))  # a finished last piece: the text's end
        if piece.strip():
            spans.append((piece + separator, end))
        start = end
    return spans


def response_steps(text: str, separator: str, finished: bool = True) -> list[str]:
    """A response's steps as the process reward model read its training solutions: the text between
    separators, each followed by the separator (the last one too, where a finished response ends without it;
    a response cut by the length limit loses its unfinished last piece instead); empty pieces (separators in
    a row, or leading) are no steps."""
    return [step for step, _ in step_spans(text, separator, finished)]


def solution_tensors(tokenizer, rollouts: list, separator: str) -> dict[str, torch.Tensor]:
    """The tensors above for sampled responses (a round's Rollouts: their prompt ids, response text and whether
    it finished), each split into steps by `separator` (`response_steps`); labels 0. A response without a step
    gets no mark."""
    steps = [response_steps(r.text, separator, r.finished) for r in rollouts]
    return _rows(tokenizer, [r.prompt_ids for r in rollouts], steps, [[False] * len(s) for s in steps], None)[0]


def steps(batch: dict[str, torch.Tensor]) -> float:
    """For `stepwise_objective`'s mean over steps: the micro-batch's labelled steps."""
    return float(batch["step_mask"].sum())


def step_scores(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The scalar head's score at every position: (B, L) float32; read it where step_mask is 1."""
    head = getattr(getattr(model, "module", model), "score", None)  # under a DeepSpeed engine: its module's
    if head is None:
        raise ValueError("a process reward model needs a scalar head named `score` (…ForSequenceClassification)")
    hidden = last_hidden(model, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return head(hidden).squeeze(-1).float()


def stepwise_objective(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """Binary cross-entropy of each step's score against its label (algos.stepwise_reward_loss), a mean over
    the micro-batch's steps (weighed by `steps`). Metrics: loss, and step_accuracy and positive_fraction as
    (sum, count) over the steps (engines/accumulate.py), so that every micro-batch and rank reports the same
    keys: one without a step (every step cut) adds (0, 0) and a zero-gradient loss."""
    mask = batch["step_mask"] > 0
    scores = step_scores(model, batch)
    n = mask.sum().float()
    if not bool(mask.any()):
        zero = scores.sum() * 0.0  # every rank's backward still runs through the model
        return zero, {"loss": zero.detach(), "step_accuracy": (n, n), "positive_fraction": (n, n)}
    out = stepwise_reward_loss(scores[mask], batch["step_labels"][mask])
    return out.loss, {"loss": out.loss.detach(), "step_accuracy": (out.accuracy * n, n),
                      "positive_fraction": (out.positive_fraction * n, n)}
