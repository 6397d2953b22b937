"""Safetensors files backed tensors (engines/tensor_files.py): written in pieces, read by rows, ordinary files."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from engines import tensor_files


def test_a_file_written_in_pieces_is_an_ordinary_safetensors_file(tmp_path):
    path = tmp_path / "t.safetensors"
    want = {"logprobs": torch.randn(7, 5, 3), "ids": torch.randint(0, 100, (7, 5, 3), dtype=torch.int32),
            "positions": torch.arange(35, dtype=torch.int32).view(7, 5)}
    views = tensor_files.create(path, {k: (tuple(v.shape), v.dtype) for k, v in want.items()})
    assert all(v.eq(0).all() for v in views.values())  # zero-filled until written
    views["positions"].copy_(want["positions"])
    for start in range(0, 7, 3):  # piece by piece
        for k in ("logprobs", "ids"):
            views[k][start:start + 3] = want[k][start:start + 3]
    del views
    read = load_file(str(path))
    assert read.keys() == want.keys() and all(torch.equal(read[k], want[k]) for k in want)
    mapped = tensor_files.mapped(path)
    assert all(torch.equal(mapped[k], want[k]) and mapped[k].dtype == want[k].dtype for k in want)
    rows = torch.tensor([5, 0, 5])
    assert torch.equal(mapped["logprobs"][rows], want["logprobs"][rows])


def test_writing_to_a_mapped_file_leaves_the_file_as_it_was(tmp_path):
    """Read views are copy-on-write: distill drops a cache's ids in place where it must, never in the cache."""
    path = tmp_path / "t.safetensors"
    views = tensor_files.create(path, {"x": ((4, 2), torch.float32)})
    views["x"].fill_(1.5)
    del views
    mapped = tensor_files.mapped(path)
    mapped["x"][1] = -7.0
    assert mapped["x"][1].tolist() == [-7.0, -7.0]
    assert load_file(str(path))["x"].eq(1.5).all() and tensor_files.mapped(path)["x"].eq(1.5).all()


def test_mapped_reads_of_a_file_saved_by_safetensors(tmp_path):
    from safetensors.torch import save_file

    want = {"a": torch.randn(3, 4), "b": torch.arange(6, dtype=torch.int32), "c": torch.ones(2, dtype=torch.bfloat16)}
    save_file(want, str(tmp_path / "s.safetensors"), metadata={"format": "pt"})
    mapped = tensor_files.mapped(tmp_path / "s.safetensors")
    assert all(torch.equal(mapped[k], want[k]) for k in want)
    with pytest.raises(KeyError):
        tensor_files.create(tmp_path / "bad.safetensors", {"z": ((2,), torch.complex64)})
