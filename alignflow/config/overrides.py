"""`key.sub=value` overrides onto a config tree, read as the fields they set expect.

A value is YAML (`5`, `true`, `[1, 2]`, `{"a": 1}`), except for a field that takes text: there the text
is kept as written where YAML would read something else (`model.revision=0123456`, an all-digit commit,
is not the octal number 42798; `name=2024` is a name; `reward.judge.pattern=verdict: (yes|no)` is not a
mapping; `data.sft.path=runs/v2 #3.jsonl` keeps its ` #3.jsonl`, which YAML reads as a comment).

A level the file does not write is filled with its default before the override goes into it, where that
default holds something: `rounds.1.steps=5` on a file without `rounds:` sets the default second round's
steps, and `rounds.0.reward.judge.scores.yes=2` keeps the default `no` beside the new `yes`.
"""

from __future__ import annotations

import types
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from alignflow.errors import ConfigError


BOOL = "tag:yaml.org,2002:bool"


class ConfigLoader(yaml.SafeLoader):
    """YAML's safe loader for config files and override values. It refuses a key given twice in one mapping:
    the second would silently replace the first (a whole section, when a file has two `sft:` blocks). A merge
    key (`<<: *round`) brings an anchored mapping's keys in, which the mapping's own then override, as YAML
    means. A mapping's key is never a YAML 1.1 boolean: `{yes: 1.0, no: 0.0}`, a judge's verdict scores, has
    the keys "yes" and "no" (they were True and False); a value reads yes/no/on/off as booleans, as before."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            if key_node.tag == BOOL and key_node.value.lower() not in ("true", "false"):
                key_node.tag = "tag:yaml.org,2002:str"
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"found the key {key!r} twice (first at line {seen[key].line + 1}); the second "
                    "would replace the first", key_node.start_mark)
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error in one line: where (line and column, from 1) and what, without PyYAML's excerpt of the text
    and its '<unicode string>' for the file's name."""
    mark, context, at = (getattr(err, name, None) for name in ("problem_mark", "context", "context_mark"))
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    since = f" ({context}" + (f" at line {at.line + 1}" if at else "") + ")" if context else ""
    return f"{where}{getattr(err, 'problem', None) or err}{since}"


