"""The evaluation stages' sample statistics, named as MLflow metrics (tasks/stages/evaluate.py logs them).

Policy (every prompt sampled `evaluation.generation.num_samples` = n times):
  eval/pass_at_<k>      for k = 1..n: the unbiased pass@k (Chen et al. 2021), mean over prompts;
                        pass_at_1 is eval/accuracy. (MLflow metric names may not hold '@'; the
                        comparison table shows them as pass@k.)
  eval/majority_accuracy  share of prompts whose most frequent answer (`evaluation.vote_on` of each
                        response, else the response; whitespace-normalised, ties to the first seen) the
                        checker accepts
Reward model (`evaluation.rm_margin_bins` edges e_0=0 < e_1 < ... < e_J-1, the last bin open):
  eval/rm_count_margin_<lo>_<hi>     held-out pairs with |chosen - rejected| score gap in [lo, hi)
  eval/rm_accuracy_margin_<lo>_<hi>  their pairwise accuracy; absent where the count is 0
  (<hi> of the last bin is "inf"; numbers as Python's :g writes them: 0, 0.5, 2, inf)

Metric names only at import: the math (algos, torch) loads when a function runs,
so that the report (flows/report.py) can share the names without importing torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

PASS_AT_PREFIX = "eval/pass_at_"
MAJORITY_ACCURACY = "eval/majority_accuracy"
RM_ACCURACY_PREFIX = "eval/rm_accuracy_margin_"
RM_COUNT_PREFIX = "eval/rm_count_margin_"


def pass_at_key(k: int) -> str:
    return f"{PASS_AT_PREFIX}{k}"


def pass_at_ks(metrics: dict[str, float]) -> list[int]:
    """The k of every eval/pass_at_<k> in `metrics`, ascending."""
    return sorted(int(key.removeprefix(PASS_AT_PREFIX)) for key in metrics
                  if key.startswith(PASS_AT_PREFIX) and key.removeprefix(PASS_AT_PREFIX).isdigit())


def margin_label(lo: float, hi: float) -> str:
    return f"{lo:g}_{hi:g}"


def answer_votes(vote_on: Callable[[str], str | None] | None, texts: Sequence[str], where: str
                 ) -> list[str | None]:
    """What each response votes for (`evaluation.vote_on`, named `where` in the error; else the response): a
    str, or None for no vote. Anything else would fail inside the vote with no field named: a ConfigError."""
    if vote_on is None:
        return list(texts)
    votes = [vote_on(t) for t in texts]
    for text, vote in zip(texts, votes):
        if vote is not None and not isinstance(vote, str):
            from alignflow.errors import ConfigError

            raise ConfigError(f"evaluation.vote_on ({where}) returned {type(vote).__name__} {vote!r} for the "
                              f"response {text[:80]!r}; it must return the response's answer as a str, or None "
                              f"for no answer")
    return votes


def sample_metrics(prompt_indices: Sequence[int], texts: Sequence[str | None], correct: Sequence[bool], *,
                   num_prompts: int, num_samples: int) -> dict[str, float]:
    """pass@1..pass@n and majority-vote accuracy of checked samples, sample i answering prompt
    `prompt_indices[i]` with `texts[i]` (the answer the vote compares; None: none stated, no vote);
    every prompt 0..num_prompts-1 must have exactly `num_samples` samples (anything else is an error,
    not a silently smaller k)."""
    from algos.evaluation import majority_vote_accuracy, pass_at_k_curve

    if not len(prompt_indices) == len(texts) == len(correct):
        raise ValueError(f"{len(prompt_indices)} prompt indices, {len(texts)} responses, {len(correct)} flags")
    groups: dict[int, list[int]] = {p: [] for p in range(num_prompts)}
    for i, p in enumerate(prompt_indices):
        if p not in groups:
            raise ValueError(f"sample {i} answers prompt {p}, outside 0..{num_prompts - 1}")
        groups[p].append(i)
    uneven = {p: len(g) for p, g in groups.items() if len(g) != num_samples}
    if uneven:
        raise ValueError(f"expected {num_samples} samples of every prompt for pass@k; prompt: count {uneven}")
    curve = pass_at_k_curve([sum(bool(correct[i]) for i in g) for g in groups.values()], num_samples)
    majority = majority_vote_accuracy([[texts[i] for i in g] for g in groups.values()],
                                      [[correct[i] for i in g] for g in groups.values()])
    return {**{pass_at_key(k): v for k, v in enumerate(curve, start=1)}, MAJORITY_ACCURACY: majority}


def margin_metrics(chosen: Sequence[float], rejected: Sequence[float], edges: Sequence[float]) -> dict[str, float]:
    """Count and pairwise accuracy of the reward model per |chosen - rejected| score-gap bin."""
    from algos.evaluation import accuracy_by_margin_bin

    out: dict[str, float] = {}
    for b in accuracy_by_margin_bin(chosen, rejected, edges):
        label = margin_label(b.lo, b.hi)
        out[f"{RM_COUNT_PREFIX}{label}"] = float(b.count)
        if b.count:
            out[f"{RM_ACCURACY_PREFIX}{label}"] = b.accuracy
    return out
