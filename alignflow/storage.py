"""Artifacts under one root URI (local directory or s3://bucket/prefix).

Layout: `{root}/{stage}/{key}/` where `key` is a content key (stage config +
input keys + code version). A directory is *committed* when its
`manifest.json` exists; the manifest is written last, after every file, and
lists each file's size and sha256. Readers accept only committed directories
and verify them, so a crash mid-upload never looks finished.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

MANIFEST = "manifest.json"
log = logging.getLogger("alignflow")
_CHECKPOINT_DIR = re.compile(r"step-(\d+)$")


class StorageError(RuntimeError):
    """A missing, uncommitted or corrupted artifact."""


def is_local_uri(uri: str) -> bool:
    """The one rule: a path without a scheme, or a file:// URI, is local."""
    return "://" not in uri or uri.startswith("file://")


def local_path(uri: str, base: Path | None = None) -> Path:
    """A local URI as an absolute path (`~` expanded, relative to `base` or the cwd)."""
    if not is_local_uri(uri):
        raise StorageError(f"{uri} is not a local path")
    path = Path(uri.removeprefix("file://")).expanduser()
    return ((base or Path.cwd()) / path).resolve()


def content_key(stage: str, config: Any, inputs: dict[str, str], code_version: str) -> str:
    """Digest of what determines a stage's output: its config, inputs and code.

    `config` is a pydantic model or a JSON-able value; `inputs` maps input
    names to their own content keys (or URIs); 20 hex chars.
    """
    if hasattr(config, "model_dump"):
        config = config.model_dump(mode="json")
    blob = json.dumps(
        {"stage": stage, "config": config, "inputs": inputs, "code": code_version},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class Storage:
    """fsspec access to the artifact root. Credentials come from the environment."""

    root: str
    endpoint_url: str | None = None
    cache_dir: str = "~/.cache/alignflow"

    @property
    def is_local(self) -> bool:
        return is_local_uri(self.root)

    def _fs(self) -> fsspec.AbstractFileSystem:
        if self.is_local:
            return fsspec.filesystem("file")
        protocol = self.root.split("://", 1)[0]
        options: dict[str, Any] = {}
        if protocol == "s3":
            endpoint = self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL")
            if endpoint:
                options["client_kwargs"] = {"endpoint_url": endpoint}
            # fsspec caches instances by arguments; a fresh listing matters
            # more here than the saved round trip.
            options["skip_instance_cache"] = True
        return fsspec.filesystem(protocol, **options)

    def _root(self) -> str:
        if self.is_local:
            return str(local_path(self.root))
        return self.root.rstrip("/")

    def uri(self, *parts: str) -> str:
        return "/".join([self._root(), *parts])

    def stage_uri(self, stage: str, key: str) -> str:
        return self.uri(stage, key)

    def put_file(self, local: str | Path, uri: str) -> str:
        """Copy one local file to `uri` (under the root; its folder is made); returns `uri`.
        Not part of a committed directory: for reports such as the learning curves."""
        fs = self._fs()
        fs.makedirs(uri.rsplit("/", 1)[0], exist_ok=True)
        fs.put_file(str(local), uri)
        return uri

    # ---- committed directories -------------------------------------------------

    def is_committed(self, uri: str) -> bool:
        return self._fs().exists(f"{uri}/{MANIFEST}")

    def read_manifest(self, uri: str) -> dict[str, Any]:
        fs = self._fs()
        path = f"{uri}/{MANIFEST}"
        if not fs.exists(path):
            raise StorageError(f"{uri} is not a committed artifact (no {MANIFEST})")
        with fs.open(path, "r") as f:
            return json.load(f)

    def commit(self, local_dir: str | Path, uri: str, meta: dict[str, Any] | None = None) -> dict[str, Any]:
        """Upload every file of `local_dir` to `uri`, then the manifest, last."""
        local_dir = Path(local_dir)
        files = sorted(p for p in local_dir.rglob("*") if p.is_file() and p.name != MANIFEST)
        if not files:
            raise StorageError(f"refusing to commit empty directory {local_dir}")
        fs = self._fs()
        fs.makedirs(uri, exist_ok=True)
        entries = {}
        for p in files:
            rel = p.relative_to(local_dir).as_posix()
            entries[rel] = {"size": p.stat().st_size, "sha256": file_digest(p)}
            target = f"{uri}/{rel}"
            if "/" in rel:
                fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
            fs.put_file(str(p), target)
        manifest = {"files": entries, "meta": meta or {}}
        fd, tmp = tempfile.mkstemp(suffix=".json", prefix="alignflow-manifest-")
        try:  # removed on every path, a meta that is not JSON included
            with os.fdopen(fd, "w") as f:
                json.dump(manifest, f, indent=1, sort_keys=True)
            if self.is_local:
                # A local copy is not atomic: copy beside, then rename into place,
                # so a crash never leaves a truncated manifest that looks committed.
                fs.put_file(tmp, f"{uri}/{MANIFEST}.partial")
                os.replace(f"{uri}/{MANIFEST}.partial", f"{uri}/{MANIFEST}")
            else:  # an object-store PUT appears whole or not at all
                fs.put_file(tmp, f"{uri}/{MANIFEST}")
        finally:
            os.unlink(tmp)
        return manifest

    def fetch(self, uri: str, verify: bool = True) -> Path:
        """A local, verified copy of a committed directory.

        Local roots are verified in place; remote ones are downloaded into
        `cache_dir` (reused when already present and verified).
        """
        manifest = self.read_manifest(uri)
        if self.is_local:
            local = Path(uri)
        else:
            digest = hashlib.sha256(uri.encode()).hexdigest()[:24]
            local = Path(self.cache_dir).expanduser() / digest
            if not _matches(local, manifest["files"], check_digest=verify):
                self._download(uri, manifest, local)
        if verify:
            bad = _mismatches(local, manifest["files"])
            if bad:
                raise StorageError(f"{uri}: files do not match the manifest: {', '.join(bad)}")
        return local

    def _download(self, uri: str, manifest: dict[str, Any], local: Path) -> None:
        """Download into a fresh directory beside `local` (same filesystem), then
        rename it into place. Tasks fetching the same artifact at once each
        download; the first rename wins and the others drop their copy."""
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=local.parent, prefix=f".{local.name}-"))
        try:
            fs = self._fs()
            for rel in manifest["files"]:
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(f"{uri}/{rel}", str(tmp / rel))
            if local.exists() and not _matches(local, manifest["files"], check_digest=True):
                shutil.rmtree(local, ignore_errors=True)  # a stale or broken copy
            try:
                os.rename(tmp, local)
            except OSError:
                if not _matches(local, manifest["files"], check_digest=True):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def latest_commit(self, stage: str) -> dict[str, Any] | None:
        """The manifest meta of the most recently committed directory of `stage`, if any."""
        fs = self._fs()
        found = fs.glob(f"{self.uri(stage)}/*/{MANIFEST}", detail=True)
        if not found:
            return None
        newest = max(found, key=lambda path: _modified(found[path]))
        with fs.open(newest, "r") as f:
            return json.load(f).get("meta", {})

    # ---- mid-stage checkpoints ---------------------------------------------------

    def checkpoint_uri(self, stage_uri: str, step: int) -> str:
        return f"{stage_uri}/checkpoints/step-{step:08d}"

    def committed_checkpoints(self, stage_uri: str) -> list[tuple[int, str]]:
        """Every committed mid-stage checkpoint as (step, uri), highest step first."""
        fs = self._fs()
        base = f"{stage_uri}/checkpoints"
        if not fs.exists(base):
            return []
        found = []
        for entry in fs.ls(base, detail=False):
            m = _CHECKPOINT_DIR.search(entry.rstrip("/"))
            if m and fs.exists(f"{entry.rstrip('/')}/{MANIFEST}"):
                found.append((int(m.group(1)), self._normalize(entry.rstrip("/"))))
        return sorted(found, reverse=True)

    def latest_checkpoint(self, stage_uri: str) -> tuple[int, str] | None:
        """The committed mid-stage checkpoint with the highest step, if any (not verified)."""
        found = self.committed_checkpoints(stage_uri)
        return found[0] if found else None

    def latest_valid_checkpoint(self, stage_uri: str) -> tuple[int, str, Path] | None:
        """The newest committed checkpoint whose files match its manifest, as (step, uri, local copy).

        One that fails verification (a file corrupted or lost after the commit)
        is skipped, with a warning, for the one before it; None if none is left.
        """
        for step, uri in self.committed_checkpoints(stage_uri):
            try:
                return step, uri, self.fetch(uri, verify=True)
            except (StorageError, ValueError, KeyError) as err:  # ValueError: a manifest that is not JSON
                log.warning("skipping checkpoint %s (step %d), it fails verification: %s", uri, step, err)
        return None

    def prune_checkpoints(self, stage_uri: str, keep_step: int | None = None) -> None:
        """Remove mid-stage checkpoints (all, or all but `keep_step`)."""
        fs = self._fs()
        base = f"{stage_uri}/checkpoints"
        if not fs.exists(base):
            return
        for entry in fs.ls(base, detail=False):
            m = _CHECKPOINT_DIR.search(entry.rstrip("/"))
            if m and int(m.group(1)) != keep_step:
                fs.rm(entry, recursive=True)

    def _normalize(self, path: str) -> str:
        """fsspec listings drop the protocol; put it back for remote roots."""
        if self.is_local or "://" in path:
            return path
        return f"{self.root.split('://', 1)[0]}://{path}"


def _modified(info: dict[str, Any]) -> float:
    """Modification time of an fsspec listing entry (local: mtime; S3: LastModified)."""
    stamp = info.get("mtime", info.get("LastModified", 0))
    return stamp.timestamp() if hasattr(stamp, "timestamp") else float(stamp)


def _mismatches(local: Path, files: dict[str, dict[str, Any]], check_digest: bool = True) -> list[str]:
    bad = []
    for rel, info in files.items():
        p = local / rel
        if not p.is_file() or p.stat().st_size != info["size"]:
            bad.append(f"{rel} (missing or wrong size)")
        elif check_digest and file_digest(p) != info["sha256"]:
            bad.append(f"{rel} (sha256 mismatch)")
    return bad


def _matches(local: Path, files: dict[str, dict[str, Any]], check_digest: bool) -> bool:
    return local.is_dir() and not _mismatches(local, files, check_digest)
