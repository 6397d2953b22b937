"""Sequence packing: several samples per row, attention that never crosses samples.

Right-padded rows (input_ids, attention_mask, loss_mask: (N, L), as `engines.batches.sft_tensors`,
`pair_tensors` and `engines.train.preference.preference_tensors` make them) are packed first-fit-decreasing
into rows of at most `max_tokens` tokens:

    row r:  sample a (positions 0..n_a-1) | sample b (positions 0..n_b-1) | padding (positions 0..)

with, per token, `position_ids` (restarting at 0 in every sample, so rotary embeddings see each sample
as it would alone) and `sample_index` (the source row, -1 on padding). Every tensor stays row-aligned
(P, W), so a packed batch can be taken, sharded and micro-batched like any other.

Attention, chosen by the model's `attn_implementation` (never by guessing the device):

  - flash_attention_* (GPU): no mask; `cu_seq_lens_q/k` and `max_length_q/k` (the segments of the
    flattened P x W tokens, padding tails included as their own segments) go to the model, which
    hands them to varlen flash attention (transformers' FlashAttentionKwargs);
  - sdpa / eager: an explicit 4-D block-diagonal causal mask (P, 1, W, W), which transformers uses
    as it is (`masking_utils._preprocess_mask_arguments`: "If the mask is already 4D, simply return
    as-is"): boolean (True: attend) for sdpa, additive float (0 / dtype min) for eager, which adds it
    to the scores. A padding tail attends only to itself, so no query row is empty.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from alignflow.errors import DataError
from engines.models import text_config

PACKED_KEYS = ("input_ids", "position_ids", "sample_index", "loss_mask")


@dataclass(frozen=True)
class PackStats:
    """samples packed into `rows` rows of `width` slots, `tokens` of them real."""

    samples: int
    rows: int
    width: int
    tokens: int

    @property
    def fill(self) -> float:
        return self.tokens / max(1, self.rows * self.width)

    def as_metrics(self) -> dict[str, tuple[float, float]]:
        """As (sum, count) pairs (engines/accumulate.py add_metrics), exact over micro-batches and ranks:
        `packing/fill` real tokens per slot, `packing/rows_per_sample` (under 1 where samples share rows)."""
        return {"packing/fill": (float(self.tokens), float(self.rows * self.width)),
                "packing/rows_per_sample": (float(self.rows), float(self.samples))}


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of sample indices, each summing to at most `capacity`: samples by length, longest first
    (ties: lower index first), each into the first bin with room. Deterministic."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        b = next((b for b, r in enumerate(room) if r >= lengths[i]), None)
        if b is None:
            bins.append([])
            room.append(capacity)
            b = len(bins) - 1
        bins[b].append(i)
        room[b] -= lengths[i]
    return bins


def row_lengths(tensors: dict[str, Tensor]) -> list[int]:
    """Real tokens per right-padded row; rows whose mask is not a prefix of ones are an error."""
    mask = tensors["attention_mask"]
    lengths = mask.sum(1)
    prefix = torch.arange(mask.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    bad = (prefix != (mask > 0)).any(1).nonzero().flatten().tolist()
    if bad:
        raise DataError(f"packing: rows {bad[:5]} are not right-padded (attention_mask is not 1...1 0...0)")
    return lengths.tolist()


def check_fits(tensors: dict[str, Tensor], max_tokens: int, where: str) -> None:
    """Every row of a split (and of its `kl_` rows, KTO's) within `max_tokens` (`where`: the config field),
    checked before training: during it, the rank whose micro-batch held the row would fail alone, its
    peers waiting for it in a collective."""
    for prefix, label in (("", "training"), ("kl_", "KTO mismatched (kl_)")):
        if f"{prefix}attention_mask" not in tensors:
            continue
        lengths = tensors[f"{prefix}attention_mask"].sum(1)
        over = (lengths > max_tokens).nonzero().flatten().tolist()
        if over:
            raise DataError(f"{where}={max_tokens}: {len(over)} {label} rows are longer (row {over[0]}: "
                            f"{int(lengths[over[0]])} tokens), and packing never cuts a row: raise it, or lower "
                            "the data's token limits")


def pack_rows(tensors: dict[str, Tensor], max_tokens: int, *, pad_id: int = 0) -> tuple[dict[str, Tensor], PackStats]:
    """Pack right-padded rows into rows of at most `max_tokens` tokens (first-fit-decreasing).

    Returns {input_ids, position_ids, sample_index, loss_mask (where given)}: (P, W) each, W the
    fullest packed row; padding slots hold `pad_id`, sample_index -1, loss_mask 0. Every token of every
    row is kept, no sample is split; an empty row, or one longer than `max_tokens`, is an error naming it.
    """
    lengths = row_lengths(tensors)
    if not lengths:
        raise DataError("packing: no rows to pack")
    over = [(i, n) for i, n in enumerate(lengths) if n > max_tokens or n == 0]
    if over:
        i, n = over[0]
        raise DataError(f"packing: row {i} has {n} tokens, " + ("none to pack" if n == 0 else
                        f"more than max_tokens={max_tokens} (rows are never cut)")
                        + (f"; {len(over) - 1} more such rows" if len(over) > 1 else ""))
    bins = first_fit_decreasing(lengths, max_tokens)
    width = max(sum(lengths[i] for i in b) for b in bins)
    src_row, src_col, dst_row, dst_col = [], [], [], []  # real tokens: source (row, col) -> packed (row, col)
    tail_row, tail_col, tail_pos = [], [], []  # padding tails, positions 0.. (a segment of their own)
    for r, b in enumerate(bins):
        start = 0
        for i in b:
            n = lengths[i]
            src_row += [i] * n
            src_col += range(n)
            dst_row += [r] * n
            dst_col += range(start, start + n)
            start += n
        tail_row += [r] * (width - start)
        tail_col += range(start, width)
        tail_pos += range(width - start)
    src, dst, tail = ((torch.tensor(a, dtype=torch.long), torch.tensor(b, dtype=torch.long))
                      for a, b in ((src_row, src_col), (dst_row, dst_col), (tail_row, tail_col)))
    shape = (len(bins), width)
    ids = tensors["input_ids"]
    positions = torch.zeros(shape, dtype=torch.long).index_put(dst, src[1])
    out = {"input_ids": torch.full(shape, pad_id, dtype=ids.dtype).index_put(dst, ids[src]),
           "position_ids": positions.index_put(tail, torch.tensor(tail_pos, dtype=torch.long)),
           "sample_index": torch.full(shape, -1, dtype=torch.long).index_put(dst, src[0])}
    if "loss_mask" in tensors:
        lm = tensors["loss_mask"]
        out["loss_mask"] = torch.zeros(shape, dtype=lm.dtype).index_put(dst, lm[src])
    return out, PackStats(samples=len(lengths), rows=len(bins), width=width, tokens=sum(lengths))


def pack_batch(batch: dict[str, Tensor], max_tokens: int | None = None, *,
               pad_id: int = 0) -> tuple[dict[str, Tensor], PackStats]:
    """A right-padded batch packed on the fly, rows of at most `max_tokens` (None: the batch's padded
    width, which every row fits), on the batch's device; and how it packed."""
    device = batch["input_ids"].device
    cpu = {k: batch[k].cpu() for k in ("input_ids", "attention_mask", "loss_mask") if k in batch}
    packed, stats = pack_rows(cpu, max_tokens or int(batch["input_ids"].shape[1]), pad_id=pad_id)
    return {k: v.to(device) for k, v in packed.items()}, stats


# ---- attention ----------------------------------------------------------------------------


def attention_kind(model) -> str:
    """'varlen' (flash attention: cu_seqlens, no mask), 'sdpa' or 'eager' (an explicit 4-D mask),
    from the model's configured attention implementation."""
    impl = getattr(getattr(model, "module", model).config, "_attn_implementation", None) or "eager"
    if "flash" in impl:
        return "varlen"
    if impl in ("sdpa", "eager"):
        return impl
    raise ValueError(f"packing: attention implementation {impl!r} is not supported (flash_attention_2/3, sdpa, eager)")


def sliding_window(config) -> tuple[int | None, bool]:
    """(the window of a model's sliding-window attention layers, whether every layer slides); (None, False)
    where none slides. `layer_types` names each layer's kind where the model mixes them (Gemma 2/3); a model
    without it that sets `sliding_window` slides in every layer (Mistral, Phi-3)."""
    window, types = getattr(config, "sliding_window", None), getattr(config, "layer_types", None)
    if not window or (types is not None and "sliding_attention" not in types):
        return None, False
    return int(window), types is None or set(types) == {"sliding_attention"}


def block_causal_mask(sample_index: Tensor, dtype: torch.dtype | None = None, *, position_ids: Tensor | None = None,
                      window: int | None = None) -> Tensor:
    """(P, 1, W, W): query i may attend key j iff j <= i and both lie in the same sample (or both in
    the row's padding tail), and with a `window`, j lies within the last `window` positions of i
    (transformers' rule: pos_i - pos_j < window). Boolean (True: attend) when `dtype` is None, else
    additive 0 / min."""
    w = sample_index.shape[1]
    causal = torch.ones(w, w, dtype=torch.bool, device=sample_index.device).tril()
    allowed = (sample_index.unsqueeze(2) == sample_index.unsqueeze(1)) & causal
    if window is not None:
        allowed &= (position_ids.unsqueeze(2) - position_ids.unsqueeze(1)) < window
    allowed = allowed.unsqueeze(1)
    if dtype is None:
        return allowed
    zero = torch.zeros((), dtype=dtype, device=sample_index.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def segment_starts(sample_index: Tensor) -> Tensor:
    """Flat (P * W) indices where a segment (a sample, or a row's padding tail) begins: (S,) long."""
    p, w = sample_index.shape
    new = torch.ones_like(sample_index, dtype=torch.bool)
    new[:, 1:] = sample_index[:, 1:] != sample_index[:, :-1]
    return new.reshape(p * w).nonzero().flatten()


def varlen_kwargs(sample_index: Tensor) -> dict:
    """Varlen flash attention's arguments over the flattened (P * W) tokens: cu_seq_lens_q/k (S + 1,)
    int32 and max_length_q/k (the longest segment)."""
    starts = segment_starts(sample_index)
    total = torch.tensor([sample_index.numel()], device=starts.device)
    cu = torch.cat([starts, total]).to(torch.int32)
    longest = int(cu.diff().max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def model_inputs(model, packed: dict[str, Tensor]) -> dict:
    """The keyword arguments of a packed forward: input_ids and position_ids, plus the 4-D mask
    (sdpa, eager) or the varlen arguments (flash attention, whose layers apply their own window).
    transformers takes a 4-D mask as it is, in sliding-window layers too: those get the mask with the
    window (`sliding_window`), by layer kind where the model mixes them."""
    kind = attention_kind(model)
    inputs = {"input_ids": packed["input_ids"], "position_ids": packed["position_ids"]}
    if kind == "varlen":
        return inputs | varlen_kwargs(packed["sample_index"])
    module = getattr(model, "module", model)
    dtype = None if kind == "sdpa" else module.dtype
    window, everywhere = sliding_window(text_config(module))
    block = block_causal_mask(packed["sample_index"], dtype)
    if window is None:
        return inputs | {"attention_mask": block}
    windowed = block_causal_mask(packed["sample_index"], dtype, position_ids=packed["position_ids"], window=window)
    return inputs | {"attention_mask": windowed if everywhere else
                     {"full_attention": block, "sliding_attention": windowed}}
