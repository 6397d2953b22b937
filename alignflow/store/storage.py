"""Artifacts under one root URI (local directory or s3://bucket/prefix).

Layout: `{root}/{stage}/{key}/` where `key` is a content key (tasks/plan.py; stage config +
input keys + code version). A directory is *committed* when its
`manifest.json` exists; the manifest is written last, after every file, and
lists each file's size and sha256. Readers accept only committed directories
and verify them, so a crash mid-upload never looks finished.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
from filelock import FileLock

# Raised here, and imported from here by the modules that catch them.
from alignflow.store.faults import CORRUPT, CorruptArtifact, StorageError  # noqa: F401

MANIFEST = "manifest.json"
CACHE_ENV = "ALIGNFLOW_CACHE_DIR"  # a node's own cache directory (Storage.node_cache)
log = logging.getLogger("alignflow")
_CHECKPOINT_DIR = re.compile(r"step-(\d+)$")


def is_local_uri(uri: str) -> bool:
    """The one rule: a path without a scheme, or a file:// URI, is local."""
    return "://" not in uri or uri.startswith("file://")


def local_path(uri: str, base: Path | None = None) -> Path:
    """A local URI as an absolute path (`~` expanded, relative to `base` or the cwd)."""
    if not is_local_uri(uri):
        raise StorageError(f"{uri} is not a local path")
    path = Path(uri.removeprefix("file://")).expanduser()
    return ((base or Path.cwd()) / path).resolve()


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
        if protocol == "s3":  # skip_instance_cache: a fresh listing matters more than fsspec's cached instance
            endpoint = self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL")
            options = {"skip_instance_cache": True, "client_kwargs": {"endpoint_url": endpoint} if endpoint else {}}
        return fsspec.filesystem(protocol, **options)

    def _root(self) -> str:
        return str(local_path(self.root)) if self.is_local else self.root.rstrip("/")

    def uri(self, *parts: str) -> str:
        return "/".join([self._root(), *parts])

    def stage_uri(self, stage: str, key: str) -> str:
        return self.uri(stage, key)

    def put_file(self, local: str | Path, uri: str) -> str:
        """Copy one local file to `uri` (under the root; its folder is made); returns `uri`.
        Not part of a committed directory: for reports such as the learning curves."""
        (fs := self._fs()).makedirs(uri.rsplit("/", 1)[0], exist_ok=True)
        fs.put_file(str(local), uri)
        return uri

    # ---- committed directories -------------------------------------------------

    def is_committed(self, uri: str) -> bool:
        return self._fs().exists(f"{uri}/{MANIFEST}")

    def unstored(self, uri: str, which: Callable[[str], bool] = lambda rel: True) -> list[str]:
        """The files of committed `uri`'s manifest (those `which` selects) not stored at their size: one listing.
        StorageError where `uri` was never committed."""
        files = self.read_manifest(uri)["files"]
        sizes = {self._normalize(p): i["size"] for p, i in self._fs().find(uri, detail=True).items()}
        return [r for r, f in files.items() if which(r) and sizes.get(f"{uri}/{r}") != f["size"]]

    def set_aside(self, uri: str) -> str:
        """Uncommit `uri`, its files kept for a look: its manifest becomes `manifest.corrupt.json` (returned)."""
        self._fs().mv(f"{uri}/{MANIFEST}", aside := f"{uri}/manifest.corrupt.json")
        return aside

    def read_manifest(self, uri: str) -> dict[str, Any]:
        fs = self._fs()
        path = f"{uri}/{MANIFEST}"
        if not fs.exists(path):
            raise StorageError(f"{uri} is not a committed artifact (no {MANIFEST})")
        with fs.open(path, "r") as f:
            return json.load(f)

    def upload(self, local_dir: str | Path, uri: str) -> dict[str, dict[str, Any]]:
        """Copy every file of `local_dir` under `uri`, uncommitted (no manifest); their manifest entries.
        An actor uploads what it wrote on its own node this way (alignflow/store/artifacts.py: writing)."""
        local_dir = Path(local_dir)
        files = sorted(p for p in local_dir.rglob("*") if p.is_file() and p.name != MANIFEST)
        fs = self._fs()
        fs.makedirs(uri, exist_ok=True)
        entries = {(rel := p.relative_to(local_dir).as_posix()): {"size": p.stat().st_size, "sha256": file_digest(p)}
                   for p in files}
        for rel in entries:
            if "/" in rel:
                fs.makedirs(f"{uri}/{rel}".rsplit("/", 1)[0], exist_ok=True)
            fs.put_file(str(local_dir / rel), f"{uri}/{rel}")
        return entries

    def commit(self, local_dir: str | Path | None, uri: str, meta: dict[str, Any] | None = None,
               uploaded: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
        """Upload every file of `local_dir` (if any) to `uri`, then the manifest, last. `uploaded`: entries
        of files already under `uri` (uploaded by actors, from their nodes), listed in the manifest too."""
        entries = dict(uploaded or {})
        for rel, entry in (self.upload(local_dir, uri) if local_dir is not None else {}).items():
            if rel in entries:
                raise StorageError(f"{uri}/{rel} was written by an actor and by the task")
            entries[rel] = entry
        if not entries:
            raise StorageError(f"refusing to commit {uri} with no files (written into {local_dir} or uploaded)")
        fs = self._fs()
        manifest = {"files": dict(sorted(entries.items())), "meta": meta or {}}
        fd, tmp = tempfile.mkstemp(suffix=".json", prefix="alignflow-manifest-")
        try:  # removed on every path, a meta that is not JSON included
            with os.fdopen(fd, "w") as f:
                json.dump(manifest, f, indent=1, sort_keys=True)
            if self.is_local:  # a copy is not atomic: copied beside, then renamed, never a truncated manifest
                fs.put_file(tmp, f"{uri}/{MANIFEST}.partial")
                os.replace(f"{uri}/{MANIFEST}.partial", f"{uri}/{MANIFEST}")
            else:  # an object-store PUT appears whole or not at all
                fs.put_file(tmp, f"{uri}/{MANIFEST}")
        finally:
            os.unlink(tmp)
        return manifest

    def node_cache(self) -> Path:
        """This node's cache of remote artifacts: $ALIGNFLOW_CACHE_DIR where the node sets it (each
        node of a cluster its own disk), else `cache_dir`."""
        return Path(os.environ.get(CACHE_ENV) or self.cache_dir).expanduser()

    def fetch(self, uri: str, verify: bool = True, skip: tuple[str, ...] = (), under: str = "") -> Path:
        """A local, verified copy of a committed directory, on this node. Local roots are verified in
        place; remote ones are downloaded into `node_cache()` (reused when present and verified; one
        process of a node downloads, the others then reuse its copy). `skip`: file-name patterns left
        out (a tokenizer without the weights); `under`: only the files below that subdirectory."""
        files = {rel: f for rel, f in self.read_manifest(uri)["files"].items()
                 if rel.startswith(f"{under}/" if under else "") and not _skipped(rel, skip)}
        if self.is_local:
            local, fresh = Path(uri), True
        else:
            parts = [uri, *skip, *([f"under={under}"] if under else [])]
            local = self.node_cache() / hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]
            local.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(f"{local}.lock"):
                fresh = not _matches(local, files, check_digest=verify)  # a copy that matches is verified
                if fresh:
                    self._download(uri, files, local)
        bad = _mismatches(local, files) if verify and fresh else []
        if bad:
            raise CorruptArtifact(f"{uri}{CORRUPT}{', '.join(bad)}")
        return local

    def _download(self, uri: str, files: dict[str, Any], local: Path) -> None:
        """Download into a fresh directory beside `local`, then rename it into place. Processes fetching
        the same artifact at once each download; the first rename wins, the others drop their copy."""
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=local.parent, prefix=f".{local.name}-"))
        try:
            fs = self._fs()
            for rel in files:
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                try:
                    fs.get_file(f"{uri}/{rel}", str(tmp / rel))
                except FileNotFoundError:  # lost after the commit (a lifecycle rule, a cleanup): corrupt, as locally
                    raise CorruptArtifact(f"{uri}{CORRUPT}{rel} (not stored)") from None
            if local.exists() and not _matches(local, files, check_digest=True):
                shutil.rmtree(local, ignore_errors=True)  # a stale or broken copy
            try:
                os.rename(tmp, local)
            except OSError:
                if not _matches(local, files, check_digest=True):
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
        fs, base, found = self._fs(), f"{stage_uri}/checkpoints", []
        if not fs.exists(base):
            return []
        for entry in fs.ls(base, detail=False):
            m = _CHECKPOINT_DIR.search(entry.rstrip("/"))
            if m and fs.exists(f"{entry.rstrip('/')}/{MANIFEST}"):
                found.append((int(m.group(1)), self._normalize(entry.rstrip("/"))))
        return sorted(found, reverse=True)

    def latest_valid_checkpoint(self, stage_uri: str, skip: tuple[str, ...] = ()) -> tuple[int, str, Path] | None:
        """The newest committed checkpoint whose files match its manifest, as (step, uri, local copy).

        One that fails verification (a file corrupted or lost after the commit) is skipped, with a
        warning, for the one before it; None if none is left. `skip`: files not downloaded here, whose
        stored sizes alone are checked (the actors that load them verify them on their own nodes).
        """
        for step, uri in self.committed_checkpoints(stage_uri):
            try:
                local = self.fetch(uri, verify=True, skip=skip)
                if bad := self.unstored(uri, lambda rel: _skipped(rel, skip)):
                    raise CorruptArtifact(f"{uri}: stored files missing or of the wrong size: {', '.join(bad)}")
                return step, uri, local
            except (StorageError, ValueError, KeyError) as err:  # ValueError: a manifest that is not JSON
                log.warning("skipping checkpoint %s (step %d), it fails verification: %s", uri, step, err)
        return None

    def prune_checkpoints(self, stage_uri: str, keep_step: int | None = None) -> None:
        """Remove mid-stage checkpoints: all, or all but `keep_step` and the newest committed one before it, which
        a resume falls back to where `keep_step`'s fails verification (a lost or corrupted file)."""
        fs, base = self._fs(), f"{stage_uri}/checkpoints"
        if not fs.exists(base):
            return
        steps = {int(m.group(1)): e.rstrip("/") for e in fs.ls(base, detail=False)
                 if (m := _CHECKPOINT_DIR.search(e.rstrip("/")))}
        keep = {keep_step} if keep_step is not None else set()
        for step in sorted((s for s in steps if keep_step is not None and s < keep_step), reverse=True):
            if fs.exists(f"{steps[step]}/{MANIFEST}"):  # the newest committed one before it: one listing in all
                keep.add(step)
                break
        for step, entry in steps.items():
            if step not in keep:
                fs.rm(entry, recursive=True)

    def _normalize(self, path: str) -> str:
        """fsspec listings drop the protocol; put it back for remote roots."""
        return path if self.is_local or "://" in path else f"{self.root.split('://', 1)[0]}://{path}"


def _skipped(rel: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(rel.rsplit("/", 1)[-1], pattern) for pattern in patterns)


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