def _yaml(raw: str) -> Any:
    return yaml.load(raw, Loader=ConfigLoader)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], yaml-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.sub=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {text!r} has an empty key segment")
    if takes_text(parts) and raw.strip():
        try:
            value = _yaml(raw)
        except yaml.YAMLError:
            return parts, raw.strip()
        quoted = raw.strip()[:1] in ("'", '"')  # the user's own quotes: YAML's reading stands
        return parts, value if value is None or (isinstance(value, str) and (" #" not in raw or quoted)) \
            else raw.strip()
    try:
        return parts, _yaml(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError(f"override {text!r}: the value is not valid YAML: {yaml_problem(err)}") from None


def _list_index(text: str, node: list, part: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        items = f"items by index: 0..{len(node) - 1}" if node else "it is empty"
        raise ConfigError(f"override {text!r}: {part!r} is not an item of a list of {len(node)} ({items})")
    return int(part)


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each `key.sub=value` in a nested dict (creating levels as needed, a level with a default that holds
    something filled with it first); an existing list's items by index (`rounds.1.steps=5`)."""
    for text in overrides:
        parts, value = parse_override(text)
        node: Any = tree
        for i, part in enumerate(parts[:-1]):
            if isinstance(node, list):
                child = node[_list_index(text, node, part)]
            else:
                child = node.get(part)
                if child is None:
                    child = node[part] = default_of(parts[: i + 1])
            if not isinstance(child, (dict, list)):
                raise ConfigError(f"override {text!r}: {part!r} is a value, not a section")
            node = child
        if isinstance(node, list):
            node[_list_index(text, node, parts[-1])] = value
        else:
            node[parts[-1]] = value
    return tree


def override_fields(overrides: list[str] | tuple[str, ...]) -> dict[str, str]:
    """Dotted key -> the override text that set it last (`data.sft.path` -> `data.sft.path=/x.jsonl`)."""
    fields: dict[str, str] = {}
    for text in overrides:
        parts, _ = parse_override(text)
        key = ".".join(p.strip() for p in parts)
        fields.pop(key, None)  # re-inserted: the order of the dict is the order that wins
        fields[key] = text
    return fields


def _field(parts: list[str]) -> tuple[Any, Any] | None:
    """(annotation, pydantic FieldInfo of the last named field) of the config field at `parts` (list items by
    index, dict values by key), or None where the path leaves the typed fields."""
    from alignflow.config.pipeline import PipelineConfig

    annotation, info = PipelineConfig, None
    for part in parts:
        annotation = _one(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            info = annotation.model_fields.get(part.strip())
            if info is None:
                return None
            annotation = info.annotation
        elif get_origin(annotation) in (list, tuple) and part.isdigit():
            annotation, info = get_args(annotation)[0], None
        elif get_origin(annotation) is dict:
            annotation, info = get_args(annotation)[1], None
        else:
            return None
    return annotation, info


def _one(annotation: Any) -> Any:
    """`X | None` -> X; any other annotation as it is."""
    if get_origin(annotation) in (Union, types.UnionType):
        kinds = [a for a in get_args(annotation) if a is not type(None)]
        return kinds[0] if len(kinds) == 1 else annotation
    return annotation


def takes_text(parts: list[str]) -> bool:
    """Whether the field at `parts` takes text: str, str | None, or a Literal of strings."""
    found = _field(parts)
    if found is None:
        return False
    annotation = _one(found[0])
    return annotation is str or (get_origin(annotation) is Literal and all(isinstance(a, str)
                                                                           for a in get_args(annotation)))


def default_of(parts: list[str]) -> Any:
    """The JSON of the default of the field at `parts` where it is a list or a mapping of values holding
    something (the default rounds, a judge's verdict scores); else {} (a section's own defaults apply)."""
    found = _field(parts)
    if found is None or found[1] is None:
        return {}
    info = found[1]
    default = info.default_factory() if info.default_factory is not None else info.default
    if isinstance(default, BaseModel) or not isinstance(default, (list, dict)) or not default:
        return {}
    return as_json(default)


def as_set_with_made_defaults(model: BaseModel) -> dict[str, Any]:
    """A config as JSON the way it was set (its exclude_unset dump), with the defaults a factory made where
    they hold something (the default rounds, a judge's verdict scores, the margin bins) at every level the dump
    has: a JSON schema has no default for such a field, so a form built from it would show it empty."""
    return _with_made_defaults(model, model.model_dump(mode="json", exclude_unset=True))


def as_json(value: Any) -> Any:
    """A config value as JSON: a model as_set_with_made_defaults, a list item by item."""
    if isinstance(value, BaseModel):
        return as_set_with_made_defaults(value)
    if isinstance(value, (list, tuple)):
        return [as_json(v) for v in value]
    return to_jsonable_python(value)


def _with_made_defaults(model: BaseModel, dumped: dict[str, Any]) -> dict[str, Any]:
    """`dumped` (model's exclude_unset dump) with the fields left out whose default a factory made, where it
    holds something, at every level the dump has."""
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        if name not in dumped:
            if info.default_factory is not None and value and not isinstance(value, BaseModel):  # a section's
                dumped[name] = as_json(value)  # own fields have their defaults in the schema
        elif isinstance(value, BaseModel) and isinstance(dumped[name], dict):
            _with_made_defaults(value, dumped[name])
        elif isinstance(value, list) and isinstance(dumped[name], list):
            for v, d in zip(value, dumped[name]):
                if isinstance(v, BaseModel) and isinstance(d, dict):
                    _with_made_defaults(v, d)
    return dumped
