"""Artifacts as actors see them: what to read from, where to write to, on whichever node they run.

A task hands its actors `ArtifactRef`s (a committed directory's URI, a path inside it, and the storage
settings; no credentials), never paths on its own node: on a multi-node Ray cluster an actor placed
elsewhere would find no files there. Each actor resolves a ref on its own node (`local_dir`): a
verified copy in that node's cache, keyed by the URI, whose last part is the producing stage's content
key, so a copy is reused across rounds and stages. Writes go the same way in reverse (`writing`): the
process that holds the data writes into a scratch directory of its own node and uploads it under the
ref; the files' manifest entries go back to the task, which commits the directory by writing its
manifest last (`Storage.commit(..., uploaded=...)`).

A plain string is a directory on the node that uses it: tests, benchmarks and single-node tools.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from alignflow.store.storage import Storage

# Files a task needs to read a model's tokenizer and config, without its weights.
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")


@dataclass(frozen=True)
class ArtifactRef:
    """A committed directory (to read) or one being written, by URI; picklable, credential-free.
    `path`: a subdirectory inside it (a checkpoint's `actor/`); the manifest stays at `uri`."""

    uri: str
    storage: Storage
    path: str = ""

    def child(self, name: str) -> ArtifactRef:
        return dataclasses.replace(self, path=f"{self.path}/{name}" if self.path else name)

    @property
    def target(self) -> str:
        """Where files written under this ref go."""
        return f"{self.uri}/{self.path}" if self.path else self.uri


Source = Union[str, ArtifactRef]  # noqa: UP007 (a runtime alias)
Entries = dict[str, dict[str, Any]]  # manifest entries: relative path -> {"size", "sha256"}


def child(source: Source, name: str) -> Source:
    """The subdirectory `name` of a directory or of a ref."""
    return source.child(name) if isinstance(source, ArtifactRef) else str(Path(source) / name)


def local_dir(source: Source, *, skip: tuple[str, ...] = ()) -> str:
    """`source` as a directory on this node: a path as it is; a ref fetched (and verified) into this
    node's cache, its subdirectory alone when it names one (`Storage.fetch`; `skip`: file-name
    patterns not to download, e.g. WEIGHT_FILES)."""
    if isinstance(source, ArtifactRef):
        root = source.storage.fetch(source.uri, skip=skip, under=source.path)
        return str(root / source.path) if source.path else str(root)
    return str(source)


@contextmanager
def writing(target: Source) -> Iterator[tuple[Path, Entries]]:
    """`with writing(target) as (directory, uploaded):` write files into `directory`.

    A path: `directory` is that path (made), and `uploaded` stays empty (the caller commits it).
    A ref: `directory` is a fresh scratch directory on this node (beside its cache: model-sized files
    go there, not to a small /tmp); on a clean exit its files are uploaded under the ref and their
    manifest entries, relative to the ref, put in `uploaded` (none written: none uploaded). Nothing
    is committed here."""
    uploaded: Entries = {}
    if not isinstance(target, ArtifactRef):
        directory = Path(target)
        directory.mkdir(parents=True, exist_ok=True)
        yield directory, uploaded
        return
    scratch = target.storage.node_cache()
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".upload-", dir=scratch) as tmp:
        yield Path(tmp), uploaded
        uploaded.update(target.storage.upload(tmp, target.target))


def merge_entries(parts: list[Entries], prefix: str = "") -> Entries:
    """Manifest entries uploaded by several processes, under `prefix/`; the same path twice is an error
    (two ranks writing one file)."""
    merged: Entries = {}
    for part in parts:
        for rel, entry in part.items():
            key = f"{prefix}/{rel}" if prefix else rel
            if key in merged:
                raise RuntimeError(f"{key} was uploaded twice (two writers of one file)")
            merged[key] = entry
    return merged
