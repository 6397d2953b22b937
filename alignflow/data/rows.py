"""One raw row -> its canonical record (the shapes alignflow/data/formats.py says), or a DataError naming
its file, row and key."""

from __future__ import annotations

import math
from typing import Any

from alignflow.config import DatasetSource, StepwiseSource
from alignflow.data.formats import Kind
from alignflow.errors import DataError

# Where each kind's source sits in the config, for the hints in errors.
_SECTION = {"sft": "data.sft", "preference": "data.preference", "prompts": "data.prompts / data.eval",
            "process": "data.process"}


def _keys(row: dict) -> str:
    return f"this row has keys: {sorted(str(k) for k in row)}"


def _need(row: dict, key: str, where: str, hint: str) -> Any:
    """row[key]; if absent or null, a DataError with what else to set and the keys the row has."""
    value = row.get(key)
    if value is None:
        said = f"key {key!r} is null" if key in row else f"missing key {key!r}"
        raise DataError(f"{where}: {said} ({hint}); {_keys(row)}")
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


def _before_reply(context: list[dict], key: str, where: str) -> list[dict]:
    """A conversation's messages before its reply, as the prompt they are: they must not end with a reply."""
    if context[-1]["role"] == "assistant":
        raise DataError(f"{where}: key {key!r} has another assistant message right before its reply: the "
                        "messages before the reply are its prompt, and a prompt ends before the reply it asks for")
    return context


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
    return _before_reply(messages[:-1], key, where), _reply(messages, key, where)


def _paired(row: dict, src: DatasetSource, where: str, section: str) -> dict[str, Any]:
    """A preference row with a prompt column: {"prompt", "chosen", "rejected"} (`_continued`'s prompt)."""
    ck, rk, pk = src.chosen_key, src.rejected_key, src.prompt_key
    prompt = _prompt(_need(row, pk, where, f"or set prompt_key under {section}"), where, pk)
    chosen = _text(row, ck, where, f"or set chosen_key under {section}")
    rejected = _text(row, rk, where, f"or set rejected_key under {section}")
    return {"prompt": _continued(row, prompt, (ck, rk), pk, where), "chosen": chosen, "rejected": rejected}


def _continued(row: dict, prompt: str | list[dict], keys: tuple[str, ...], pk: str, where: str) -> str | list[dict]:
    """The prompt of replies given beside it (`keys`). A reply given as a conversation (UltraFeedback's
    `[user, assistant]` beside its prompt string) must continue that prompt: the messages before it equal the
    prompt's messages, or end with a user message whose text is the prompt string; the prompt is then those
    messages, so the chat template renders it as it renders SFT and RL prompts. A conversation that continues
    another prompt, or two replies continuing different ones, is a DataError: the row would train on replies
    to some other question."""
    contexts = {key: row[key][:-1] for key in keys if isinstance(row[key], list) and len(row[key]) > 1}
    if len(set(map(repr, contexts.values()))) > 1:
        raise DataError(f"{where}: keys {keys[0]!r} and {keys[1]!r} differ before their last message, "
                        "so they answer different prompts")
    for key, context in contexts.items():
        said = context[-1]["content"].strip() if context[-1]["role"] == "user" else None
        if context != prompt and not (isinstance(prompt, str) and said == prompt.strip()):
            raise DataError(f"{where}: key {key!r} continues a conversation that is not key {pk!r}: the messages "
                            f"before its reply must be the prompt's, or end with a user message saying it")
        prompt = _before_reply(context, key, where)
    return prompt


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
        return _before_reply(chosen[:-1], ck, where), chosen_reply, rejected_reply
    raise DataError(
        f"{where}: {missing} (set prompt_key under data.preference, or give {ck!r} and {rk!r} as whole "
        f"dialogues: both strings containing {marker!r}, or both message lists); {_keys(row)}"
    )


