"""Token log-probabilities with logits only where they are used.

A causal LM's output layer over every position of a batch makes a
(B, L, V) fp32 tensor (about 120 MB for 256 sequences of 58 tokens at a
vocabulary of 2048, and far more at real vocabularies), and its backward
keeps another of the same size. Objectives here need log-probabilities at
a few positions only (the response tokens, or SFT's loss tokens), so:

  1. the model runs once for its final hidden states (the output layer on a
     single position, where the model accepts `logits_to_keep`);
  2. the hidden states of the wanted positions are gathered: (N, H);
  3. the output layer and log-softmax run over them in chunks of at most
     `CHUNK_ELEMENTS` logits; with gradients, each chunk is recomputed in the
     backward pass (activation checkpointing), so only one chunk's logits
     exist at any time, unless all of a call's logits together stay within
     `KEEP_ELEMENTS` (small vocabularies), where keeping them is cheaper.

The forward still goes through the (DeepSpeed) engine and the output layer
is called as a module, so ZeRO-3's parameter hooks see both. Each call of a
module whose weights ZeRO-3 partitions gathers them from every rank, so all
ranks must make as many calls: under ZeRO-3 on several ranks the chunk count
(and recomputation) follows the rank with the most positions, its extra
chunks empty elsewhere, and shared-prefix forwards run only where every rank
can (`most_over_ranks`). Training, the reference scorer and evaluation all
take this path.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from algos.sequence import neftune_noise
from engines.models import hf_module, last_hidden, text_config
from engines.train import shared_prefix


# Logits per chunk: 16 MiB in fp32. Chunks of this size stay below the sizes glibc
# serves with mmap (whose pages are unmapped again on every free) and keep a
# 150k-vocabulary model's chunk at ~27 positions.
CHUNK_ELEMENTS = 2**22
# Logits of one call kept for backward rather than recomputed when there are at most this many: 64 MiB
# in fp32 (a 2048-entry vocabulary's 8192 positions; ~110 positions of a 150k vocabulary, so real
# vocabularies recompute). Recomputing costs another output-layer forward: keeping made a policy update of
# the bench's work 6 % faster.
KEEP_ELEMENTS = 2**24


def most_over_ranks(value: int, module, device) -> int:
    """`value`; under ZeRO-3 on several ranks (`module`'s weights partitioned), the largest of the
    ranks' values, all-reduced on `device` (the computation's: nccl reduces CUDA tensors only). Ranks
    that size their module calls by it call in step: fewer calls of a partitioned module on one rank
    crash the group or hang it (tests/engines/train/test_train_trainer.py)."""
    import torch.distributed as dist

    param = next(module.parameters(), None)
    if getattr(param, "ds_id", None) is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    out = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return int(out.item())


def unwrap(model):
    """The HF module under a DeepSpeed engine (calls still go through its hooks)."""
    return getattr(model, "module", model)


@functools.lru_cache(maxsize=None)
def _accepts_logits_to_keep(cls: type) -> bool:
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


def keep_last_logits(model) -> dict[str, int]:
    """`logits_to_keep=1` where the HF model under the engine (and under a peft wrapper, which passes
    it on) accepts it; otherwise nothing."""
    return {"logits_to_keep": 1} if _accepts_logits_to_keep(type(hf_module(model))) else {}


class _TransformedHead(torch.nn.Module):
    """An output layer and what the model's forward does to its logits after it: z = softcap(W h · scale)."""

    def __init__(self, linear: torch.nn.Module, scale: float, softcap: float | None):
        super().__init__()
        self.linear, self.scale, self.softcap = linear, scale, softcap

    def forward(self, hidden: Tensor) -> Tensor:
        logits = self.linear(hidden).float()
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def output_head(module) -> torch.nn.Module:
    """The output layer of an HF causal LM as its forward applies it: with Granite's division by
    `logits_scaling`, Cohere's `logit_scale` and Gemma 2/3's `final_logit_softcapping` (z = c · tanh(z / c)),
    which the models apply after the layer (and vLLM does too). Called as a module, so ZeRO-3's hooks on the
    layer still gather it; the layer itself where the model has no such step."""
    linear = module.get_output_embeddings()
    cfg = text_config(module)
    scale = 1.0 / (getattr(cfg, "logits_scaling", None) or 1.0) * (getattr(cfg, "logit_scale", None) or 1.0)
    softcap = getattr(cfg, "final_logit_softcapping", None)
    return linear if scale == 1.0 and not softcap else _TransformedHead(linear, scale, softcap)


