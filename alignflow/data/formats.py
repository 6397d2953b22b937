"""User data in the usual shapes, read row by row (rows.py normalises and validates each row).

Canonical records (what every later stage reads, as JSONL):

- sft:        {"prompt": P, "response": str}
- preference: {"prompt": P, "chosen": str, "rejected": str}
              or, unpaired (KTO), {"prompt": P, "response": str, "label": bool}
- prompts:    {"prompt": P, "answer": str | None, ...}   (RL prompts, eval prompts; the row's other
              columns too, for an environment's `reset(sample)` or an agent: `tools`, a lookup table)
- process:    {"prompt": P, "steps": [str, ...], "labels": [bool, ...]}   (a process reward model's
              step-labelled solutions: each step ends with the source's `step_separator`)

where P is a plain string (used verbatim) or a list of chat messages
(`{"role", "content"}`), rendered later with the tokenizer's chat template.
Sources are JSONL, JSON, Parquet (local or any fsspec URI) or a `datasets`
name. A bad row fails with file, row and key; an empty dataset fails.

Row shapes, per row (key names are DatasetSource fields; no key is guessed):

- sft: `prompt_key` + `response_key` columns (OpenRLHF's input/output: set
  them to "input"/"output"), or with `messages_key` one conversation whose
  last (assistant) message is the response.
- preference: `prompt_key` + `chosen_key` + `rejected_key`; chosen/rejected
  are strings or conversations ending with the assistant reply. A
  conversation's earlier messages must be the prompt's, or end with a user
  message saying the prompt string (UltraFeedback's shape): the prompt is
  then those messages, rendered with the chat template. Without the prompt key in a row, chosen/rejected are whole
  dialogues and the prompt is what they share: strings (Anthropic HH) split
  after their last `assistant_marker` (prompt keeps the marker; replies stay
  verbatim, leading space included, so prompt + reply is the dialogue);
  message lists split before their last message. Different prompts fail.
  With `label_key` set, a row holding that key is an unpaired example:
  `prompt_key`, `response_key` and a true/false label.
- prompts: `prompt_key` (or the whole `messages_key` list), `answer_key` if any.
- process: `prompt_key` (or `messages_key`), `steps_key` (a list of non-empty
  strings) and `labels_key` (as many true/false, or 1/0) (TRL's stepwise
  supervision: prompt, completions, labels).

A row that fits none fails with the key it lacks, what to set, and its keys.
"""

from __future__ import annotations

import codecs
import io
import json
from collections.abc import Iterable
from typing import Any, Literal

from alignflow.config import DatasetSource
from alignflow.errors import DataError

Kind = Literal["sft", "preference", "prompts", "process"]
FILE_FORMATS = (".jsonl", ".json", ".parquet")


def file_format(path: str) -> str | None:
    """The file format a data path names by its ending, in any case (`.jsonl`, `.json`, `.parquet`); None: not
    one of them, so the path is read as a `datasets` name (or a directory `datasets` loads)."""
    lower = path.lower()
    return next((suffix for suffix in FILE_FORMATS if lower.endswith(suffix)), None)


def read_rows(src: DatasetSource) -> Iterable[dict[str, Any]]:
    """Raw rows of a source, in order."""
    path, suffix = src.path, file_format(src.path)
    if suffix:
        import fsspec

        if suffix == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            with fsspec.open(path, "rb") as f:
                try:
                    table = pq.read_table(f)
                except pa.ArrowException as err:  # not Parquet, cut short, a codec it lacks
                    raise DataError(f"{path}: not a Parquet file it can read ({type(err).__name__}: {err})") from None
            yield from table.to_pylist()
            return
        if suffix == ".json":
            with fsspec.open(path, "rb") as f:
                raw = f.read()
            try:
                data = json.loads(_decoded(raw, path, first=True), object_pairs_hook=_unique_keys)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}: not valid JSON ({err.msg}, line {err.lineno})") from None
            except _DuplicateKey as err:
                raise DataError(f"{path}: a row gives the key {err.args[0]!r} twice (JSON keeps the last "
                                f"silently): give it once") from None
            if not isinstance(data, list):
                raise DataError(f"{path}: a .json dataset must hold a list of rows")
            yield from data
            return
        # Rows are counted as load_records counts them (blank lines skipped), so every error about one file
        # numbers its rows the same way. Each line is decoded alone: an encoding error names its row. (A
        # remote file's own line iterator reads a whole block per line; a BufferedReader reads each once.)
        row = 0
        with fsspec.open(path, "rb") as f:
            for raw in io.BufferedReader(f):
                if not raw.strip():
                    continue
                row += 1
                try:
                    record = json.loads(_decoded(raw, f"{path}, row {row}", first=row == 1),
                                        object_pairs_hook=_unique_keys)
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}, row {row}: not valid JSON ({err.msg})") from None
                except _DuplicateKey as err:
                    raise DataError(f"{path}, row {row}: the key {err.args[0]!r} is given twice (JSON keeps the "
                                    f"last silently): give it once") from None
                yield record
        return
    import datasets

    yield from datasets.load_dataset(path, src.name, split=src.split)


def _decoded(raw: bytes, where: str, first: bool) -> str:
    """UTF-8 (a byte-order mark before a file's first row dropped), or a DataError naming where the bytes came
    from and the first one that is not, at its offset in `raw`."""
    skip = len(codecs.BOM_UTF8) if first and raw.startswith(codecs.BOM_UTF8) else 0
    try:
        return raw[skip:].decode("utf-8")
    except UnicodeDecodeError as err:
        at = skip + err.start
        raise DataError(f"{where}: not UTF-8 text (byte {raw[at]:#04x} at offset {at})") from None


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out
