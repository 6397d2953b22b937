"""User data in the usual shapes, normalised and validated row by row.

Canonical records (what every later stage reads, as JSONL):

- sft:        {"prompt": P, "response": str}
- preference: {"prompt": P, "chosen": str, "rejected": str}
- prompts:    {"prompt": P, "answer": str | None}   (RL prompts, eval prompts)

where P is a plain string (used verbatim) or a list of chat messages
(`{"role", "content"}`), rendered later with the tokenizer's chat template.
Sources are JSONL, JSON, Parquet (local or any fsspec URI) or a `datasets`
name. A bad row fails with file, row and key; an empty dataset fails.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Literal

from alignflow.config import DatasetSource
from alignflow.errors import DataError

Kind = Literal["sft", "preference", "prompts"]


def read_rows(src: DatasetSource) -> Iterable[dict[str, Any]]:
    """Raw rows of a source, in order."""
    path = src.path
    if path.endswith((".jsonl", ".json", ".parquet")):
        import fsspec

        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            with fsspec.open(path, "rb") as f:
                yield from pq.read_table(f).to_pylist()
            return
        with fsspec.open(path, "r") as f:
            if path.endswith(".json"):
                data = json.load(f)
                if not isinstance(data, list):
                    raise DataError(f"{path}: a .json dataset must hold a list of rows")
                yield from data
                return
            # Rows are counted as load_records counts them (blank lines skipped),
            # so every error about one file numbers its rows the same way.
            row = 0
            for line in f:
                if not line.strip():
                    continue
                row += 1
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}, row {row}: not valid JSON ({err.msg})") from None
        return
    import datasets

    yield from datasets.load_dataset(path, src.name, split=src.split)


def _prompt(row: dict, src: DatasetSource, where: str) -> str | list[dict]:
    value = row.get(src.prompt_key)
    if value is None:
        raise DataError(f"{where}: missing key {src.prompt_key!r}")
    return _check_prompt(value, where, src.prompt_key)


def _check_prompt(value: Any, where: str, key: str) -> str | list[dict]:
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: key {key!r} is an empty string")
        return value
    if isinstance(value, list) and value:
        for i, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DataError(f"{where}: key {key!r}, message {i} needs string 'role' and 'content'")
        return value
    raise DataError(f"{where}: key {key!r} must be a string or a list of chat messages, got {type(value).__name__}")


def _text(row: dict, key: str, where: str) -> str:
    value = row.get(key)
    if value is None:
        raise DataError(f"{where}: missing key {key!r}")
    if isinstance(value, list) and value and isinstance(value[-1], dict):
        value = value[-1].get("content")  # a conversation: its last (assistant) turn
    if not isinstance(value, str):
        raise DataError(f"{where}: key {key!r} must be a string, got {type(value).__name__}")
    return value


def _split_messages(row: dict, src: DatasetSource, where: str) -> tuple[list[dict], str]:
    """A chat row -> (prompt messages, final assistant reply)."""
    messages = _check_prompt(row.get(src.messages_key), where, src.messages_key)
    if isinstance(messages, str) or messages[-1]["role"] != "assistant" or len(messages) < 2:
        raise DataError(f"{where}: key {src.messages_key!r} must end with an assistant message after a prompt")
    return messages[:-1], messages[-1]["content"]


def normalize_row(row: Any, kind: Kind, src: DatasetSource, where: str) -> dict[str, Any]:
    """One raw row -> its canonical record, or a DataError naming the row and key."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be an object, got {type(row).__name__}")
    if kind == "sft":
        if src.messages_key:
            prompt, response = _split_messages(row, src, where)
        else:
            prompt, response = _prompt(row, src, where), _text(row, src.response_key, where)
        return {"prompt": prompt, "response": response}
    if kind == "preference":
        return {
            "prompt": _prompt(row, src, where),
            "chosen": _text(row, src.chosen_key, where),
            "rejected": _text(row, src.rejected_key, where),
        }
    if src.messages_key:
        prompt = _check_prompt(row.get(src.messages_key), where, src.messages_key)
    else:
        prompt = _prompt(row, src, where)
    answer = row.get(src.answer_key) if src.answer_key else None
    return {"prompt": prompt, "answer": None if answer is None else str(answer)}


def load_records(src: DatasetSource, kind: Kind) -> list[dict[str, Any]]:
    """All rows of `src` as canonical records; fails on the first bad row or if empty."""
    records = [
        normalize_row(row, kind, src, where=f"{src.path}, row {i}")
        for i, row in enumerate(read_rows(src), start=1)
    ]
    if not records:
        raise DataError(f"{src.path}: dataset is empty")
    return records


def write_jsonl(records: list[dict], path: str) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
