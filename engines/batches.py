"""Canonical records -> token tensors, with prompt-length accounting.

Prompts (strings or chat messages) are rendered with the tokenizer's chat
template. Prompts longer than `max_prompt_tokens` are never cut: they are
counted, reported and left out, and a split where none fit is an error.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from alignflow.errors import DataError, PromptTooLongError

log = logging.getLogger(__name__)


def render_prompt(tokenizer, prompt: str | list[dict], tools: list[dict] | None = None) -> list[int]:
    """A prompt's token ids: a string as it is, after BOS where the tokenizer starts texts with one (Llama,
    Gemma and Mistral base models; not Qwen), once; messages through the chat template (which writes its own
    BOS), with `tools` (JSON schemas, a record's "tools": agent traces) where given."""
    if isinstance(prompt, str):
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        bos = tokenizer.bos_token_id
        if bos is not None and ids[:1] != [bos] and _starts_with_bos(tokenizer, bos):
            ids = [bos, *ids]
        return ids
    return chat_ids(tokenizer, prompt, tools)


_STARTS_WITH_BOS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (bos id, whether)


def _starts_with_bos(tokenizer, bos: int) -> bool:
    """Whether `tokenizer` starts a text with `bos` by itself, asked once per tokenizer object and BOS id."""
    known = _STARTS_WITH_BOS.get(tokenizer)
    if known is None or known[0] != bos:
        known = _STARTS_WITH_BOS[tokenizer] = (bos, tokenizer("a")["input_ids"][:1] == [bos])
    return known[1]


def chat_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None,
             generation_prompt: bool = True) -> list[int]:
    """`messages` through the tokenizer's chat template, as token ids (with the next turn's generation prompt
    where `generation_prompt`)."""
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def assistant_spans(tokenizer, messages: list[dict], tools: list[dict] | None, rendered: list[int],
                    where: str) -> list[tuple[int, int]]:
    """[start, end) in `rendered` (the conversation as `render_prompt` renders it) of each assistant message's
    tokens, multi-turn SFT's loss mask (sft.train_on: assistant_turns, as OpenRLHF's --multiturn and TRL's
    assistant_only_loss): the tokens of chat_ids(messages[: i + 1]) after chat_ids(messages[: i], generation
    prompt), that is its content and the template's end of turn. This holds only for a template that renders
    an earlier turn as it renders the same turn last (Qwen3's drops earlier turns' reasoning, for one); a
    conversation where it does not is an error naming the record (`where`) and the turn, not a mask over the
    wrong tokens."""
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = chat_ids(tokenizer, messages[:i], tools)
        through = chat_ids(tokenizer, messages[: i + 1], tools, generation_prompt=False)
        if through[: len(before)] != before or rendered[: len(through)] != through or len(through) == len(before):
            raise DataError(
                f"{where}: assistant turn {i} (message {i + 1} of {len(messages)}) renders differently once the "
                f"conversation goes on: the chat template rewrites earlier turns (as Qwen3's drops their reasoning), "
                f"so its tokens cannot be found to train on. Set sft.train_on: response (the last reply only), "
                f"or give each assistant turn a record of its own")
        spans.append((len(before), len(through)))
    return spans


