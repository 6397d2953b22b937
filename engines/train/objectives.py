"""Objectives handed to the training engine: (model, batch) -> (loss, metrics).

The engine runs whatever objective it is given; these adapt model outputs to
the pure losses in `algos`. They are module-level functions (or partials of
them) so that Ray can ship them to the workers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from algos.losses.distill import topk_forward_kl
from algos.losses.surrogates.cispo import cispo_policy_loss
from algos.losses.surrogates.gmpo import gmpo_policy_loss
from algos.losses.surrogates.gspo import gspo_policy_loss
from algos.losses.surrogates.sapo import sapo_policy_loss
from algos.losses.surrogates.vanilla import vanilla_policy_loss
from algos.losses.policy import ppo_policy_loss
from algos.losses.preference import pairwise_reward_loss
from algos.sequence import SFT_LOSSES, sft_loss
from engines.models import last_hidden
from engines.train.logits import (embedding_noise, final_hidden, logprobs_from_hidden, masked_next_token_logprobs,
                                  output_head, response_logprobs_and_entropy, unwrap)


def causal_lm_objective(model, batch: dict[str, torch.Tensor], *, loss: str = "nll",
                        neftune_alpha: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """SFT: `loss` (algos.sequence.SFT_LOSSES: nll, or dft) on response tokens only (loss_mask is over input_ids;
    logits only there), with NEFTune's noise on the input embeddings where `neftune_alpha` is given. Metrics:
    loss, nll (where the loss is another), response_length (response tokens per row, as (sum, count):
    engines/accumulate.py add_metrics)."""
    with embedding_noise(model, neftune_alpha, batch):
        logprobs = masked_next_token_logprobs(model, batch, batch["loss_mask"])
    mask = batch["loss_mask"][:, 1:]
    value = SFT_LOSSES[loss](logprobs, mask)
    nll = {"nll": sft_loss(logprobs.detach(), mask)} if loss != "nll" else {}
    return value, {"loss": value.detach(), **nll, "response_length": (mask.sum().float(), float(mask.shape[0]))}


TOPK_POSITIONS_PER_HEAD_CALL = 1024  # the teacher's output layer's rows at once: (rows, vocabulary) float32 logits


def loss_columns(loss_mask: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """The response positions of each row in order: (B, W) int64, column j of row b the next-token position
    (loss_mask over input_ids, next-token layout) of b's j-th loss token, -1 past its last. W is `width`,
    or the most loss tokens any row has. A teacher's top-k is kept in this layout: one column per loss
    token instead of one per position of the split's padded width."""
    mask = loss_mask[:, 1:] > 0
    most = int(mask.sum(1).max()) if mask.numel() else 0
    width = most if width is None else width
    if width < most:
        raise ValueError(f"loss_columns: a row has {most} loss tokens, more than the width {width}")
    out = torch.full((mask.shape[0], width), -1, dtype=torch.long, device=mask.device)
    rows, positions = mask.nonzero(as_tuple=True)
    out[rows, mask.long().cumsum(1)[rows, positions] - 1] = positions
    return out


def _columns_hidden(model, batch: dict[str, torch.Tensor], columns: torch.Tensor):
    """(rows, cols, hidden (N, H), head): the last hidden state at each response position a `columns`
    entry (loss_columns' layout) names and loss_mask still marks, and the output layer to apply to it."""
    mask = batch["loss_mask"][:, 1:] > 0
    at = columns.clamp(min=0)
    rows, cols = ((columns >= 0) & mask.gather(1, at)).nonzero(as_tuple=True)
    hidden = final_hidden(model, batch)[rows, at[rows, cols]]
    return rows, cols, hidden, output_head(unwrap(model))


@torch.no_grad()
def topk_next_tokens(model, batch: dict[str, torch.Tensor], *, k: int, width: int) -> torch.Tensor:
    """A teacher's k most likely next tokens at each response position, in `loss_columns(loss_mask,
    width)`'s layout: (B, width, k, 2), [..., 0] their log-probs and [..., 1] their ids (as floats: exact
    below 2^24), zeros past a row's last response token; what topk_distill_objective's batch carries as
    teacher_logprobs / teacher_ids. `width` is the split's (micro-batches are joined along rows)."""
    rows, cols, hidden, head = _columns_hidden(model, batch, loss_columns(batch["loss_mask"], width))
    out = torch.zeros(batch["input_ids"].shape[0], width, k, 2, device=hidden.device)
    for i in range(0, len(rows), TOPK_POSITIONS_PER_HEAD_CALL):
        part = slice(i, i + TOPK_POSITIONS_PER_HEAD_CALL)
        top = torch.log_softmax(head(hidden[part]).float(), dim=-1).topk(k, dim=-1)
        out[rows[part], cols[part]] = torch.stack([top.values, top.indices.float()], dim=-1)
    return out


