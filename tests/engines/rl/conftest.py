"""Fixtures of the RL room's tests that run objectives on the tiny model without Ray."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def policy_batch(tiny_model):
    """The tiny policy in eval mode, a two-row experience (3 and 2 response tokens) and its log-probs."""
    from engines.models import load_policy
    from engines.rl import experience
    from engines.rollout.base import Rollout
    from engines.train import objectives

    model = load_policy(tiny_model).eval()
    exp = experience.from_rollouts([Rollout(0, [5, 6, 7], [11, 12, 13], "", [0.0] * 3, True),
                                    Rollout(0, [5, 6, 7], [14, 15], "", [0.0] * 2, True)], pad_id=0)
    with torch.no_grad():
        logprobs = objectives.response_logprobs(model, exp.tensors())
    return model, exp, logprobs
