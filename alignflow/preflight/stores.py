"""Preflight's stores: the storage root takes a probe object, and a SQLite tracking file's directory a probe
file; on a Ray cluster, the local paths a run reads and writes are said."""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

import fsspec  # imported by alignflow.store.storage anyway

from alignflow.config import PipelineConfig
from alignflow.tracking.params import sqlite_file
from alignflow.preflight.findings import Findings
from alignflow.store.storage import is_local_uri, local_path


def _unwritable(path: Path) -> str | None:
    """Why a probe file cannot be written into `path` (made if missing); None where it can. The probe, and the
    directories made for it, are removed again."""
    created: list[Path] = []
    try:
        created = [p for p in (path, *path.parents) if not p.exists()]  # deepest first
        path.mkdir(parents=True, exist_ok=True)
        (probe := path / f".preflight-{uuid.uuid4().hex}").write_bytes(b"ok")
        probe.unlink()
    except OSError as err:  # a directory on the way that is a file, or that cannot be entered
        at = f" ({err.filename})" if err.filename and str(err.filename) != str(path) else ""
        return f"{err.strerror or err}{at}"
    finally:
        for p in created:
            with contextlib.suppress(OSError):
                p.rmdir()
    return None


def check_tracking_store(cfg: PipelineConfig, found: Findings) -> None:
    """A SQLite tracking file's directory takes a probe, and the file, where it exists, is a writable file
    (MLflow makes the file and its tables as the run starts). A tracking server, or another database, is the
    flow's to open: its errors are the run's."""
    field, uri = "infra.mlflow_tracking_uri", cfg.infra.mlflow_tracking_uri
    if (file := sqlite_file(uri)) is None:
        return
    path = local_path(str(file))
    if why := _unwritable(path.parent):
        return found.fail(field, f"{uri}: its directory {path.parent} is not writable: {why}")
    if path.exists() and not (path.is_file() and os.access(path, os.W_OK)):
        return found.fail(field, f"{uri}: {path} is not a writable file")
    found.ok()


def check_storage(cfg: PipelineConfig, found: Findings) -> None:
    field, root, probe = "infra.storage.root", cfg.infra.storage.root, f".preflight-{uuid.uuid4().hex}"
    if is_local_uri(root):
        if why := _unwritable(local_path(root)):
            return found.fail(field, f"{root} is not writable: {why}")
        return found.ok()
    protocol, uri, options = root.split("://", 1)[0], f"{root.rstrip('/')}/{probe}", {}
    if protocol == "s3":  # as alignflow/store/storage.py Storage._fs, with short timeouts and one retry
        endpoint = cfg.infra.storage.endpoint_url or os.environ.get("AWS_ENDPOINT_URL")
        options = {"skip_instance_cache": True, "client_kwargs": {"endpoint_url": endpoint} if endpoint else {},
                   "config_kwargs": {"connect_timeout": 5, "read_timeout": 10, "retries": {"max_attempts": 2}}}
    try:
        fs = fsspec.filesystem(protocol, **options)
        fs.pipe(uri, b"ok")
        fs.rm(uri)
    except Exception as err:  # noqa: BLE001  (credentials, endpoint, bucket: the user's to fix)
        return found.fail(field, f"{root} does not take a probe object: {type(err).__name__}: {err}")
    found.ok()


def note_local_paths_on_cluster(cfg: PipelineConfig, found: Findings) -> None:
    """On a Ray cluster (infra.ray_address) a stage, and each of its actors, may run on another node than this
    one, where a local path a run reads (a data file, a model directory) or writes (a SQLite tracking file) is
    another file, or none: said, as the run's start says it of a local storage root. Not refused: a filesystem
    every node mounts at the same path serves."""
    if not cfg.infra.ray_address:
        return
    named = list(cfg.data.sources().items())
    named += [("model.base", cfg.model.base)] * (cfg.model.base != "tiny")
    named += [(f"rounds.{i}.teacher", r.teacher) for i, r in enumerate(cfg.rounds) if r.teacher]
    named += [(f"rounds.{i}.reward.judge.model", r.reward.judge.model) for i, r in enumerate(cfg.rounds)
              if r.reward.uses_judge and r.reward.judge.model]
    named += [("distill.teacher", cfg.distill.teacher)] if cfg.distill is not None else []
    local = [f"{field} ({path})" for field, path in named if is_local_uri(path) and local_path(path).exists()]
    if (file := sqlite_file(cfg.infra.mlflow_tracking_uri)) is not None:
        local.append(f"infra.mlflow_tracking_uri ({file}: one SQLite database per node)")
    if local:
        found.notes.append(f"infra.ray_address {cfg.infra.ray_address}: stages and actors run on any node of the "
                           f"cluster, where these local paths must be the same files (a filesystem every node "
                           f"mounts), or be in an object store or on a tracking server: {'; '.join(local)}")