def topk_distill_objective(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    """Offline distillation: at each response position (loss_mask over input_ids), `algos.topk_forward_kl`
    from the teacher's top-k to the student's log-softmax over its whole vocabulary, averaged over the
    response tokens. The teacher's top-k is in `loss_columns`' layout: batch["teacher_ids"] (int) and
    batch["teacher_logprobs"] (B, W, K), batch["teacher_positions"] (B, W) the position of each column, as
    topk_next_tokens and loss_columns give them; a column whose position loss_mask no longer marks is left
    out. The output layer runs on the response positions alone. Metrics: loss, response_length."""
    mask = batch["loss_mask"][:, 1:] > 0
    rows, cols, hidden, head = _columns_hidden(model, batch, batch["teacher_positions"])
    # The output layer in chunks (engines/train/logits.py), as every other objective: at a real vocabulary
    # the whole micro-batch's log-softmax would be gigabytes on the GPU, with its backward's copy.
    student, _ = logprobs_from_hidden(head, hidden, batch["teacher_ids"][rows, cols].long(),
                                      unwrap(model).config.vocab_size)
    kl = topk_forward_kl(student, batch["teacher_logprobs"][rows, cols])
    loss = kl.sum() / max(len(kl), 1)
    return loss, {"loss": loss.detach(), "response_length": (mask.sum().float(), float(mask.shape[0]))}


# ---- What each objective averages over: the `weigh` of TrainerGroup.train_step. A step taken in
# micro-batches, on several ranks, is then the step on the whole batch at once (accumulate.loss_scales).


def per_row(batch: dict[str, torch.Tensor]) -> float:
    """For means over rows or pairs (reward model, DPO, KTO): the rows."""
    return float(batch["input_ids"].shape[0])


def response_tokens(batch: dict[str, torch.Tensor]) -> float:
    """For `causal_lm_objective`'s token mean (plain or packed): the response tokens."""
    return float(batch["loss_mask"][:, 1:].sum())


def aggregated(batch: dict[str, torch.Tensor], *, agg: str) -> float:
    """For the policy and value objectives under the loss aggregation `agg` (`algos.aggregate_weight`)."""
    from algos import aggregate_weight

    return float(aggregate_weight(batch["action_mask"], agg=agg))


def scalar_scores(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sequence scores of a reward model / critic head at each row's last attended token: (B,) float32.

    The last token under `attention_mask`, a response's EOS included. transformers'
    …ForSequenceClassification pools at the last token that is not the pad id instead, which skips a
    real EOS wherever pad == eos (`models.load_tokenizer`'s choice for tokenizers without a pad token,
    Llama's and Qwen2.5 base's among them): a finished response then scores as if it were cut. A
    head not named `score` keeps transformers' pooling.

    The one scoring function: training objectives, the scorer actor and
    in-process evaluation all call it."""
    head = getattr(unwrap(model), "score", None)
    if head is None:
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     use_cache=False).logits.squeeze(-1).float()
    hidden = final_hidden(model, batch)
    mask = batch["attention_mask"]
    last = (torch.arange(mask.shape[1], device=mask.device) * mask).argmax(-1)
    return head(hidden[torch.arange(hidden.shape[0], device=hidden.device), last]).squeeze(-1).float()


def pairwise_objective(model, batch: dict[str, torch.Tensor], margin: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Bradley-Terry on a batch whose first half is chosen, second half rejected."""
    scores = scalar_scores(model, batch)
    n = scores.shape[0] // 2
    margins = torch.full((n,), margin, device=scores.device) if margin else None
    out = pairwise_reward_loss(scores[:n], scores[n:], margin=margins)
    return out.loss, {
        "loss": out.loss.detach(),
        "accuracy": out.accuracy.detach(),
        "reward_margin": out.reward_margin.detach(),
    }


# ---- RL -------------------------------------------------------------------------
# Batches for RL carry full sequences plus `response_index` (B, T): for the
# t-th response token, its position in the next-token (shifted, L-1)
# layout. Response tensors are then (B, T) with `action_mask`.


def _response(full: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    picked = torch.gather(full, 1, batch["response_index"])
    return picked * batch["action_mask"].to(picked.dtype)


def response_logprobs(model, batch: dict[str, torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
    """log π(a_t | s_t) of each response token at `temperature`: (B, T), 0 on padding (engines/train/logits.py)."""
    return response_logprobs_and_entropy(model, batch, temperature=temperature)[0]


def token_values(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Critic values V(s_t) before each response token: (B, T), 0 on padding.

    A scalar-head model (…ForSequenceClassification) applied per position:
    its head on the final hidden state of every token. The forward goes
    through the (DeepSpeed) engine, whose hooks ZeRO's backward relies on.
    """
    hidden = last_hidden(model, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    values = unwrap(model).score(hidden).squeeze(-1).float()[:, :-1]
    return _response(values, batch)


def _token_pair(mean: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A token mean of algos (over the batch's valid tokens) as the (sum, count) of accumulate.add_metrics, left on
    the device (read once per step, not here)."""
    return mean.detach() * tokens, tokens


def policy_objective(
    model, batch: dict[str, torch.Tensor], *, clip_low: float | None, clip_high: float | None,
    dual_clip: float | None, agg: str, entropy_coef: float, kl_loss_coef: float, kl_estimator: str,
    kl_clamp: float | None, tis_cap: float | None, tis_low: float | None = None, tis_mode: str = "truncate",
    tis_level: str = "token", tis_veto: float | None = None, on_policy: bool = False,
    surrogate: Callable = ppo_policy_loss,
    loss_scale_constant: float | None = None, temperature: float = 1.0, entropy_fraction: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate (+ entropy bonus, + GRPO-style KL loss when kl_loss_coef > 0).

        loss = surrogate(logprobs, old_logprobs, advantages; clip_low, clip_high, dual_clip, TIS)
               - entropy_coef * H  + kl_loss_coef * agg(kl_estimate(logprobs, ref_logprobs))

    `surrogate`: `algos.ppo_policy_loss` (token ratios) or another of `algos`' surrogates (`SURROGATES`); a clip
    argument that is None is not passed (SAPO's gate and KL-Cov have no clip; PPO's dual clip is off).
    TIS: with `tis_cap`, the rollout engine's logprobs weight each token
    (`tis_mode` "truncate": min(ratio, tis_cap); "mask": IcePop, 0 outside [tis_low, tis_cap]), one ratio per
    token or per response (`tis_level` "sequence", "geometric"); `tis_veto` drops a response with a token's ratio
    below it.
    `on_policy`: the batch serves exactly one optimizer step, so the policy that made the
    experience is the one in this forward: old_logprobs = logprobs.detach() (ratio 1), and the
    batch needs none. Metrics: policy_loss (the surrogate alone), kl_loss (the KL term, 0 when
    off), kl_to_reference (the estimator's token mean), sequence_kl (Σ_t of the k1 estimate of
    this forward against the reference, the row mean), entropy, clip_fraction, approx_kl;
    with TIS, tis_weight_mean and tis_masked_fraction (share of tokens masked out). The token
    means computed here and the row mean come as (sum, count) pairs (engines/accumulate.py add_metrics).
    `loss_scale_constant`: C of `agg="seq_mean_token_sum_norm"` (Dr. GRPO: the generation budget, so
    the scale does not follow the step's longest response); None: the batch's padded response width.
    `entropy_fraction`: the surrogate's per-token loss is kept on that share of the micro-batch's tokens alone, those
    of highest entropy (`algos.high_entropy_tokens`, the 80/20 rule), and reduced over every token as before, as
    the paper's indicator inside DAPO's sum; the KL and entropy terms keep every token. Logged as
    pg_token_fraction.
    `temperature`: the sampler's (`GenerationConfig.logprob_temperature`); every log-prob here, the entropy too, is of
    π at it, as the batch's old, reference and rollout log-probs are.
    """
    from algos import aggregate_loss, entropy_bonus_loss, high_entropy_tokens, kl_estimate, masked_sum, sequence_k1

    mask = batch["action_mask"]
    logprobs, entropy = response_logprobs_and_entropy(model, batch, with_entropy=True, temperature=temperature)
    if on_policy:
        old = logprobs.detach()
    elif "old_logprobs" in batch:
        old = batch["old_logprobs"]
    else:
        raise ValueError("a batch for more than one optimizer step needs old_logprobs")
    clip = {k: v for k, v in dict(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip).items()
            if v is not None}
    out = surrogate(
        logprobs, old, batch["advantages"], mask, **clip, agg=agg,
        rollout_logprobs=batch["rollout_logprobs"] if tis_cap else None, tis_cap=tis_cap, tis_low=tis_low,
        tis_mode=tis_mode, tis_level=tis_level, tis_veto=tis_veto, loss_scale_constant=loss_scale_constant,
    )
    policy, tokens = out.loss, mask.sum().float()
    if entropy_fraction is not None:  # the indicator inside the sum: the same denominators, fewer terms
        trained = high_entropy_tokens(entropy, mask, entropy_fraction)
        policy = aggregate_loss(out.token_loss * trained, mask, agg=agg, loss_scale_constant=loss_scale_constant)
    loss = policy
    if entropy_coef:
        loss = loss + entropy_bonus_loss(entropy, mask, entropy_coef=entropy_coef, agg=agg,
                                         loss_scale_constant=loss_scale_constant)
    # Token and row means as (sum, count): exact over micro-batches (accumulate.add_metrics). Tensors left on the
    # device: reading them here would make the host wait for the forward before it could queue the backward.
    metrics = {
        "policy_loss": policy.detach(), "clip_fraction": _token_pair(out.clip_fraction, tokens),
        "approx_kl": _token_pair(out.approx_kl, tokens), "entropy": (masked_sum(entropy.detach(), mask), tokens),
    }
    if entropy_fraction is not None:
        metrics["pg_token_fraction"] = (trained.sum().float(), tokens)
    if tis_cap:
        metrics.update(tis_weight_mean=_token_pair(out.tis_weight_mean, tokens),
                       tis_masked_fraction=_token_pair(out.tis_masked_fraction, tokens))
    if out.cov_fraction is not None:  # Clip-Cov / KL-Cov: the share of tokens they acted on
        metrics["cov_fraction"] = _token_pair(out.cov_fraction, tokens)
    if "ref_logprobs" in batch:  # algorithms without a reference (no KL term) have none
        kl = kl_estimate(logprobs, batch["ref_logprobs"], kind=kl_estimator, clamp=kl_clamp)
        kl_loss = kl_loss_coef * aggregate_loss(kl, mask, agg=agg, loss_scale_constant=loss_scale_constant)
        if kl_loss_coef:
            loss = loss + kl_loss
        k1 = sequence_k1(logprobs.detach(), batch["ref_logprobs"], mask)
        metrics.update(kl_to_reference=(masked_sum(kl.detach(), mask), tokens), kl_loss=kl_loss.detach(),
                       sequence_kl=(k1.sum(), float(len(k1))))
    elif kl_loss_coef:
        raise ValueError("a KL loss needs ref_logprobs in the batch")
    return loss, metrics


# The policy surrogates by `AlgorithmSpec.policy_loss`, for `policy_objective(surrogate=...)`; each takes the
# keyword arguments of `algos.ppo_policy_loss` (sapo_gate its two temperatures for the clip's).
SURROGATES = {"ppo_clip": ppo_policy_loss, "gspo_clip": gspo_policy_loss, "cispo": cispo_policy_loss,
              "gmpo_clip": gmpo_policy_loss, "sapo_gate": sapo_policy_loss, "vanilla": vanilla_policy_loss}


def value_objective(model, batch: dict[str, torch.Tensor], *, clip_eps: float | None, agg: str,
                    loss_scale_constant: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value regression toward the returns (`loss_scale_constant` as in `policy_objective`)."""
    from algos import value_loss

    values = token_values(model, batch)
    out = value_loss(values, batch["values"], batch["returns"], batch["action_mask"], clip_eps=clip_eps, agg=agg,
                     loss_scale_constant=loss_scale_constant)
    return out.loss, {"value_loss": out.loss.detach(),
                      "value_clip_fraction": _token_pair(out.clip_fraction, batch["action_mask"].sum().float())}
