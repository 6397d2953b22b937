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


def test_loss_columns_list_each_rows_response_positions_in_order():
    from engines.train.objectives import loss_columns

    loss_mask = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 0, 1, 1], [0, 0, 0, 0, 0]])
    # next-token layout: position t predicts token t + 1, so loss token 2 is position 1
    assert loss_columns(loss_mask).tolist() == [[1, 2, -1], [0, 2, 3], [-1, -1, -1]]
    assert loss_columns(loss_mask, 4).tolist() == [[1, 2, -1, -1], [0, 2, 3, -1], [-1, -1, -1, -1]]
    with pytest.raises(ValueError, match="3 loss tokens, more than the width 2"):
        loss_columns(loss_mask, 2)


def _top(teacher, rows, k=5):
    from engines.train.objectives import loss_columns, topk_next_tokens

    return topk_next_tokens(teacher, rows, k=k, width=loss_columns(rows["loss_mask"]).shape[1])


def _with_teacher(rows, top):
    from engines.train.objectives import loss_columns

    return {**rows, "teacher_ids": top[..., 1].to(torch.int32), "teacher_logprobs": top[..., 0],
            "teacher_positions": loss_columns(rows["loss_mask"], top.shape[1])}


def test_the_teacher_keeps_its_top_k_at_the_response_positions_alone(teacher, rows):
    """One column per response token, not one per position of the padded split: the prompts and the
    padding take no room in the cache."""
    from engines.train.objectives import loss_columns, topk_next_tokens

    columns = loss_columns(rows["loss_mask"])
    top = topk_next_tokens(teacher, rows, k=5, width=columns.shape[1])
    full = _plain_logprobs(teacher, rows)
    mask = rows["loss_mask"][:, 1:] > 0
    assert top.shape == (len(mask), int(mask.sum(1).max()), 5, 2) and top.shape[1] < mask.shape[1] / 4
    values, ids = full.topk(5, dim=-1)
    for b, t in mask.nonzero().tolist():  # the j-th response position of row b in column j
        j = int(mask[b, : t + 1].sum()) - 1
        torch.testing.assert_close(top[b, j, :, 0], values[b, t], atol=1e-5, rtol=0)
        assert torch.equal(top[b, j, :, 1].long(), ids[b, t])
    assert not top[columns < 0].any()
    wider = topk_next_tokens(teacher, rows, k=5, width=columns.shape[1] + 2)  # a micro-batch of a wider split
    assert torch.equal(wider[:, : columns.shape[1]], top) and not wider[:, columns.shape[1]:].any()


def test_the_students_loss_is_the_kl_from_the_renormalised_top_k_and_falls_as_it_trains(tiny_model, teacher, rows):
    from engines.models import load_policy
    from engines.train.objectives import topk_distill_objective

    top = _top(teacher, rows)
    batch = _with_teacher(rows, top)
    student = load_policy(tiny_model)
    mask = rows["loss_mask"][:, 1:] > 0
    loss, metrics = topk_distill_objective(student, batch)
    s = _plain_logprobs(student, rows)
    expected = []
    for b, t in mask.nonzero().tolist():  # each response position, worked out in plain Python
        j = int(mask[b, : t + 1].sum()) - 1  # its column
        t_lp, ids = top[b, j, :, 0].tolist(), top[b, j, :, 1].long().tolist()
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
    from engines.train.objectives import topk_distill_objective

    batch = _with_teacher(rows, _top(teacher, rows))
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
    from engines.train.objectives import topk_distill_objective
    from tasks.stages.distill import drop_ids_past

    student = load_policy(tiny_model)
    vocab = student.config.vocab_size
    top = _top(teacher, rows)
    b, t = (rows["loss_mask"][:, 1:] > 0).nonzero()[0].tolist()  # row b's first response position: column 0
    top[b, 0, 1] = torch.tensor([top[b, 0, 1, 0].item(), vocab + 3])  # its second choice: a padding row
    with pytest.raises(RuntimeError, match="out of bounds"):
        topk_distill_objective(student, _with_teacher(rows, top))

    logprobs, ids, dropped = drop_ids_past(top[..., 0], top[..., 1].long(), vocab)
    assert dropped["entries"] == 1 and dropped["mass"] == pytest.approx(math.exp(top[b, 0, 1, 0].item()), rel=1e-6)
    assert not dropped["positions"].any()  # the position keeps four of its five
    assert not ids.eq(vocab + 3).any() and ids[b, 0, 1] == 0 and logprobs[b, 0, 1] == -1e4
    assert torch.equal(top[..., 1].eq(vocab + 3).nonzero(), torch.tensor([[b, 0, 1]]))  # the input is left as it was
    batch = {**_with_teacher(rows, top), "teacher_ids": ids, "teacher_logprobs": logprobs}
    loss, _ = topk_distill_objective(student, batch)
    s = _plain_logprobs(student, rows)
    t_lp, kept = top[b, 0, [0, 2, 3, 4], 0].tolist(), top[b, 0, [0, 2, 3, 4], 1].long().tolist()
    z = math.log(sum(math.exp(v) for v in t_lp))
    at_bt = sum(math.exp(v - z) * ((v - z) - s[b, t, i].item()) for v, i in zip(t_lp, kept))
    intact, _ = topk_distill_objective(student, {**batch, "loss_mask": _only_at(rows["loss_mask"], b, t + 1)})
    assert math.isfinite(loss.item()) and intact.item() == pytest.approx(at_bt, rel=1e-5)

    top[b, 0, :, 1] = vocab  # every one of its five past the student's rows: nothing left to learn there
    logprobs, ids, dropped = drop_ids_past(top[..., 0], top[..., 1].long(), vocab)
    assert dropped["entries"] == 5 and torch.equal(dropped["positions"].nonzero(), torch.tensor([[b, 0]]))
    _, _, again = drop_ids_past(logprobs, ids, vocab)  # the kept pass read back by distill: still found empty
    assert again["entries"] == 0 and torch.equal(again["positions"].nonzero(), torch.tensor([[b, 0]]))


