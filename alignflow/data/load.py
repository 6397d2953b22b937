"""Canonical records (alignflow/data/formats.py says their shapes) of a whole data file, and the JSONL the
data stage keeps them in."""

from __future__ import annotations

import json
import logging
from typing import Any

from alignflow.config import DatasetSource
from alignflow.data.formats import Kind, read_rows
from alignflow.data.rows import normalize_row
from alignflow.errors import DataError

log = logging.getLogger("alignflow")


def load_records(src: DatasetSource, kind: Kind) -> list[dict[str, Any]]:
    """All rows of `src` as canonical records; fails on the first bad row or if empty. A prompt row keeps its
    other columns (an environment reads its sample; an agent its `tools`), an SFT or preference row its `tools`
    (the chat template renders them, as it does for the policy's prompts). A value JSON cannot hold (a Parquet
    timestamp) is left out, and said."""
    records, unkept, used = [], {}, {src.prompt_key, src.messages_key, src.answer_key}
    for i, row in enumerate(read_rows(src), start=1):
        record = normalize_row(row, kind, src, where=f"{src.path}, row {i}")
        kept = ([k for k in row if k not in used] if kind == "prompts"
                else ["tools"] if "tools" in row else [])  # SFT and preference prompts render with them
        for key, value in ((k, row[k]) for k in kept):
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                unkept.setdefault(key, i)
                continue
            record.setdefault(key, _tools(value, f"{src.path}, row {i}") if key == "tools" else value)
        records.append(record)
    if not records:
        raise DataError(f"{src.path}: dataset is empty")
    if unkept:
        log.warning("%s: columns %s are not JSON values (first in rows %s) and are not kept with the records",
                    src.path, sorted(unkept), sorted(set(unkept.values())))
    return records


def _tools(value: Any, where: str) -> list[dict]:
    """A row's `tools`: the JSON schemas the chat template renders, as a list or as its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise DataError(f"{where}: 'tools' is text that is not JSON") from None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise DataError(f"{where}: 'tools' must be a list of tool schemas (objects), got {type(value).__name__}")
    return value


def held_out_count(n: int) -> int:
    """Rows of a split of `n` that the data stages hold out for evaluation (preference pairs, step-labelled
    solutions; by prompt, so about that many): a tenth, at least one of any."""
    return max(1, n // 10) if n else 0


def write_jsonl(records: list[dict], path: str) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
