"""User data in the usual shapes, normalised and validated row by row.

Canonical records (what every later stage reads, as JSONL):

- sft:        {"prompt": P, "response": str}
- preference: {"prompt": P, "chosen": str, "rejected": str}
              or, unpaired (KTO), {"prompt": P, "response": str, "label": bool}
- prompts:    {"prompt": P, "answer": str | None, ...}   (RL prompts, eval prompts; the row's other
              columns too, for an environment's `reset(sample)` or an agent: `tools`, a lookup table)

where P is a plain string (used verbatim) or a list of chat messages
(`{"role", "content"}`), rendered later with the tokenizer's chat template.
Sources are JSONL, JSON, Parquet (local or any fsspec URI) or a `datasets`
name. A bad row fails with file, row and key; an empty dataset fails.

Row shapes, per row (key names are DatasetSource fields; no key is guessed):

- sft: `prompt_key` + `response_key` columns (OpenRLHF's input/output: set
  them to "input"/"output"), or with `messages_key` one conversation whose
  last (assistant) message is the response.
- preference: `prompt_key` + `chosen_key` + `rejected_key`; chosen/rejected
  are strings or conversations ending with the assistant reply (only that
  reply is kept). Without the prompt key in a row, chosen/rejected are whole
  dialogues and the prompt is what they share: strings (Anthropic HH) split
  after their last `assistant_marker` (prompt keeps the marker; replies stay
  verbatim, leading space included, so prompt + reply is the dialogue);
  message lists split before their last message. Different prompts fail.
  With `label_key` set, a row holding that key is an unpaired example:
  `prompt_key`, `response_key` and a true/false label.
- prompts: `prompt_key` (or the whole `messages_key` list), `answer_key` if any.

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

Kind = Literal["sft", "preference", "prompts"]


def read_rows(src: DatasetSource) -> Iterable[dict[str, Any]]:
    """Raw rows of a source, in order."""
    path = src.path
    if path.endswith((".jsonl", ".json", ".parquet")):
        import fsspec

        if path.endswith(".parquet"):
            import pyarrow as pa
            import pyarrow.parquet as pq

            with fsspec.open(path, "rb") as f:
                try:
                    table = pq.read_table(f)
                except pa.ArrowException as err:  # not Parquet, cut short, a codec it lacks
                    raise DataError(f"{path}: not a Parquet file it can read ({type(err).__name__}: {err})") from None
            yield from table.to_pylist()
            return
        if path.endswith(".json"):
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


# Where each kind's source sits in the config, for the hints in errors.
_SECTION = {"sft": "data.sft", "preference": "data.preference", "prompts": "data.prompts / data.eval"}


def _keys(row: dict) -> str:
    return f"this row has keys: {sorted(str(k) for k in row)}"


def _need(row: dict, key: str, where: str, hint: str) -> Any:
    """row[key]; if absent, a DataError with what else to set and the keys the row has."""
    value = row.get(key)
    if value is None:
        raise DataError(f"{where}: missing key {key!r} ({hint}); {_keys(row)}")
    return value


ROLES = ("system", "user", "assistant", "tool", "developer", "ipython")  # what chat templates know


def _check_prompt(value: Any, where: str, key: str) -> str | list[dict]:
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: key {key!r} is an empty string")
        return value
    if isinstance(value, list) and value:
        for i, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DataError(f"{where}: key {key!r}, message {i} needs string 'role' and 'content'")
            if m["role"] not in ROLES:  # ShareGPT's human/gpt, say: a chat template renders them as text or fails
                raise DataError(f"{where}: key {key!r}, message {i} has role {m['role']!r}, not one of "
                                f"{', '.join(ROLES)}")
        return value
    raise DataError(f"{where}: key {key!r} must be a string or a list of chat messages, got {type(value).__name__}")


def _prompt(value: Any, where: str, key: str) -> str | list[dict]:
    """A prompt: text, or messages that do not end with a reply (the generation prompt follows them)."""
    prompt = _check_prompt(value, where, key)
    if isinstance(prompt, list) and prompt[-1]["role"] == "assistant":
        raise DataError(f"{where}: key {key!r} ends with an assistant message: a prompt ends before the reply it "
                        "asks for (is this a whole dialogue, reply included?)")
    return prompt


def _reply(value: list, key: str, where: str) -> str:
    """The assistant reply that ends a conversation."""
    messages = _check_prompt(value, where, key)
    if messages[-1]["role"] != "assistant":
        raise DataError(f"{where}: key {key!r} must end with an assistant message (the reply)")
    if not messages[-1]["content"].strip():
        raise DataError(f"{where}: key {key!r} ends with an empty assistant message (the reply)")
    return messages[-1]["content"]


def _text(row: dict, key: str, where: str, hint: str) -> str:
    """A response: a string, or a conversation whose last (assistant) message is the response."""
    value = _need(row, key, where, hint)
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        return _reply(value, key, where)
    if not isinstance(value, str):
        raise DataError(f"{where}: key {key!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise DataError(f"{where}: key {key!r} is an empty response")
    return value


def _split_messages(row: dict, src: DatasetSource, where: str, section: str) -> tuple[list[dict], str]:
    """A chat row -> (prompt messages, final assistant reply)."""
    key = src.messages_key
    value = _need(row, key, where, f"or set messages_key under {section}, or unset it for prompt/response columns")
    messages = _check_prompt(value, where, key)
    if isinstance(messages, str) or messages[-1]["role"] != "assistant" or len(messages) < 2:
        raise DataError(f"{where}: key {key!r} must end with an assistant message after a prompt")
    return messages[:-1], _reply(messages, key, where)


def _shared_prompt(row: dict, src: DatasetSource, where: str) -> tuple[str | list[dict], str, str]:
    """A preference row without a prompt: two whole dialogues -> (shared prompt, chosen, rejected).

    Strings (Anthropic HH) split after their last `assistant_marker`: the prompt
    keeps the marker, the replies are verbatim (a leading space included), so
    prompt + chosen is the chosen dialogue. Message lists split before their
    last (assistant) message. Both dialogues must have the same prompt.
    """
    ck, rk, marker = src.chosen_key, src.rejected_key, src.assistant_marker
    missing = f"missing key {src.prompt_key!r}"
    chosen, rejected = row.get(ck), row.get(rk)
    if isinstance(chosen, str) and isinstance(rejected, str):
        parts = []
        for key, text in ((ck, chosen), (rk, rejected)):
            cut = text.rfind(marker)
            if cut < 0:
                raise DataError(f"{where}: {missing}, and key {key!r} has no {marker!r} to split its dialogue at "
                                f"(set prompt_key, or assistant_marker, under data.preference); {_keys(row)}")
            parts.append((text[: cut + len(marker)], text[cut + len(marker) :]))
        (prompt, chosen_reply), (rejected_prompt, rejected_reply) = parts
        if prompt != rejected_prompt:
            raise DataError(f"{where}: keys {ck!r} and {rk!r} differ before their last {marker!r}, "
                            "so they share no prompt")
        return prompt, chosen_reply, rejected_reply
    if isinstance(chosen, list) and isinstance(rejected, list):
        chosen_reply, rejected_reply = _reply(chosen, ck, where), _reply(rejected, rk, where)
        if chosen[:-1] != rejected[:-1]:
            raise DataError(f"{where}: keys {ck!r} and {rk!r} differ before their last message, "
                            "so they share no prompt")
        if not chosen[:-1]:
            raise DataError(f"{where}: {missing}, and keys {ck!r} and {rk!r} hold no message before the reply")
        return chosen[:-1], chosen_reply, rejected_reply
    raise DataError(
        f"{where}: {missing} (set prompt_key under data.preference, or give {ck!r} and {rk!r} as whole "
        f"dialogues: both strings containing {marker!r}, or both message lists); {_keys(row)}"
    )


def _unpaired(row: dict, src: DatasetSource, where: str, section: str) -> dict[str, Any]:
    """An unpaired preference row (KTO): {"prompt", "response", "label": bool}."""
    label = row[src.label_key]
    if not isinstance(label, bool) and label not in (0, 1):
        raise DataError(f"{where}: key {src.label_key!r} must be true/false (or 1/0), got {label!r}")
    return {
        "prompt": _prompt(_need(row, src.prompt_key, where, f"or set prompt_key under {section}"),
                                where, src.prompt_key),
        "response": _text(row, src.response_key, where, f"or set response_key under {section}"),
        "label": bool(label),
    }


def normalize_row(row: Any, kind: Kind, src: DatasetSource, where: str) -> dict[str, Any]:
    """One raw row -> its canonical record, or a DataError naming the row and key."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be an object, got {type(row).__name__}")
    section = _SECTION[kind]
    if kind == "preference":
        if src.label_key and row.get(src.label_key) is not None:
            return _unpaired(row, src, where, section)
        if row.get(src.prompt_key) is None:
            prompt, chosen, rejected = _shared_prompt(row, src, where)
            return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
        return {
            "prompt": _prompt(_need(row, src.prompt_key, where, f"or set prompt_key under {section}"),
                                    where, src.prompt_key),
            "chosen": _text(row, src.chosen_key, where, f"or set chosen_key under {section}"),
            "rejected": _text(row, src.rejected_key, where, f"or set rejected_key under {section}"),
        }
    if src.messages_key:
        if kind == "sft":
            prompt, response = _split_messages(row, src, where, section)
            return {"prompt": prompt, "response": response}
        hint = f"or set messages_key under {section}, or unset it for a prompt column"
        prompt = _prompt(_need(row, src.messages_key, where, hint), where, src.messages_key)
    else:
        hint = f"or set prompt_key, or messages_key for a chat column, under {section}"
        prompt = _prompt(_need(row, src.prompt_key, where, hint), where, src.prompt_key)
    if kind == "sft":
        return {"prompt": prompt, "response": _text(row, src.response_key, where,
                                                     f"or set response_key under {section}")}
    answer = row.get(src.answer_key) if src.answer_key else None
    if answer is not None and not isinstance(answer, (str, int, float)):  # str() of a list matches no response
        raise DataError(f"{where}: key {src.answer_key!r} must be a string or a number (the checker and a rule "
                        f"reward get it as text), got {type(answer).__name__}")
    return {"prompt": prompt, "answer": None if answer is None else str(answer)}
