"""Offline distillation's two halves on real tiny models, without Ray: the teacher's cached top-k at the
response positions, and the student's objective on them, each against a plain recomputation."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def rows(tokenizer):
    from alignflow.config import SyntheticTaskConfig
    from alignflow.data import synthetic
    from engines.batches import sft_tensors

    data = synthetic.generate(SyntheticTaskConfig(num_sft=6, num_preference=1, num_eval=1, num_rl_prompts=1), seed=0)
    tensors, _ = sft_tensors(tokenizer, data["sft"], 64, 4)
    return tensors


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    from alignflow.config import TinyModelConfig
    from engines.models import build_tiny_model, load_policy

    return load_policy(build_tiny_model(TinyModelConfig(), seed=1, out_dir=tmp_path_factory.mktemp("teacher"))).eval()


def _plain_logprobs(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
                                 .logits[:, :-1].float(), dim=-1)


def test_the_teacher_keeps_its_top_k_at_the_response_positions_alone(teacher, rows):
    from engines.train.objectives import topk_next_tokens

    top = topk_next_tokens(teacher, rows, k=5)
    full = _plain_logprobs(teacher, rows)
    mask = rows["loss_mask"][:, 1:] > 0
    assert top.shape == (*mask.shape, 5, 2) and 0 < mask.sum() < mask.numel()
    values, ids = full.topk(5, dim=-1)
    torch.testing.assert_close(top[..., 0][mask], values[mask], atol=1e-5, rtol=0)
    assert torch.equal(top[..., 1][mask].long(), ids[mask])
    assert not top[~mask].any()


def test_the_students_loss_is_the_kl_from_the_renormalised_top_k_and_falls_as_it_trains(tiny_model, teacher, rows):
    from engines.models import load_policy
    from engines.train.objectives import topk_distill_objective, topk_next_tokens

    top = topk_next_tokens(teacher, rows, k=5)
    batch = {**rows, "teacher_ids": top[..., 1].long(), "teacher_logprobs": top[..., 0]}
    student = load_policy(tiny_model)
    mask = rows["loss_mask"][:, 1:] > 0
    loss, metrics = topk_distill_objective(student, batch)
    s = _plain_logprobs(student, rows)
    expected = []
    for b, t in mask.nonzero().tolist():  # each response position, worked out in plain Python
        t_lp, ids = top[b, t, :, 0].tolist(), top[b, t, :, 1].long().tolist()
        z = math.log(sum(math.exp(v) for v in t_lp))
        expected.append(sum(math.exp(v - z) * ((v - z) - s[b, t, i].item()) for v, i in zip(t_lp, ids)))
    assert loss.item() == pytest.approx(sum(expected) / len(expected), rel=1e-5)
    assert metrics["response_length"] == (float(mask.sum()), float(mask.shape[0]))

    optimizer = torch.optim.Adam(student.parameters(), lr=1e-2)
    first = loss.item()
    for _ in range(10):
        optimizer.zero_grad()
        loss, _ = topk_distill_objective(student, batch)
        loss.backward()
        optimizer.step()
    assert topk_distill_objective(student, batch)[0].item() < 0.8 * first


def test_the_students_output_layer_runs_in_chunks_with_the_same_loss_and_gradient(tiny_model, teacher, rows,
                                                                                    monkeypatch):
    """At a real vocabulary one micro-batch's log-softmax is gigabytes: the objective takes the chunked,
    recomputed output layer of every other objective. Chunks of 3 positions, recomputed in backward,
    give the one-piece loss and gradient."""
    from engines.models import load_policy
    from engines.train import logits
    from engines.train.objectives import topk_distill_objective, topk_next_tokens

    top = topk_next_tokens(teacher, rows, k=5)
    batch = {**rows, "teacher_ids": top[..., 1].long(), "teacher_logprobs": top[..., 0]}
    student = load_policy(tiny_model)
    vocab = student.config.vocab_size

    def loss_and_grad():
        student.zero_grad()
        loss, _ = topk_distill_objective(student, batch)
        loss.backward()
        return loss.detach(), student.get_output_embeddings().weight.grad.clone()

    whole = loss_and_grad()
    calls = []
    monkeypatch.setattr(logits, "CHUNK_ELEMENTS", 3 * vocab)
    monkeypatch.setattr(logits, "KEEP_ELEMENTS", 0)
    monkeypatch.setattr(logits, "checkpoint", lambda fn, *a, **kw: calls.append(a[1].shape[0]) or
                        torch.utils.checkpoint.checkpoint(fn, *a, **kw))
    chunked = loss_and_grad()
    positions = int((rows["loss_mask"][:, 1:] > 0).sum())
    assert sum(calls) == positions and max(calls) == 3 and len(calls) == math.ceil(positions / 3)
    torch.testing.assert_close(chunked[0], whole[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(chunked[1], whole[1], rtol=1e-5, atol=1e-8)


def test_teacher_tokens_past_the_students_rows_are_left_out_counted_and_renormalised_away(tiny_model, teacher, rows):
    """A teacher with a larger (padded) vocabulary can rank a token the student has no output row for; the
    student's gather there fails (on a GPU, a device-side assert that ends the run). distill_teacher
    drops such entries and counts them, and the loss is the KL from the rest of the top-k, renormalised."""
    from engines.models import load_policy
    from engines.train.objectives import topk_distill_objective, topk_next_tokens
    from tasks.distill import drop_ids_past

    student = load_policy(tiny_model)
    vocab = student.config.vocab_size
    top = topk_next_tokens(teacher, rows, k=5)
    b, t = (rows["loss_mask"][:, 1:] > 0).nonzero()[0].tolist()
    top[b, t, 1] = torch.tensor([top[b, t, 1, 0].item(), vocab + 3])  # its second choice: a padding row
    with pytest.raises(RuntimeError, match="out of bounds"):
        topk_distill_objective(student, {**rows, "teacher_ids": top[..., 1].long(), "teacher_logprobs": top[..., 0]})

    logprobs, ids, dropped = drop_ids_past(top[..., 0], top[..., 1].long(), vocab)
    assert dropped["entries"] == 1 and dropped["mass"] == pytest.approx(math.exp(top[b, t, 1, 0].item()), rel=1e-6)
    assert not dropped["positions"].any()  # the position keeps four of its five
    assert not ids.eq(vocab + 3).any() and ids[b, t, 1] == 0 and logprobs[b, t, 1] == -1e4
    assert torch.equal(top[..., 1].eq(vocab + 3).nonzero(), torch.tensor([[b, t, 1]]))  # the input is left as it was
    batch = {**rows, "teacher_ids": ids, "teacher_logprobs": logprobs}
    loss, _ = topk_distill_objective(student, batch)
    s = _plain_logprobs(student, rows)
    t_lp, kept = top[b, t, [0, 2, 3, 4], 0].tolist(), top[b, t, [0, 2, 3, 4], 1].long().tolist()
    z = math.log(sum(math.exp(v) for v in t_lp))
    at_bt = sum(math.exp(v - z) * ((v - z) - s[b, t, i].item()) for v, i in zip(t_lp, kept))
    intact, _ = topk_distill_objective(student, {**batch, "loss_mask": _only_at(rows["loss_mask"], b, t + 1)})
    assert math.isfinite(loss.item()) and intact.item() == pytest.approx(at_bt, rel=1e-5)

    top[b, t, :, 1] = vocab  # every one of its five past the student's rows: nothing left to learn there
    logprobs, ids, dropped = drop_ids_past(top[..., 0], top[..., 1].long(), vocab)
    assert dropped["entries"] == 5 and torch.equal(dropped["positions"].nonzero(), torch.tensor([[b, t]]))
    _, _, again = drop_ids_past(logprobs, ids, vocab)  # the kept pass read back by distill: still found empty
    assert again["entries"] == 0 and torch.equal(again["positions"].nonzero(), torch.tensor([[b, t]]))


def _only_at(loss_mask: torch.Tensor, b: int, position: int) -> torch.Tensor:
    out = torch.zeros_like(loss_mask)
    out[b, position] = 1
    return out
