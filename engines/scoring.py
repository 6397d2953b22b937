"""Scoring with a scalar-head model (reward model) and sequence logprobs."""

from __future__ import annotations

import torch

from algos.sequence import shifted_logprobs
from engines import models
from engines.batches import right_padded
from engines.objectives import response_logprobs, scalar_scores


class RewardScorer:
    """A reward model in this process: (prompt ids, response ids) -> score."""

    def __init__(self, path: str, dtype: str = "float32", batch_size: int = 128):
        self.tokenizer = models.load_tokenizer(path)
        self.model = models.load_scalar_model(path, dtype, self.tokenizer.pad_token_id).eval()
        self.batch_size = batch_size

    @torch.no_grad()
    def score(self, sequences: list[list[int]]) -> list[float]:
        out: list[float] = []
        for i in range(0, len(sequences), self.batch_size):
            batch = right_padded(sequences[i : i + self.batch_size], self.tokenizer.pad_token_id)
            out.extend(scalar_scores(self.model, batch).tolist())
        return out


class SequenceLogprober:
    """A causal LM in this process: summed logprobs of response tokens."""

    def __init__(self, path: str, dtype: str = "float32", batch_size: int = 128):
        self.tokenizer = models.load_tokenizer(path)
        self.model = models.load_policy(path, dtype).eval()
        self.batch_size = batch_size

    @torch.no_grad()
    def response_logprobs(self, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
        """Per-token logprobs of each response given its prompt."""
        out: list[list[float]] = []
        for i in range(0, len(prompts), self.batch_size):
            ps, rs = prompts[i : i + self.batch_size], responses[i : i + self.batch_size]
            batch = right_padded([p + r for p, r in zip(ps, rs)], self.tokenizer.pad_token_id)
            lp = shifted_logprobs(self.model(**batch).logits, batch["input_ids"])
            for row, (p, r) in enumerate(zip(ps, rs)):
                out.append(lp[row, len(p) - 1 : len(p) - 1 + len(r)].tolist())
        return out


class ScorerActor:
    """Frozen models for experience making, as one Ray actor: the reference
    policy (logprobs) and/or the reward model (scores). Whether the two share
    an actor or stand apart is the round's `colocate_reference_and_reward`.
    """

    def __init__(self, reference_path: str | None, reward_path: str | None, dtype: str = "float32",
                 torch_threads: int = 2):
        torch.set_num_threads(torch_threads)
        self.reference = models.load_policy(reference_path, dtype).eval() if reference_path else None
        self.reward = None
        if reward_path:
            pad = models.load_tokenizer(reward_path).pad_token_id
            self.reward = models.load_scalar_model(reward_path, dtype, pad).eval()

    @torch.no_grad()
    def ref_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return response_logprobs(self.reference, batch)

    @torch.no_grad()
    def rewards(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return scalar_scores(self.reward, batch)
