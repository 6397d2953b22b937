"""Preference data as token tensors, and the objectives of the preference stage (DPO's family, KTO, SimPO, ORPO).

A preference split of N pairs (and M unpaired KTO examples, after them)
becomes two batches of 2N (+ M) right-padded rows each, laid out
[chosen_0..chosen_{N-1}, rejected_0..rejected_{N-1}, unpaired...]:

    main  prompt_k + chosen_k       /  prompt_k + rejected_k
    kl    prompt_k + chosen_j       /  prompt_k + rejected_j         (j: the next pair, mod N, of another prompt)

with `loss_mask` over input_ids on the response tokens (EOS included). DPO
trains on `main` as pairs; KTO takes its 2N rows as examples (chosen:
desirable, rejected: undesirable) and estimates its reference point
z0 = KL(π ‖ π_ref) on the mismatched `kl` rows of the whole step (every
micro-batch and rank: KTOObjective.prepare), as Ethayarajh et al. 2024 do.
The reference's sequence log-probabilities of both batches are computed once
per dataset (the `preference_reference` stage) and ride along as `ref_logps`
and `ref_kl_logps`. SimPO and ORPO train on `main` as pairs with no reference,
on each response's mean token log-probability.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from algos.losses.dpo import dpo_loss
from algos.losses.preference import kto_loss, orpo_loss, sequence_logprobs, simpo_loss
from engines.batches import LengthReport, encode_response, filter_prompts, pad_right, right_padded
from engines.train.logits import masked_next_token_logprobs, response_logprobs_and_entropy


def _rows(seqs: list[list[int]], prompt_lens: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    masks = [[0] * n + [1] * (len(s) - n) for s, n in zip(seqs, prompt_lens)]
    return {**right_padded(seqs, pad_id), "loss_mask": pad_right(masks, 0)}


@dataclass(frozen=True)
class PreferenceRows:
    """The preference split as rows: `main` and `kl` (2N + M rows each: the N pairs' chosen rows, their
    rejected rows, then the M unpaired examples), `desirable` (2N + M,) bool, and what was left out."""

    main: dict[str, torch.Tensor]
    kl: dict[str, torch.Tensor]
    pairs: int
    desirable: torch.Tensor
    reports: dict[str, LengthReport]  # split -> its prompt-length report
    kl_own_prompt: int = 0  # `kl` rows whose response answers their own prompt (every row has one prompt)

    def metrics(self) -> dict[str, float]:
        return {"preference/kl_rows_own_prompt": float(self.kl_own_prompt),
                **{k: v for split, r in self.reports.items() for k, v in r.as_metrics(split).items()}}


def mismatched(prompts: list[list[int]]) -> list[int]:
    """For each row k, the row whose response its `kl` row takes: the next row (mod n) whose prompt differs
    from row k's, so that KTO's z0 is the KL on completions of other prompts, as Ethayarajh et al. 2024
    estimate it. Pairs made into unpaired rows, and HH's several pairs per prompt, sit side by side: the next
    row alone would answer row k's own prompt. Where every row has one prompt, the next row (k + 1 mod n).
    O(n): the next different prompt after k is the first row past k's run of equal prompts (wrapping)."""
    n = len(prompts)
    keys = [tuple(p) for p in prompts]
    if len(set(keys)) <= 1:
        return [(k + 1) % n for k in range(n)]
    out, nearest = [0] * n, None
    for i in reversed(range(2 * n - 1)):  # twice round, for the rows whose run reaches the end
        if keys[(i + 1) % n] != keys[i % n]:
            nearest = (i + 1) % n
        if i < n:
            out[i] = nearest
    return out


def preference_tensors(tokenizer, records: list[dict], max_prompt_tokens: int, max_response_tokens: int,
                       unpaired: list[dict] = ()) -> PreferenceRows:
    """The rows of the module docstring, with the unpaired examples (KTO: prompt, response, label) after
    the pairs; their `kl` rows pair prompt j with the response of the next unpaired row of another prompt.

    Prompts over `max_prompt_tokens` are left out and counted (engines/batches.filter_prompts), the
    same way for the reference stage and the training stage, so their rows line up."""
    kept, report = filter_prompts(tokenizer, records, max_prompt_tokens, "preference") if records else ([], None)
    singles, single_report = (filter_prompts(tokenizer, list(unpaired), max_prompt_tokens, "preference_unpaired")
                              if unpaired else ([], None))
    prompts, main, kl, own = [], [], [], 0
    partners = mismatched([ids for ids, _ in kept]), mismatched([ids for ids, _ in singles])
    for rows, sides, partner in ((kept, ("chosen", "rejected"), partners[0]), (singles, ("response",), partners[1])):
        own += len(sides) * sum(rows[j][0] == ids for j, (ids, _) in zip(partner, rows))
        for side in sides:
            replies = [encode_response(tokenizer, r[side], max_response_tokens) for _, r in rows]
            for k, (ids, _) in enumerate(rows):
                prompts.append(ids)
                main.append(ids + replies[k])
                kl.append(ids + replies[partner[k]])
    n = len(kept)
    desirable = torch.tensor([True] * n + [False] * n + [r["label"] for _, r in singles], dtype=torch.bool)
    lens, pad = [len(p) for p in prompts], tokenizer.pad_token_id
    return PreferenceRows(main=_rows(main, lens, pad), kl=_rows(kl, lens, pad), pairs=n, desirable=desirable,
                          reports={name: r for name, r in (("preference", report),
                                                           ("preference_unpaired", single_report)) if r},
                          kl_own_prompt=own)


