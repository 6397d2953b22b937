"""Each prompt through the model once per group, not once per sample.

A GRPO/RLOO step scores n samples of each prompt. Under causal attention a
prompt token's keys and values do not depend on what follows, so the n rows
of a group compute the same prompt activations n times: 26 of 58 tokens per
row in the reference bench, 45 % of the forward and backward. Here the
prompt runs once per group into a key-value cache, the cache is indexed out
to the group's rows, and only each row's suffix runs on top of it:

    prefix call:  (G, Q)    prompt tokens 0 .. q_g - 1 of group g, right-padded; positions 0 .. Q - 1
    suffix call:  (R, T)    tokens q .. q + T - 1 of each row (the last prompt token, then the
                            response but its last token), positions q .. q + T - 1, attending to
                            [the group's prefix (its padding masked) | the suffix]

with q_g = prompt length - 1 and T the longest response. The suffix's hidden state at t predicts
response token t. Gradients flow through the cache back into the prefix call, so each prompt
token's gradient is the sum over its group's rows, as in the row-by-row computation; values and
gradients equal it within fp32 rounding (tests/engines/train/test_train_shared_prefix.py).

`plan` decides from the batch alone whether sharing applies: rows grouped by `prompt_index`,
each group's prompt checked token by token (a label that does not mean "same prompt" is never
trusted), and only when it saves tokens. `supported` rules out what a cache cannot go through
twice: gradient checkpointing with gradients on (the recomputation would append to the cache
again) and models whose forward takes no cache; and devices where it does not pay (`PAYS_ON`).

Where it pays, measured by bench/step/shared_prefix.py (8 prompts x 8 samples, 26-token prompts, one
micro-batch; plain / shared time, above 1: sharing pays): on 2 CPU cores with issue 14's 4.5M model in
fp32, 1.29x for the training pass and 1.55x for the reference (32 new tokens); on an H100 with
gpu-small's 0.48B model in bf16, 0.53x and 0.53x (32 new tokens), 0.62x and 0.58x (128). A GPU is not
short of FLOPs at these sizes: the two calls, the cache's gathers and the planner's host syncs cost more
than the prompt tokens they save.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import Tensor

from engines.models import hf_module, last_hidden

PAYS_ON = ("cpu",)  # device types where the shared forward beats the plain one (module docstring)


@dataclass(frozen=True)
class PrefixPlan:
    rows: Tensor  # (R,) the batch rows with at least one response token
    row_group: Tensor  # (R,) each row's group
    prefix_ids: Tensor  # (G, Q) each group's prompt but its last token, right-padded with 0
    prefix_mask: Tensor  # (G, Q) 1 on real prefix tokens
    prefix_len: Tensor  # (G,) q_g

    @property
    def groups(self) -> int:
        return int(self.prefix_ids.shape[0])


def supported(model) -> bool:
    """A forward that takes a key-value cache, no gradient checkpointing while gradients flow, and a device
    where sharing pays: the CPU. On a GPU the plain forward wins (PAYS_ON)."""
    base = hf_module(model)
    if next(base.parameters()).device.type not in PAYS_ON:
        return False
    if "past_key_values" not in inspect.signature(type(base).forward).parameters:
        return False
    return not (torch.is_grad_enabled() and getattr(base, "is_gradient_checkpointing", False))


def plan(batch: dict[str, Tensor]) -> PrefixPlan | None:
    """Groups of rows with one prompt (the RL layout with `prompt_index`), or None where sharing
    does not apply: no `prompt_index`, no group of two, a group whose rows' prompts differ, a
    one-token prompt, or no tokens saved."""
    if "prompt_index" not in batch or "response_index" not in batch:
        return None
    ids, attention, action = batch["input_ids"], batch["attention_mask"], batch["action_mask"] > 0
    rows = action.any(1).nonzero(as_tuple=True)[0]
    if rows.numel() < 2:
        return None
    keys, row_group = torch.unique(batch["prompt_index"][rows], return_inverse=True)
    n_groups, n_rows = int(keys.numel()), int(rows.numel())
    if n_groups == n_rows:
        return None
    q = batch["response_index"][rows, 0]  # the prompt's last token's position = prompt length - 1
    device = ids.device
    first = torch.full((n_groups,), n_rows, dtype=torch.long, device=device).scatter_reduce(
        0, row_group, torch.arange(n_rows, device=device), "amin")
    prefix_len = q[first]
    if (q != prefix_len[row_group]).any() or (prefix_len < 1).any():
        return None
    width = int(prefix_len.max())
    prefix_mask = torch.arange(width, device=device).unsqueeze(0) < prefix_len.unsqueeze(1)  # (G, Q)
    prefix_ids = ids[rows[first], :width] * prefix_mask
    row_mask = prefix_mask[row_group]
    if not ((ids[rows, :width] == prefix_ids[row_group]) | ~row_mask).all():
        return None
    if not (attention[rows, :width].bool() | ~row_mask).all():
        return None
    shared_tokens = n_groups * width + n_rows * action.shape[1]
    if shared_tokens >= n_rows * ids.shape[1]:
        return None
    return PrefixPlan(rows=rows, row_group=row_group, prefix_ids=prefix_ids, prefix_mask=prefix_mask.long(),
                      prefix_len=prefix_len)


def _rows_of_groups(cache, row_group: Tensor) -> None:
    """Each layer's prefix keys and values, (G, ...) -> (R, ...): row r gets its group's. With
    `index_select`, whose backward sums a group's rows with `index_add_` in row order, not the
    cache's own `batch_select_indices` (`keys[indices]`): on the CPU that backward accumulates
    with atomic adds across threads, so the order, and the last bits of the prefix's gradients,
    depended on how the threads were scheduled; runs that shared their cores with another process
    (asynchronous rollouts) did not repeat."""
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.index_select(0, row_group), layer.values.index_select(0, row_group)


def response_hidden(model, batch: dict[str, Tensor], p: PrefixPlan, **keep) -> Tensor:
    """The last layer's hidden states that predict each row's response tokens: (R, T, H), row r's
    position t predicting response token t (rows `p.rows`). `keep`: the output layer's
    `logits_to_keep`, passed to both calls."""
    from transformers.cache_utils import DynamicCache

    device = batch["input_ids"].device
    ids, action = batch["input_ids"], batch["action_mask"][p.rows] > 0
    prefix_ids, prefix_mask, row_group, prefix_len = p.prefix_ids, p.prefix_mask, p.row_group, p.prefix_len
    groups, width = prefix_ids.shape
    cache = DynamicCache(config=hf_module(model).config)
    model(input_ids=prefix_ids, attention_mask=prefix_mask,
          position_ids=torch.arange(width, device=device).expand(groups, width),
          past_key_values=cache, use_cache=True, **keep)
    _rows_of_groups(cache, row_group)
    steps = action.shape[1]
    start = prefix_len[row_group].unsqueeze(1)  # (R, 1)
    positions = start + torch.arange(steps, device=device)  # (R, T)
    # Real suffix steps: those whose next token (response token t) is in the sequence, whether the policy
    # sampled it or not (an episode's observations sit inside its response, action 0 but in context).
    length = ids.shape[1]
    real = (positions + 1 < length) & batch["attention_mask"][p.rows].gather(
        1, (positions + 1).clamp(max=length - 1)).bool()
    suffix_ids = ids[p.rows].gather(1, positions.clamp(max=length - 1)) * real
    return last_hidden(model, input_ids=suffix_ids, attention_mask=torch.cat([prefix_mask[row_group], real.long()], 1),
                       position_ids=torch.where(real, positions, start), past_key_values=cache, use_cache=True,
                       **keep)
