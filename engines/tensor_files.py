"""Safetensors files larger than memory, as tensors backed by the file: written in pieces, read by rows.

A teacher's cached top-k over a whole SFT split (tasks/stages/distill.py) is rows x width x k entries of
8 bytes: 13 GB at 20k rows of 4096 tokens and k = 20. `create` lays out a safetensors file for tensors of
known shapes and hands back views of it to fill piece by piece; `mapped` gives views of a file's tensors
whose pages are read as rows are indexed, and which the OS may drop again (clean, file-backed pages), so
a training step's rows are what it holds. Either file is an ordinary safetensors file
(safetensors.torch.load_file reads it).

Layout (the safetensors format): 8 bytes little-endian N, N bytes of JSON header (name -> dtype, shape,
data_offsets), then the data, each tensor's bytes at its offsets from the end of the header.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

DTYPES = {torch.float32: "F32", torch.int32: "I32", torch.int64: "I64", torch.bfloat16: "BF16", torch.float16: "F16",
          torch.uint8: "U8", torch.bool: "BOOL"}
_BY_NAME = {v: k for k, v in DTYPES.items()}


def create(path: str | Path, specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    """A safetensors file at `path` of the tensors `specs` names (name -> (shape, dtype)), zero-filled, and
    writable views of each: what is written to them goes to the file."""
    header, offset = {}, 0
    for name, (shape, dtype) in specs.items():
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + offset)
    return _views(path, shared=True)


def mapped(path: str | Path) -> dict[str, torch.Tensor]:
    """Views of a safetensors file's tensors, read from the file as they are indexed. Copy-on-write: writing
    to a view changes this process's pages only, never the file."""
    return _views(path, shared=False)


def _views(path: str | Path, shared: bool) -> dict[str, torch.Tensor]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    total = Path(path).stat().st_size
    if not header:
        return {}
    data = torch.from_file(str(path), shared=shared, size=total, dtype=torch.uint8)[8 + n:]
    out = {}
    for name, meta in header.items():
        start, end = meta["data_offsets"]
        out[name] = data[start:end].view(_BY_NAME[meta["dtype"]]).view(meta["shape"])
    return out