def sequence_logps(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """log π(y | x) = Σ_t loss_mask_t · log π(token_t | tokens_<t): (B,) float32 (the DPO sequence
    log-likelihood, algos.losses.preference.sequence_logprobs over the next-token layout)."""
    mask = batch["loss_mask"][:, 1:]
    return sequence_logprobs(masked_next_token_logprobs(model, batch, batch["loss_mask"]), mask)


def response_logps(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """log π(y | x) of rollout rows (the RL layout: response_index, action_mask): Σ_t over the response
    tokens, (B,) float32. Online DPO's sequence log-likelihood."""
    return sequence_logprobs(response_logprobs_and_entropy(model, batch)[0], batch["action_mask"])


def _reward_metrics(out) -> dict[str, torch.Tensor]:
    """Left on the device: the worker reads a step's sums once (engines/accumulate.py host_metrics)."""
    return {"loss": out.loss.detach(), "accuracy": out.accuracy.detach(), "reward_margin": out.reward_margin.detach(),
            "chosen_reward": out.chosen_rewards.detach(), "rejected_reward": out.rejected_rewards.detach()}


def _logps(model, batch: dict[str, torch.Tensor], rollouts: bool,
           packing_max_tokens: int | None | bool) -> tuple[torch.Tensor, dict]:
    """Sequence log-likelihoods (B,) of rollout rows, data rows, or data rows packed (engines/train/packing.py);
    and, packed, how they packed (PackStats.as_metrics), else {}."""
    if rollouts:
        return response_logps(model, batch), {}
    if packing_max_tokens is False:
        return sequence_logps(model, batch), {}
    from engines.train.packed_objectives import packed_sequence_logps_and_stats

    logps, stats = packed_sequence_logps_and_stats(model, batch, max_tokens=packing_max_tokens)
    return logps, stats.as_metrics()


def dpo_objective(model, batch: dict[str, torch.Tensor], *, loss_type: str, beta: float, label_smoothing: float,
                  rollouts: bool = False, packing_max_tokens: int | None | bool = False, rpo_alpha: float = 0.0,
                  ) -> tuple[torch.Tensor, dict[str, float]]:
    """DPO and its family (algos.losses.dpo.dpo_loss) on a batch [chosen..., rejected...] with `ref_logps`:
    data rows (`loss_mask`), or with `rollouts` an online-DPO round's rollout rows (RL layout). `rpo_alpha` > 0
    adds the chosen responses' NLL per token (a response of no token counts 1), also logged as chosen_nll.

    Metrics: loss, accuracy (share of pairs whose implicit reward β(log π − log π_ref) ranks chosen
    first), reward_margin, chosen_reward, rejected_reward. `packing_max_tokens`: False, or pack each batch
    into rows of that many tokens (None: its padded width)."""
    logps, packing = _logps(model, batch, rollouts, packing_max_tokens)
    ref = batch["ref_logps"]
    n = logps.shape[0] // 2
    nll = None
    if rpo_alpha:
        tokens = batch["action_mask"].sum(-1) if rollouts else batch["loss_mask"][:, 1:].sum(-1)
        nll = -logps[:n] / tokens[:n].clamp(min=1).to(device=logps.device, dtype=logps.dtype)
    out = dpo_loss(logps[:n], logps[n:], ref[:n], ref[n:], beta=beta, loss_type=loss_type,
                   label_smoothing=label_smoothing, rpo_alpha=rpo_alpha, chosen_nll=nll)
    extra = {} if nll is None else {"chosen_nll": nll.detach().mean()}
    return out.loss, _reward_metrics(out) | packing | extra


def reference_free_objective(model, batch: dict[str, torch.Tensor], *, loss: str, beta: float, gamma: float,
                             packing_max_tokens: int | None | bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """SimPO or ORPO (algos.losses.preference.simpo_loss / orpo_loss, ORPO's λ = `beta`) on a batch [chosen...,
    rejected...] of data rows: each response's mean token log-probability, Σ_t loss_mask_t log π / Σ_t loss_mask_t
    over the next-token layout (a response of no token counts 1, so its mean is 0).

    Metrics: those of dpo_objective, the implicit rewards β ā."""
    logps, packing = _logps(model, batch, False, packing_max_tokens)
    tokens = batch["loss_mask"][:, 1:].sum(-1).clamp(min=1).to(device=logps.device, dtype=logps.dtype)
    avg = logps / tokens
    n = avg.shape[0] // 2
    if loss == "simpo":
        out = simpo_loss(avg[:n], avg[n:], beta=beta, gamma=gamma)
    elif loss == "orpo":
        out = orpo_loss(avg[:n], avg[n:], lam=beta)
    else:
        raise ValueError(f"unknown reference-free preference loss {loss!r}; valid: simpo, orpo")
    return out.loss, _reward_metrics(out) | packing


def kto_reference_point(model, micro_batches: list[dict[str, torch.Tensor]], device: torch.device | str, *,
                        packing_max_tokens: int | None | bool = False) -> torch.Tensor:
    """KTO's reference point z0 = mean_b (log π − log π_ref) over the mismatched `kl_*` rows of all
    `micro_batches` and of every rank of a training group (a sum and a count all-reduced), without
    gradient: () float32 on `device`, unclamped (kto_loss clamps it at 0)."""
    total = torch.zeros(2, dtype=torch.float64, device=device)
    with torch.no_grad():
        for micro in micro_batches:
            kl_rows = {k.removeprefix("kl_"): v.to(device) for k, v in micro.items() if k.startswith("kl_")}
            diff = (_logps(model, kl_rows, False, packing_max_tokens)[0] - micro["ref_kl_logps"].to(device)).double()
            total += torch.stack([diff.sum(), diff.new_tensor(float(diff.numel()))])
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(total)
    return (total[0] / total[1]).float()


def kto_objective(model, batch: dict[str, torch.Tensor], *, beta: float, desirable_weight: float,
                  undesirable_weight: float, packing_max_tokens: int | None | bool = False,
                  z0: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """KTO (algos.losses.preference.kto_loss) on examples with `desirable` (B,) bool and `ref_logps`, against
    the reference point `z0` (None: `kto_reference_point` of this batch alone)."""
    if z0 is None:
        z0 = kto_reference_point(model, [batch], batch["input_ids"].device, packing_max_tokens=packing_max_tokens)
    logps, packing = _logps(model, batch, False, packing_max_tokens)
    out = kto_loss(logps, batch["ref_logps"], batch["desirable"], z0, beta=beta,
                   desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)
    # A micro-batch may hold one kind of example only: the reward means come as (sum, count) pairs over the
    # examples of their kind (accumulate.add_metrics), and the margin from the step's means (KTOObjective.summarize).
    des = batch["desirable"].bool()
    rewards = beta * (logps - batch["ref_logps"]).detach()
    return out.loss, {"loss": out.loss.detach(), "accuracy": out.accuracy.detach(),
                      "chosen_reward": ((rewards * des).sum(), des.sum()),
                      "rejected_reward": ((rewards * ~des).sum(), (~des).sum()),
                      "kl_reference_point": out.kl.detach()} | packing


@dataclass(frozen=True)
class KTOObjective:
    """KTO as a training group runs it: `prepare` (called by each rank before its micro-batches, see
    engines/train/worker.py) takes z0 over the whole step, so micro-batch size and rank count leave the step
    as the whole batch's. Per micro-batch, z0 would be an estimate from a few rows that moves with them."""

    beta: float
    desirable_weight: float
    undesirable_weight: float
    packing_max_tokens: int | None | bool = False

    def prepare(self, model, micro_batches: list[dict[str, torch.Tensor]], device) -> dict[str, torch.Tensor]:
        return {"z0": kto_reference_point(model, micro_batches, device, packing_max_tokens=self.packing_max_tokens)}

    def summarize(self, metrics: dict[str, float]) -> dict[str, float]:
        """The step's metrics (engines/train/group.py), with the margin of its two reward means."""
        return metrics | {"reward_margin": metrics["chosen_reward"] - metrics["rejected_reward"]}

    def __call__(self, model, batch: dict[str, torch.Tensor], z0: torch.Tensor | None = None):
        return kto_objective(model, batch, beta=self.beta, desirable_weight=self.desirable_weight,
                             undesirable_weight=self.undesirable_weight, packing_max_tokens=self.packing_max_tokens,
                             z0=z0)
