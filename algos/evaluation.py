"""Evaluation statistics: pass@k, majority-vote accuracy, reward-model accuracy by score gap.

Plain Python numbers in, plain Python numbers out (the evaluation stage has
its samples as lists); 1-D tensors are accepted wherever a sequence of
numbers is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from ``n`` samples of which ``c`` are correct.

    Formula: ``pass@k = 1 - C(n - c, k) / C(n, k)``, computed as the product
    ``1 - prod_{i = n-c+1}^{n} (1 - k / i)`` (no large binomials); ``1`` when
    ``n - c < k`` (every draw of ``k`` contains a correct sample). E.g.
    ``n = 5, c = 2, k = 2``: ``1 - C(3, 2) / C(5, 2) = 1 - 3/10 = 0.7``.

    Shapes: scalars; ``0 <= c <= n``, ``1 <= k <= n``; returns a float in [0, 1].

    Reference: Chen et al. 2021, "Evaluating Large Language Models Trained on
    Code", arXiv 2107.03374, sec. 2.1 and fig. 3 (the numerically stable form).
    """
    n, c, k = int(n), int(c), int(k)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 0 <= c <= n:
        raise ValueError(f"c must be in [0, n={n}], got {c}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got {k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def pass_at_k_curve(num_correct: Sequence[int], num_samples: int) -> list[float]:
    """Mean over prompts of the unbiased pass@k, for every ``k = 1 .. n``.

    Formula: ``pass@k = (1/P) sum_p [1 - C(n - c_p, k) / C(n, k)]`` (see
    ``pass_at_k``); ``pass@1`` is the mean of ``c_p / n``, the share of
    correct samples, and pass@k is non-decreasing in k.

    Shapes: ``num_correct`` ``(P,)`` ints in ``[0, n]`` (correct samples of
    each prompt, every prompt sampled ``n = num_samples`` times, ``P >= 1``);
    returns a list of ``n`` floats, element ``k - 1`` being pass@k.

    Reference: Chen et al. 2021, arXiv 2107.03374, sec. 2.1.
    """
    counts = [int(c) for c in num_correct]
    if not counts:
        raise ValueError("pass_at_k_curve needs at least one prompt")
    return [sum(pass_at_k(num_samples, c, k) for c in counts) / len(counts) for k in range(1, num_samples + 1)]


def normalize_response(text: str) -> str:
    """The form responses are compared in for a majority vote: whitespace stripped and collapsed.

    Formula: ``norm(s) = " ".join(s.split())`` (case and punctuation kept).

    Shapes: one string in, one string out.

    Reference: the answer aggregation of self-consistency, Wang et al. 2022,
    arXiv 2203.11171, sec. 2.
    """
    return " ".join(text.split())


def majority_vote_accuracy(responses: Sequence[Sequence[str | None]], correct: Sequence[Sequence[bool]]) -> float:
    """Share of prompts whose most frequent (normalised) answer is correct.

    Formula: for prompt ``p`` with answers ``y_p1 .. y_pn`` (a response, or the final answer taken from
    it; ``None``: the sample stated none and does not vote), the vote
    ``v_p = argmax_v |{i : y_pi is not None, norm(y_pi) = v}|`` (``norm``: ``normalize_response``);
    ties go to the value seen first (lowest ``i``). The vote is correct when the first sample carrying
    it (``y_pi``, smallest ``i`` with ``norm(y_pi) = v_p``) is; a prompt where no sample votes is a
    miss; ``acc = (1/P) sum_p correct(v_p)``.

    Shapes: ``responses`` and ``correct`` are ``P`` lists (one per prompt,
    ``P >= 1``), prompt ``p``'s two lists of the same length ``n_p >= 1``
    (``n_p`` may differ between prompts); returns a float in [0, 1].

    Reference: Wang et al. 2022, "Self-Consistency Improves Chain of Thought
    Reasoning in Language Models", arXiv 2203.11171, sec. 2 (majority vote
    over the final answers, the reasoning paths marginalised out).
    """
    if len(responses) != len(correct):
        raise ValueError(f"{len(responses)} prompts of responses but {len(correct)} of correct flags")
    if not responses:
        raise ValueError("majority_vote_accuracy needs at least one prompt")
    hits = 0
    for p, (texts, flags) in enumerate(zip(responses, correct)):
        if len(texts) != len(flags) or not texts:
            raise ValueError(f"prompt {p}: {len(texts)} responses and {len(flags)} correct flags "
                             f"(need the same number, at least one)")
        votes: dict[str, list] = {}  # value -> [count, first flag]; insertion order = first seen
        for text, flag in zip(texts, flags):
            if text is not None:
                vote = votes.setdefault(normalize_response(text), [0, bool(flag)])
                vote[0] += 1
        if votes:
            best = max(vote[0] for vote in votes.values())
            hits += next(flag for count, flag in votes.values() if count == best)
    return hits / len(responses)


@dataclass(frozen=True)
class MarginBin:
    """One score-gap bin ``[lo, hi)`` of ``accuracy_by_margin_bin``; ``accuracy`` NaN when ``count == 0``."""

    lo: float
    hi: float  # math.inf for the last bin
    count: int
    accuracy: float


def accuracy_by_margin_bin(chosen_scores: Sequence[float], rejected_scores: Sequence[float],
                           edges: Sequence[float]) -> list[MarginBin]:
    """Reward-model pairwise accuracy per bin of the score gap ``|s_chosen - s_rejected|``.

    Formula: ``g_i = |s_c,i - s_r,i|``; bin ``j`` is ``[e_j, e_{j+1})`` with
    ``e_J = inf`` after the last edge, so every pair is in exactly one bin
    (``e_0 = 0``); ``acc_j = (1/N_j) sum_{i in bin j} 1[s_c,i > s_r,i]``
    (a tie counts as wrong, as in the overall pairwise accuracy), ``N_j`` the
    pairs in bin ``j``, ``acc_j = NaN`` when ``N_j = 0``. E.g. edges
    ``[0, 1]``, differences ``s_c - s_r`` of ``0.5, -0.2, 3.0``: bin [0, 1)
    has 2 pairs, accuracy 0.5; [1, inf) has 1, accuracy 1.

    Shapes: ``chosen_scores``, ``rejected_scores`` ``(N,)`` (pair ``i`` in
    both); ``edges`` ``(J,)`` strictly increasing, ``edges[0] == 0``; returns
    ``J`` ``MarginBin``s in edge order.

    Reference: Touvron et al. 2023, "Llama 2: Open Foundation and Fine-Tuned
    Chat Models", arXiv 2307.09288, sec. 3.2.2 (reward-model accuracy by
    preference margin).
    """
    chosen = torch.as_tensor(chosen_scores, dtype=torch.float64).reshape(-1)
    rejected = torch.as_tensor(rejected_scores, dtype=torch.float64).reshape(-1)
    if chosen.shape != rejected.shape:
        raise ValueError(f"{chosen.numel()} chosen scores but {rejected.numel()} rejected scores")
    gap = (chosen - rejected).abs()
    if torch.isnan(gap).any():
        raise ValueError("a score gap is NaN (a NaN score, or inf - inf): no bin can hold it")
    bounds = [float(e) for e in edges]
    if not bounds or bounds[0] != 0.0 or any(b <= a for a, b in zip(bounds, bounds[1:])) \
            or not all(math.isfinite(e) for e in bounds):
        raise ValueError(f"edges must be finite, strictly increasing and start at 0, got {bounds}")
    right = chosen > rejected
    out = []
    for lo, hi in zip(bounds, bounds[1:] + [math.inf]):
        inside = (gap >= lo) & (gap < hi) if hi < math.inf else gap >= lo  # an infinite gap: the last bin
        count = int(inside.sum())
        acc = float(right[inside].double().mean()) if count else math.nan
        out.append(MarginBin(lo=lo, hi=hi, count=count, accuracy=acc))
    return out