def _only_at(loss_mask: torch.Tensor, b: int, position: int) -> torch.Tensor:
    out = torch.zeros_like(loss_mask)
    out[b, position] = 1
    return out


def test_a_cached_pass_read_back_checks_its_rows_and_leaves_emptied_positions_out(tiny_model, teacher, rows):
    """distill reads distill_teacher's file back: a cache of other rows (or of the old per-position layout,
    without positions) is refused; a position whose every entry the student has no row for leaves the
    loss, and the rest are trained as before."""
    from alignflow.errors import ConfigError
    from engines.models import load_policy
    from engines.train.objectives import loss_columns, topk_distill_objective
    from tasks.stages.distill import with_teacher

    student = load_policy(tiny_model)
    vocab = student.config.vocab_size
    top = _top(teacher, rows)
    columns = loss_columns(rows["loss_mask"])
    cached = {"logprobs": top[..., 0].clone(), "ids": top[..., 1].to(torch.int32), "positions": columns.to(torch.int32)}
    b = int((columns >= 0).sum(1).argmax())  # a row with two response positions or more
    cached["ids"][b, 1] = vocab  # its second: all five past the student's rows
    batch = with_teacher(rows, cached, vocab, "distill")
    t = int(columns[b, 1])
    assert batch["loss_mask"][b, t + 1] == 0 and int(batch["loss_mask"].sum()) == int(rows["loss_mask"].sum()) - 1
    without = rows["loss_mask"].clone()
    without[b, t + 1] = 0
    expected, _ = topk_distill_objective(student, {**_with_teacher(rows, top), "loss_mask": without})
    assert topk_distill_objective(student, batch)[0].item() == pytest.approx(expected.item(), rel=1e-6)

    with pytest.raises(ConfigError, match="rerun distill_teacher"):
        with_teacher({k: v[1:] for k, v in rows.items()}, cached, vocab, "distill")  # another split's rows
    with pytest.raises(ConfigError, match="distill: the teacher's cached response positions"):
        with_teacher(rows, {k: v for k, v in cached.items() if k != "positions"}, vocab, "distill")


def test_a_distillation_micro_batch_cut_to_its_rows_keeps_every_teacher_column(tiny_model, teacher, rows):
    """Training cuts each micro-batch to its longest row (micro_batching.trimmed). A response token's column is never
    past its position, so the cut keeps every one: the trimmed micro-batches' losses are the whole batch's."""
    from engines.micro_batching import micro_batches
    from engines.models import load_policy
    from engines.train.objectives import topk_distill_objective

    student = load_policy(tiny_model).eval()
    # as a split with a longer row pads these: 5 more positions, none attended
    wide = {k: torch.nn.functional.pad(v, (0, 5)) for k, v in rows.items()}
    batch = _with_teacher(wide, _top(teacher, wide))
    parts = micro_batches(batch, 2, trim=True)
    assert all(p["input_ids"].shape[1] == rows["input_ids"].shape[1] for p in parts)
    with torch.no_grad():
        whole = topk_distill_objective(student, batch)[0].item() * int(batch["loss_mask"].sum())
        cut = sum(topk_distill_objective(student, p)[0].item() * int(p["loss_mask"].sum()) for p in parts)
    assert cut == pytest.approx(whole, rel=1e-5)
    assert sum(int((p["teacher_positions"] >= 0).sum()) for p in parts) == int(batch["loss_mask"].sum())


def test_a_mapped_cache_read_in_pieces_gives_what_the_whole_does(tiny_model, teacher, rows, tmp_path, monkeypatch):
    """distill reads the teacher's file mapped (engines/tensor_files.py) and drops ids past the student's rows a
    piece of rows at a time, in place: the same batch as the whole cache in memory, and the file unchanged."""
    from safetensors.torch import load_file

    from engines import tensor_files
    from engines.train.objectives import loss_columns
    from tasks.stages import distill

    top = _top(teacher, rows)
    columns = loss_columns(rows["loss_mask"])
    whole = {"logprobs": top[..., 0].clone(), "ids": top[..., 1].to(torch.int32), "positions": columns.to(torch.int32)}
    student_rows = int(whole["ids"].max())  # the top id is past the student's rows: dropped wherever it is
    views = tensor_files.create(tmp_path / "t.safetensors", {k: (tuple(v.shape), v.dtype) for k, v in whole.items()})
    for k, v in whole.items():
        views[k].copy_(v)
    del views
    monkeypatch.setattr(distill, "PIECE_BYTES", 1)  # a row a piece
    expected = distill.with_teacher(rows, {k: v.clone() for k, v in whole.items()}, student_rows, "distill")
    got = distill.with_teacher(rows, tensor_files.mapped(tmp_path / "t.safetensors"), student_rows, "distill")
    assert int(whole["ids"].eq(student_rows).sum()) > 0
    for k in ("loss_mask", "teacher_ids", "teacher_logprobs", "teacher_positions"):
        assert torch.equal(got[k], expected[k]), k
    assert torch.equal(load_file(str(tmp_path / "t.safetensors"))["ids"], whole["ids"])  # the cache as written