def encode_response(tokenizer, text: str, max_tokens: int) -> list[int]:
    """Response tokens followed by EOS, truncated to `max_tokens` (EOS kept if it fits)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return ids[:max_tokens]


@dataclass(frozen=True)
class LengthReport:
    total: int
    overlong: int
    max_prompt_tokens: int
    assistant_turns: int | None = None  # earlier assistant turns trained besides the responses (sft_tensors)
    steps_cut: int | None = None  # steps past the response limit (engines/steps.py)

    def as_metrics(self, split: str) -> dict[str, float]:
        turns = {} if self.assistant_turns is None else {f"data/{split}_assistant_turns": self.assistant_turns}
        cut = {} if self.steps_cut is None else {f"data/{split}_steps_cut": self.steps_cut}
        return {f"data/{split}_rows": self.total, f"data/{split}_overlong_prompts": self.overlong} | turns | cut


def filter_prompts(
    tokenizer, records: list[dict], max_prompt_tokens: int, split: str,
    render: Callable[[dict], list[int]] | None = None,
) -> tuple[list[tuple[list[int], dict]], LengthReport]:
    """(prompt ids, record) for every record whose prompt fits; counts the rest. `render`: a record's prompt
    ids, where they are not its prompt and "tools" through the chat template (an environment's episodes)."""
    if not records:  # e.g. data.preference holding unpaired (KTO) rows alone, where a stage trains on pairs
        raise DataError(f"{split}: the split holds no rows")
    kept = []
    for r in records:
        ids = render(r) if render else render_prompt(tokenizer, r["prompt"], r.get("tools"))
        if len(ids) <= max_prompt_tokens:
            kept.append((ids, r))
    report = LengthReport(total=len(records), overlong=len(records) - len(kept), max_prompt_tokens=max_prompt_tokens)
    if report.overlong:
        log.warning(
            "%s: %d of %d prompts exceed max_prompt_tokens=%d and are left out",
            split, report.overlong, report.total, max_prompt_tokens,
        )
    if not kept:
        raise PromptTooLongError(
            f"{split}: all {report.total} prompts exceed data.max_prompt_tokens={max_prompt_tokens}"
        )
    return kept, report


def pad_right(seqs: list[list[int]], value: int) -> torch.Tensor:
    """Right-pad lists of ints to one width: (N, max len) long."""
    width = max(len(s) for s in seqs)
    return torch.tensor([s + [value] * (width - len(s)) for s in seqs], dtype=torch.long)


def right_padded(seqs: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """input_ids and attention_mask of token sequences, right-padded: (N, L)."""
    return {"input_ids": pad_right(seqs, pad_id), "attention_mask": pad_right([[1] * len(s) for s in seqs], 0)}


def sft_tensors(tokenizer, records: list[dict], max_prompt_tokens: int, max_response_tokens: int, *,
                assistant_turns: bool = False) -> tuple[dict[str, torch.Tensor], LengthReport]:
    """input_ids, attention_mask, loss_mask (1 on response tokens incl. EOS; with `assistant_turns`, on a
    conversation prompt's assistant messages too: `assistant_spans`): (N, L)."""
    kept, report = filter_prompts(tokenizer, records, max_prompt_tokens, "sft")
    row = {id(r): n for n, r in enumerate(records)} if assistant_turns else {}
    seqs, masks, turns = [], [], 0
    for ids, r in kept:
        mask = [0] * len(ids)
        if assistant_turns and isinstance(r["prompt"], list):
            where = f"sft split, record {row[id(r)] + 1}"
            for start, end in assistant_spans(tokenizer, r["prompt"], r.get("tools"), ids, where):
                mask[start:end], turns = [1] * (end - start), turns + 1
        resp = encode_response(tokenizer, r["response"], max_response_tokens)
        seqs.append(ids + resp)
        masks.append(mask + [1] * len(resp))
    report = dataclasses.replace(report, assistant_turns=turns) if assistant_turns else report
    if assistant_turns and not turns:
        log.warning("sft.train_on is assistant_turns, but no sft prompt holds an assistant turn: responses only")
    return {**right_padded(seqs, tokenizer.pad_token_id), "loss_mask": pad_right(masks, 0)}, report


def pair_tensors(tokenizer, records: list[dict], max_prompt_tokens: int, max_response_tokens: int) -> tuple[dict[str, torch.Tensor], LengthReport]:
    """Chosen and rejected sequences stacked: rows [0, N) chosen, [N, 2N) rejected."""
    kept, report = filter_prompts(tokenizer, records, max_prompt_tokens, "preference")
    chosen = [ids + encode_response(tokenizer, r["chosen"], max_response_tokens) for ids, r in kept]
    rejected = [ids + encode_response(tokenizer, r["rejected"], max_response_tokens) for ids, r in kept]
    return right_padded(chosen + rejected, tokenizer.pad_token_id), report


def split_pairs(batch: dict[str, torch.Tensor], index: torch.Tensor, n_pairs: int) -> dict[str, torch.Tensor]:
    """Select pairs `index` from a pair_tensors batch, keeping the chosen/rejected halves."""
    rows = torch.cat([index, index + n_pairs])
    return {k: v[rows] for k, v in batch.items()}


def take(batch: dict[str, Any], index: torch.Tensor) -> dict[str, Any]:
    return {k: v[index] for k, v in batch.items()}


def shard(batch: dict[str, torch.Tensor], world_size: int, paired: bool = False) -> list[dict[str, torch.Tensor]]:
    """Split a batch into `world_size` equal row shards (pairs stay together)."""
    n = batch["input_ids"].shape[0] // (2 if paired else 1)
    if n % world_size:
        raise ValueError(f"batch of {n} does not split across {world_size} workers")
    per = n // world_size
    shards = []
    for r in range(world_size):
        idx = torch.arange(r * per, (r + 1) * per)
        shards.append(split_pairs(batch, idx, n) if paired else take(batch, idx))
    return shards


def padded_shards(batch: dict[str, torch.Tensor], world_size: int) -> list[dict[str, torch.Tensor]]:
    """A batch's rows in `world_size` consecutive shards of one size, ceil(n / world_size), the last
    filled up with copies of the last row (results on them are dropped): under ZeRO-3 every rank
    must run as many forwards as the others, so each gets as many rows."""
    n = batch["input_ids"].shape[0]
    per = -(-n // world_size)
    rows = torch.arange(per * world_size).clamp(max=n - 1)
    return [take(batch, rows[r * per : (r + 1) * per]) for r in range(world_size)]


def rows_per_pass(n_rows: int, size: int, multiple_of: int = 1) -> int:
    """How many of `n_rows` one pass of `minibatches` trains on: the rest (its remainder, and each chunk's
    cut to a multiple of `multiple_of`) are left out of that pass, a different set each pass."""
    if n_rows <= size:
        return n_rows - n_rows % multiple_of
    return (n_rows // size) * (size - size % multiple_of)


def minibatches(n_rows: int, size: int, *, epochs: int, generator: torch.Generator,
                multiple_of: int = 1) -> Iterator[torch.Tensor]:
    """Row indices of every minibatch of `epochs` passes over `n_rows` rows.

    Each pass is a fresh shuffle cut into chunks of `size`; the remainder is
    dropped when there is more than one chunk. Each chunk is cut to a multiple
    of `multiple_of` (so rows split evenly across a trainer group's ranks), and
    a chunk left empty is skipped.

    The shuffle picks which rows a chunk holds; within it they keep the batch's
    order (ascending). A batch lists each prompt's samples together, and so do
    its chunks, their shards and micro-batches: the shared-prefix forward
    (engines/train/shared_prefix.py) runs each prompt once per micro-batch, not once
    per sample scattered into it. On issue 14's work (4 micro-batches of 256
    rows), shuffled micro-batches held 24-31 prompts each, in order 6-10, and
    the actor's step on one core took 3.95 s shuffled, 3.38 s in order.
    """
    for _ in range(epochs):
        perm = torch.randperm(n_rows, generator=generator)
        chunks = [perm] if n_rows <= size else [perm[i : i + size] for i in range(0, n_rows - size + 1, size)]
        for chunk in chunks:
            chunk = chunk[: len(chunk) - len(chunk) % multiple_of]
            if len(chunk):
                yield chunk.sort().values
