"""Preflight's data checks (alignflow/preflight.py): each data file a config names exists, and every row
of a local one (of a remote one, the first `data.preflight_rows`) parses as its kind's row."""

from __future__ import annotations

from itertools import islice

import fsspec

from alignflow.config import DatasetSource, PipelineConfig
from alignflow.data.formats import normalize_row, read_rows
from alignflow.errors import DataError
from alignflow.storage import is_local_uri, local_path

MAX_BAD_ROWS = 10  # listed per file; the rest are counted


def check_files(cfg: PipelineConfig, found) -> None:
    """The data files, into preflight's `found` (a Findings)."""
    if cfg.data.source != "files":
        return
    for name, kind in (("sft", "sft"), ("preference", "preference"), ("prompts", "prompts"), ("eval", "prompts")):
        src: DatasetSource | None = getattr(cfg.data, name)
        if src is None or not src.path.endswith((".jsonl", ".json", ".parquet")):
            continue  # a `datasets` name: loading it may download it; the data stage reports it
        field, path = f"data.{name}.path", src.path
        try:
            exists = local_path(path).is_file() if is_local_uri(path) else fsspec.core.url_to_fs(path)[0].exists(path)
        except Exception as err:  # noqa: BLE001  (any filesystem's failure is the user's to see)
            found.fail(field, f"{path} cannot be reached: {type(err).__name__}: {err}")
            continue
        if not exists:
            found.fail(field, f"{path} does not exist")
            continue
        limit = None if is_local_uri(path) else cfg.data.preflight_rows
        try:
            n, bad = _rows(src, kind, limit)
        except Exception as err:  # noqa: BLE001  (a corrupt Parquet file, a bad encoding, ...)
            found.fail(field, f"{path} cannot be read: {type(err).__name__}: {err}")
            continue
        for text in bad[:MAX_BAD_ROWS]:
            found.fail(f"data.{name}", text)
        if len(bad) > MAX_BAD_ROWS:
            found.fail(f"data.{name}", f"{path}: {len(bad) - MAX_BAD_ROWS} more bad rows (of {n} read)")
        if not bad:
            found.ok() if n else found.fail(field, f"{path} holds no rows")
        if limit is not None and n == limit:
            found.notes.append(f"data.{name}: {path} is remote, so its first {limit} rows were checked "
                               "(data.preflight_rows); the data stage checks the rest")


def _rows(src: DatasetSource, kind: str, limit: int | None) -> tuple[int, list[str]]:
    """(rows read, one message per bad row): every row, or the first `limit`. A row that is not JSON ends
    the file's reading (the next rows cannot be told apart)."""
    rows, bad, n = read_rows(src), [], 0
    try:
        for n, row in enumerate(islice(rows, limit) if limit else rows, start=1):
            try:
                normalize_row(row, kind, src, where=f"{src.path}, row {n}")
            except DataError as err:
                bad.append(str(err))
    except DataError as err:  # from read_rows: not JSON, not a list
        bad.append(str(err))
    return n, bad