def _unpaired(row: dict, src: DatasetSource, where: str, section: str) -> dict[str, Any]:
    """An unpaired preference row (KTO): {"prompt", "response", "label": bool}."""
    label = row[src.label_key]
    if not isinstance(label, bool) and label not in (0, 1):
        raise DataError(f"{where}: key {src.label_key!r} must be true/false (or 1/0), got {label!r}")
    pk, rk = src.prompt_key, src.response_key
    prompt = _prompt(_need(row, pk, where, f"or set prompt_key under {section}"), where, pk)
    response = _text(row, rk, where, f"or set response_key under {section}")
    return {"prompt": _continued(row, prompt, (rk,), pk, where), "response": response, "label": bool(label)}


def _stepwise(row: dict, src: StepwiseSource, where: str, prompt: str | list[dict]) -> dict[str, Any]:
    """A step-labelled solution: {"prompt", "steps" (each followed by the separator), "labels"}."""
    sk, lk, section = src.steps_key, src.labels_key, _SECTION["process"]
    steps = _need(row, sk, where, f"or set steps_key under {section}")
    labels = _need(row, lk, where, f"or set labels_key under {section}")
    if not isinstance(steps, list) or not steps or not all(isinstance(t, str) for t in steps):
        got = "an empty list" if steps == [] else type(steps).__name__
        raise DataError(f"{where}: key {sk!r} must be a non-empty list of strings (the solution's steps), got {got}")
    if empty := [i for i, t in enumerate(steps, start=1) if not t.strip()]:
        raise DataError(f"{where}: key {sk!r}, step {empty[0]} (of {len(steps)}) is empty")
    if held := [i for i, t in enumerate(steps, start=1) if src.step_separator in t]:
        raise DataError(f"{where}: key {sk!r}, step {held[0]} holds the step separator {src.step_separator!r}, which "
                        "follows every step: a round splits responses at it, so this step would be read as several; "
                        "set data.process.step_separator to a text no step holds (Math-Shepherd's ' ки', say)")
    if not isinstance(labels, list) or any(not isinstance(v, (bool, int, float)) or not 0 <= v <= 1 for v in labels):
        raise DataError(f"{where}: key {lk!r} must be a list of labels, one per step: true/false, 1/0 or a "
                        f"probability in [0, 1] (Math-Shepherd's '+'/'-' tags: map them to true/false), "
                        f"got {labels!r}"[:400])
    if len(labels) != len(steps):
        raise DataError(f"{where}: key {sk!r} holds {len(steps)} steps and key {lk!r} {len(labels)} labels: "
                        "give one label per step")
    return {"prompt": prompt, "steps": [t + src.step_separator for t in steps],
            "labels": [v if isinstance(v, bool) else float(v) for v in labels]}


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
        return _paired(row, src, where, section)
    if src.messages_key:
        if kind == "sft":
            prompt, response = _split_messages(row, src, where, section)
            return {"prompt": prompt, "response": response}
        hint = f"or set messages_key under {section}, or unset it for a prompt column"
        prompt = _prompt(_need(row, src.messages_key, where, hint), where, src.messages_key)
    else:
        hint = f"or set prompt_key, or messages_key for a chat column, under {section}"
        prompt = _prompt(_need(row, src.prompt_key, where, hint), where, src.prompt_key)
    if kind == "process":
        return _stepwise(row, src, where, prompt)
    if kind == "sft":
        return {"prompt": prompt, "response": _text(row, src.response_key, where,
                                                     f"or set response_key under {section}")}
    answer = row.get(src.answer_key) if src.answer_key else None
    if answer is not None and not isinstance(answer, (str, int, float)):  # str() of a list matches no response
        raise DataError(f"{where}: key {src.answer_key!r} must be a string or a number (the checker and a rule "
                        f"reward get it as text), got {type(answer).__name__}")
    if isinstance(answer, float) and math.isnan(answer):  # a Parquet/pandas null in a float column
        answer = None
    return {"prompt": prompt, "answer": None if answer is None else str(answer)}
