"""Fixtures of the episode and endpoint tests: the tiny model of the bundled agent task, a real engine on it
whose turns end, and the trainer's view of what it sampled."""

from __future__ import annotations

import pytest
import torch

from alignflow.config import TinyModelConfig
from alignflow.data import agent_task


@pytest.fixture(scope="session")
def box_model(tmp_path_factory):
    from engines.models import build_tiny_model

    return build_tiny_model(TinyModelConfig(corpus="boxes", vocab_size=400), seed=0,
                            out_dir=tmp_path_factory.mktemp("tiny-boxes"), corpus=agent_task.tokenizer_corpus())


@pytest.fixture
def eos_prone_engine(box_model):
    """transformers generate on the tiny boxes model, its output layer given a bias toward EOS (+3) so that
    turns end: a real engine, sampling real episodes. `.model_path` is the model's directory."""
    from engines.rollout.hf_engine import HFEngine

    engine = HFEngine(str(box_model), seed=0)
    head = engine.model.lm_head
    engine.model.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        engine.model.lm_head.weight.copy_(head.weight)
        engine.model.lm_head.bias.zero_()
        engine.model.lm_head.bias[engine.tokenizer.eos_token_id] = 3.0
    engine.model_path = box_model
    return engine


@pytest.fixture
def trainer_logprobs():
    """`(engine, exp) -> (B, T)`: log π of each response token of `exp` as the trainer computes it, one forward
    of a freshly loaded copy of the engine's model over each whole sequence."""
    return _trainer_logprobs


def _trainer_logprobs(engine, exp) -> torch.Tensor:
    from engines.models import load_policy

    model = load_policy(str(engine.model_path))
    model.lm_head = engine.model.lm_head
    with torch.no_grad():
        logits = model(input_ids=exp.input_ids, attention_mask=exp.attention_mask).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, exp.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return logp.gather(1, exp.response_index)