def final_hidden(model, batch: dict[str, Tensor]) -> Tensor:
    """The last layer's (normed) hidden state at every position: (B, L, H). The output layer runs on
    the last position only where the model supports it (otherwise on all, and is discarded)."""
    return last_hidden(model, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       **keep_last_logits(model))


def _chunk(head, hidden: Tensor, targets: Tensor, with_entropy: bool, temperature: float = 1.0) -> tuple[Tensor, ...]:
    """targets (n,): log p(y) = z_y − lse(z); H = lse(z) − Σ_v p_v z_v with p = exp(z − lse) (finite
    logits: an output layer's), in four passes over the logits where log-softmax-based entropy takes seven.
    targets (n, K), K tokens a position (a teacher's top-k): log_softmax(z) at each, no entropy.
    z = head(hidden) / τ: the distribution a sampler at temperature τ draws from."""
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    if targets.dim() == 2:  # log-softmax's rounding, as the one-piece objective had
        return (torch.log_softmax(logits, dim=-1).gather(-1, targets),)
    lse = torch.logsumexp(logits, dim=-1)
    logprobs = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return (logprobs,)
    p = torch.exp(logits - lse.unsqueeze(-1))
    return logprobs, lse - (p * logits).sum(-1)


def logprobs_from_hidden(head, hidden: Tensor, targets: Tensor, vocab_size: int, *,
                         with_entropy: bool = False, temperature: float = 1.0) -> tuple[Tensor, Tensor | None]:
    """log p(targets_n | hidden_n) = z_n[targets_n] − logsumexp(z_n), z_n = head(hidden_n) / temperature in
    fp32, and, when `with_entropy`, H_n = −Σ_v p_v log p_v. Chunks of `CHUNK_ELEMENTS // vocab_size`
    rows; each chunk recomputed in backward when gradients flow and N x vocab_size > KEEP_ELEMENTS.

    hidden: (N, H); targets: (N,) long → (N,) float32, and (N,) float32 or None. targets (N, K) (K
    tokens at each position, e.g. a teacher's top-k) → (N, K) log-probabilities.
    """
    if with_entropy and targets.dim() == 2:
        raise ValueError("logprobs_from_hidden: entropy is per position, with one target token each (targets (N,))")
    size = max(1, CHUNK_ELEMENTS // vocab_size)
    n = most_over_ranks(hidden.shape[0], head, hidden.device)  # ZeRO-3: as many head calls on every rank
    recompute = torch.is_grad_enabled() and hidden.requires_grad and n * vocab_size > KEEP_ELEMENTS
    parts = []
    # Past this rank's positions a chunk is empty; with none at all, one empty chunk: the result still
    # hangs from the output layer, so a loss over no tokens is 0 with a (zero) gradient, not an error.
    for i in range(0, max(n, 1), size):
        h, y = hidden[i : i + size], targets[i : i + size]
        parts.append(checkpoint(_chunk, head, h, y, with_entropy, temperature, use_reentrant=False) if recompute
                     else _chunk(head, h, y, with_entropy, temperature))
    logprobs = torch.cat([p[0] for p in parts])
    return logprobs, (torch.cat([p[1] for p in parts]) if with_entropy else None)


def logprobs_at(model, batch: dict[str, Tensor], rows: Tensor, positions: Tensor, *,
                with_entropy: bool = False, temperature: float = 1.0) -> tuple[Tensor, Tensor | None]:
    """Next-token log-probabilities (and entropies) at (rows, positions): the token at position p + 1
    predicted from the hidden state at p, at `temperature`. rows, positions: (N,) long → (N,) float32 each."""
    hidden = final_hidden(model, batch)[rows, positions]
    targets = batch["input_ids"][rows, positions + 1]
    module = unwrap(model)
    return logprobs_from_hidden(output_head(module), hidden, targets, module.config.vocab_size,
                                with_entropy=with_entropy, temperature=temperature)


def scatter(values: Tensor, rows: Tensor, cols: Tensor, shape: tuple[int, int]) -> Tensor:
    """(N,) values placed at (rows, cols) of a zero (B, T) tensor; differentiable in `values`."""
    return values.new_zeros(shape).index_put((rows, cols), values)


def response_logprobs_and_entropy(model, batch: dict[str, Tensor], *, with_entropy: bool = False,
                                  temperature: float = 1.0) -> tuple[Tensor, Tensor | None]:
    """log π(a_t | s_t) of each response token, and its entropy when asked: (B, T) each, 0 on padding.
    π at `temperature` (logits / τ): an RL round's log-probs are of the distribution its sampler draws from
    (`GenerationConfig.logprob_temperature`), as the engines report theirs.
    Only the real response tokens (action_mask) get logits. Groups of rows with one prompt run
    that prompt once (engines/train/shared_prefix.py) where the batch and model allow it."""
    mask = batch["action_mask"]
    plan = shared_prefix.plan(batch) if shared_prefix.supported(model) else None
    if most_over_ranks(int(plan is None), unwrap(model), mask.device):  # ZeRO-3: one path on every rank
        plan = None
    if plan is None:
        rows, t = (mask > 0).nonzero(as_tuple=True)
        positions = batch["response_index"][rows, t]
        logprobs, entropy = logprobs_at(model, batch, rows, positions, with_entropy=with_entropy,
                                        temperature=temperature)
    else:
        hidden = shared_prefix.response_hidden(model, batch, plan, **keep_last_logits(model))
        r, t = (mask[plan.rows] > 0).nonzero(as_tuple=True)
        rows = plan.rows[r]
        module = unwrap(model)
        logprobs, entropy = logprobs_from_hidden(
            output_head(module), hidden[r, t], batch["input_ids"][rows, batch["response_index"][rows, t] + 1],
            module.config.vocab_size, with_entropy=with_entropy, temperature=temperature)
    shape = tuple(mask.shape)
    return scatter(logprobs, rows, t, shape), (scatter(entropy, rows, t, shape) if with_entropy else None)


def masked_next_token_logprobs(model, batch: dict[str, Tensor], loss_mask: Tensor) -> Tensor:
    """Next-token log-probabilities where `loss_mask` (over input_ids, (B, L)) is 1: (B, L-1),
    aligned with input_ids[:, 1:] as `algos.sequence.shifted_logprobs`, 0 elsewhere."""
    rows, targets = (loss_mask[:, 1:] > 0).nonzero(as_tuple=True)
    logprobs, _ = logprobs_at(model, batch, rows, targets)
    return scatter(logprobs, rows, targets, (loss_mask.shape[0], loss_mask.shape[1] - 1))


def token_lengths(batch: dict[str, Tensor]) -> Tensor:
    """Each position's sequence length: its sample's token count, 0 on padding: (B, L) long. A packed batch
    (`sample_index`, -1 on padding) counts each sample's tokens in its row; a padded one its row's
    attention_mask."""
    if "sample_index" in batch:
        index = batch["sample_index"]
        real = index >= 0
        counts = torch.bincount(index[real], minlength=1)
        return torch.where(real, counts[index.clamp(min=0)], 0)
    mask = batch["attention_mask"].long()
    return mask.sum(dim=1, keepdim=True) * mask


@contextlib.contextmanager
def embedding_noise(model, alpha: float | None, batch: dict[str, Tensor]):
    """NEFTune's noise (algos.sequence.neftune_noise, from torch's global generator, which the trainer seeds and
    checkpoints) on the input embeddings of every forward of `batch` inside, each position at its sequence's
    length (token_lengths); nothing, and no lengths taken, where `alpha` is None. The forward-hook is removed
    on leaving."""
    if alpha is None:
        yield
        return
    lengths = token_lengths(batch)

    def noisy(module, args, output: Tensor) -> Tensor:
        if output.shape[:-1] != lengths.shape:
            raise RuntimeError(f"NEFTune: embeddings of shape {tuple(output.shape)} for lengths of shape "
                               f"{tuple(lengths.shape)}")
        return neftune_noise(output, lengths.to(output.device), alpha)

    handle = unwrap(model).get_input_embeddings().register_forward_hook(noisy)
    try:
        yield
    finally:
        handle.remove()
