"""Content fingerprints of a pipeline's external inputs, for its cache keys.

A stage's key digests its config, its inputs' keys and its code version
(tasks/plan.py). Its config names data files and a base model by path, so
the planner adds a fingerprint of what each path holds: edit a file in
place and the stages that read it (and everything downstream) get new keys.

- a local file: the sha256 of its bytes. The digest is remembered under
  `{cache_dir}/fingerprints.json` by (path, size, mtime, inode), so an
  unchanged file is not read again; an edit that keeps size, mtime and
  inode alike (rare: `touch -r` after an in-place rewrite) is not seen.
- a local directory (a model, a saved dataset): the digest of every file's
  relative path and digest, in order.
- a remote object (s3://, gs://, ...): what the store says identifies its
  content: the version id or ETag (or md5/crc), else size and modification
  time; a remote directory combines its files'.
- anything else (a hub model id, a `datasets` hub name): the name itself,
  as `name:<value>`: a new upload under the same name (a hub model's next
  revision) is not seen; `model.revision` pins the base model (it is in the
  stage's config, so in its key).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from alignflow.store.storage import file_digest, is_local_uri, local_path

_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".txt", ".arrow")
_REMOTE_ID_KEYS = ("VersionId", "ETag", "etag", "md5Hash", "crc32c", "checksum")


class Fingerprints:
    """Digests of local files, remembered across runs by (path, size, mtime, inode)."""

    def __init__(self, cache_dir: str | os.PathLike[str]):
        self.path = Path(cache_dir).expanduser() / "fingerprints.json"
        self._memo: dict[str, list[Any]] | None = None
        self._dirty = False

    def _table(self) -> dict[str, list[Any]]:
        if self._memo is None:
            try:
                self._memo = json.loads(self.path.read_text())
            except (OSError, ValueError):
                self._memo = {}
        return self._memo

    def file(self, path: Path) -> str:
        st = path.stat()
        stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
        known = self._table().get(str(path))
        if known is not None and known[:3] == stamp:
            return known[3]
        digest = file_digest(path)
        self._table()[str(path)] = [*stamp, digest]
        self._dirty = True
        return digest

    def directory(self, path: Path) -> str:
        h = hashlib.sha256()
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            h.update(f"{f.relative_to(path).as_posix()}\0{self.file(f)}\n".encode())
        return h.hexdigest()

    def of(self, value: str) -> str:
        """The fingerprint of a path, URI or name (see the module docstring)."""
        if is_local_uri(value):
            path = local_path(value)
            if path.is_file():
                return "sha256:" + self.file(path)
            if path.is_dir():
                return "dir-sha256:" + self.directory(path)
            if value.startswith((".", "/", "~", "file://")) or path.suffix in _DATA_SUFFIXES:
                return "missing:" + str(path)  # preflight says so; the key still changes when it appears
            return "name:" + value
        return _remote(value)

    def save(self) -> None:
        if not self._dirty:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".fingerprints-")
        with os.fdopen(fd, "w") as f:
            json.dump(self._table(), f)
        os.replace(tmp, self.path)  # atomic: concurrent planners never read half a table
        self._dirty = False


def _remote(uri: str) -> str:
    import fsspec

    fs, path = fsspec.core.url_to_fs(uri)
    if fs.isdir(path):
        entries = sorted(fs.find(path, detail=True).items())
        h = hashlib.sha256()
        for name, info in entries:
            h.update(f"{name}\0{_remote_id(info)}\n".encode())
        return "remote-dir:" + h.hexdigest()
    return "remote:" + _remote_id(fs.info(path))


def _remote_id(info: dict[str, Any]) -> str:
    for key in _REMOTE_ID_KEYS:
        if info.get(key):
            return f"{key}={str(info[key]).strip(chr(34))}"
    modified = info.get("LastModified") or info.get("mtime") or info.get("updated")
    return f"size={info.get('size')},modified={modified}"


def module_source(module: str) -> str | None:
    """The path of a module's source file, without importing it (None if not found)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec and spec.origin and os.path.isfile(spec.origin) else None
