"""Loading a pipeline config: YAML, then `key.sub=value` overrides, then validation.

The whole tree is validated before any compute starts, and every error
names its source (the file, or the command-line override) and its field.
"""

from __future__ import annotations

import copy
import difflib
import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from alignflow.config.overrides import (ConfigLoader, apply_overrides, override_fields, parse_override,  # noqa: F401
                                       yaml_problem)
from alignflow.config.pipeline import PipelineConfig
from alignflow.errors import ConfigError
from alignflow.redact import config_credentials, redact
from alignflow.store.storage import is_local_uri, local_path

DEFAULT_CONFIG = "tiny"

# Fields that place work on the cluster, or trade memory for time, without changing what it computes, or that
# only say how much is checked up front (preflight_rows), how often a stage saves or logs, or how an engine holds
# its memory and batches (vLLM's memory and batching, weight buckets): left out of cache keys, so moving a stage
# to other hardware, or checkpointing it more often after a crash, reuses its result.
RESOURCE_FIELDS = frozenset({"placement", "scorer_placement", "reference_placement", "reference_micro_batch_size",
                             "colocate_all", "offload", "gradient_checkpointing", "engine_lifetime",
                             "preflight_rows", "scoring_micro_batch_size", "scoring_micro_batch_tokens",
                             "checkpoint_every", "log_every", "colocate_offload", "weight_bucket_mb",
                             "gpu_memory_utilization", "kv_cache_gib", "max_num_seqs", "max_num_batched_tokens",
                             "async_scheduling", "enforce_eager"})
# Resource-only under one section's name alone (elsewhere a micro_batch_size is gradient accumulation).
RESOURCE_FIELDS_IN = {"evaluation": frozenset({"micro_batch_size"})}
# Fields read only where a sibling has one value (SimPO's target margin, read with `loss: simpo`), left out of
# the key elsewhere, where the config refuses any but the default: adding one kept the other losses' keys.
READ_ONLY_WITH = {"simpo_gamma": ("loss", "simpo")}
# Fields added after stages' keys were published, left out of a key at the default they came with: earlier keys stay.
ADDED_AT_DEFAULT = {"process": None, "num_process": 0, "step_aggregation": "min", "no_step_reward": -5.0,
                    "step_separator": None, "dense": False, "rpo_alpha": 0.0, "covariance": None, "reference": None,
                    "sapo_temperatures": [1.0, 1.05], "high_entropy_fraction": None, "objective": "nll",
                    "neftune_alpha": None, "tis_level": "token", "tis_veto": None}


def cache_relevant(cfg: BaseModel) -> dict[str, Any]:
    """A config as JSON, without its resource-only fields (at any depth), the fields its other settings leave
    unread (READ_ONLY_WITH) and fields added later while at their default (ADDED_AT_DEFAULT); the last two not
    inside an environment's `kwargs`, the user's own names."""

    def unread(node: dict, key: str) -> bool:
        added = key in ADDED_AT_DEFAULT and repr(node[key]) == repr(ADDED_AT_DEFAULT[key])  # 0.0 is not False
        return added or key in READ_ONLY_WITH and node.get(READ_ONLY_WITH[key][0]) != READ_ONLY_WITH[key][1]

    def strip(node: Any, within: frozenset[str] = frozenset(), free: bool = False) -> Any:
        if isinstance(node, dict):
            return {k: strip(v, RESOURCE_FIELDS_IN.get(k, frozenset()), free or k == "kwargs") for k, v in node.items()
                    if k not in RESOURCE_FIELDS and k not in within and (free or not unread(node, k))}
        if isinstance(node, list):
            return [strip(v, free=free) for v in node]
        return node

    return strip(cfg.model_dump(mode="json"))


def default_config_path() -> Path:
    """The embedded default pipeline config (shipped inside the package)."""
    return Path(__file__).parents[1] / "configs" / f"{DEFAULT_CONFIG}.yaml"


def _display(path: str | Path) -> str:
    """A config path as the user would write it: relative to the working directory when under it."""
    path = Path(path)
    try:
        return str(path.absolute().relative_to(Path.cwd()))  # not resolved: a symlink keeps the name given
    except ValueError:
        return str(path)


@dataclass(frozen=True)
class ConfigSources:
    """Where a config's values came from: its file (`tree` its raw mapping) and the overrides.

    `name` calls the base something other than its path (a deployment's `config` parameter), and
    `overrides_from` says where the overrides were given (the command line, or a parameter)."""

    path: str | Path | None = None
    overrides: tuple[str, ...] = ()
    tree: dict[str, Any] | None = None
    name: str | None = None
    overrides_from: str = "the command line"

    def of(self, field: str, quote: bool = True) -> str:
        """`from the command line: k=v`, `from PATH`, `from PATH and the command line: ...`,
        or `the default, not set in PATH` for a dotted field (list items by index: rounds.0.x).
        `quote=False`: an override's key, not its value (`k=...`)."""
        fields = override_fields(self.overrides)
        setting = [t for k, t in fields.items() if field == k or field.startswith(k + ".")]
        if setting:
            said = _short(setting[-1]) if quote else setting[-1].split("=", 1)[0] + "=..."
            return f"from {self.overrides_from}: {said}"
        path = self.name or (_display(self.path) if self.path is not None else "the config")
        inside = [t for k, t in fields.items() if k.startswith(field + ".")]
        if inside:
            return f"from {path} and {self.overrides_from}: {' '.join(_short(t) for t in inside)}"
        if self.tree is not None and field != "<root>" and not _present(self.tree, field.split(".")):
            return f"the default, not set in {path}"
        return f"from {path}"


def _short(text: str, limit: int = 60) -> str:
    """An override as errors quote it: a long YAML list or mapping cut (paths and scalars whole)."""
    value = text.split("=", 1)[1].lstrip()
    return text[: limit - 3] + "..." if len(text) > limit and value[:1] in ("[", "{") else text


def _present(node: Any, parts: list[str]) -> bool:
    for part in parts:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False
    return True


# The names pydantic gives a union's members in an error's location (`max_prompt_tokens.constrained-int`,
# `target_modules.tuple[str, ...]`), which are no fields: left out of the field an error names.
_MEMBER_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "tuple", "none"})
_FIELD_FIRST = re.compile(r"^([A-Za-z_][\w]*(?:\.[\w]+)*): ")
_PYDANTIC_PREFIX = re.compile(r"^(?:Value|Assertion) error, ")


def _field_of(loc: tuple) -> str:
    return ".".join(str(p) for p in loc if isinstance(p, int) or (p.isidentifier() and p not in _MEMBER_TAGS))


def _nearest(field: str) -> str:
    """`; did you mean 'x'?` for an unknown key of a section, or its valid keys (each section is a model: its
    fields by name, through list items by index)."""
    node: Any = PipelineConfig
    *parents, key = field.split(".")
    for part in parents:
        if part.isdigit():
            continue
        info = getattr(node, "model_fields", {}).get(part)
        node = next((a for a in _models_in(info.annotation)), None) if info else None
        if node is None:
            return ""
    names = sorted(getattr(node, "model_fields", {}))
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.75)
    return f"; did you mean {close[0]!r}?" if close else f"; valid: {', '.join(names)}" if names else ""


def _models_in(annotation: Any):
    """The pydantic models an annotation holds (a field's type, through Optional, list, union)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for arg in get_args(annotation):
        yield from _models_in(arg)


def _format_errors(err: ValidationError, source: str, sources: ConfigSources | None = None) -> str:
    """One line per field: its errors (a union's members' joined by "or"), the value given, and where it was
    set. A check across fields (a model validator at the root) names its field in its message: that field's
    origin is said, not the whole config as the value given."""
    found: dict[str, list[str]] = {}
    given: dict[str, Any] = {}
    for e in err.errors():
        field, message = _field_of(e["loc"]), _PYDANTIC_PREFIX.sub("", e["msg"])
        if e["type"] == "extra_forbidden":  # the unknown key as given (`learning-rate` is no identifier)
            field = ".".join(filter(None, (_field_of(e["loc"][:-1]), str(e["loc"][-1]))))
        if not field and (named := _FIELD_FIRST.match(message)):
            field, message = named.group(1), message[named.end():]
            given[field] = None  # the input is the whole config: not quoted
        elif field not in given:  # a section's check across its fields: the section is no value to quote
            given[field] = None if isinstance(e.get("input"), dict) else e.get("input")
        if e["type"] == "extra_forbidden" and field.split(".")[-1] == "seed":
            message += "; seeds derive from the one top-level `seed` (alignflow/seeds.py)"
        elif e["type"] == "extra_forbidden":
            message = f"no such setting{_nearest(field)}"
        found.setdefault(field or "<root>", []).append(message)
    lines = [f"invalid pipeline config ({source}):"]
    for field, messages in found.items():
        got = f" (got {redact(given[field])!r})" if given.get(field) is not None else ""
        origin = f" ({sources.of(field)})" if sources is not None and field != "<root>" else ""
        lines.append(f"  {'' if field == '<root>' else field + ': '}{'; or '.join(messages)}{got}{origin}")
    return "\n".join(lines)


def validate_config(tree: dict[str, Any], source: str = "<dict>",
                    sources: ConfigSources | None = None) -> PipelineConfig:
    """Validate a raw tree; errors name every offending field (and, given `sources`, where it was set). A
    credential written out is refused first (alignflow/redact.py), and no error repeats one."""
    written = list(config_credentials(tree))
    if written:  # said without the overrides' values, which hold them
        lines = [f"  {why}" + (f" ({sources.of(field, quote=False)})" if sources is not None else "")
                 for field, why in written]
        raise ConfigError("\n".join(["invalid pipeline config: a credential written out", *lines]))
    try:
        return PipelineConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source, sources)) from None


def read_config_file(path: str | Path | None = None) -> tuple[Path, dict[str, Any]]:
    """(the path, its raw mapping); the default is the embedded tiny config."""
    path = Path(path) if path is not None else default_config_path()
    if not path.is_file():
        looks = path.suffix.lower() not in (".yaml", ".yml") and not path.parent.name  # `rounds.0.steps`, no `=`
        raise ConfigError(f"config file {path} does not exist" + (
            f" (an override is key.sub=value: {path}=...?)" if looks and "." in path.name else ""))
    try:
        tree = yaml.load(path.read_text(encoding="utf-8"), Loader=ConfigLoader) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {yaml_problem(err)}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text: {err}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(tree).__name__}")
    return path, _unshared(tree)


def _unshared(node: Any) -> Any:
    """A copy in which a YAML alias (`- *round`) is a mapping of its own at each place it is used: the
    loader gives every use the same object, so `rounds.1.steps=5` would have set round 0's too."""
    if isinstance(node, dict):
        return {k: _unshared(v) for k, v in node.items()}
    return [_unshared(v) for v in node] if isinstance(node, list) else node


def config_sources(path: str | Path | None = None, overrides: list[str] | None = None) -> ConfigSources:
    """Where each value of `load_config(path, overrides)` comes from (for error messages)."""
    path, tree = read_config_file(path)
    return ConfigSources(path, tuple(overrides or ()), tree)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> PipelineConfig:
    """Load YAML (default: the embedded tiny config), apply overrides, validate."""
    path, tree = read_config_file(path)
    source = f"{path} with overrides {' '.join(overrides)}" if overrides else str(path)
    sources = ConfigSources(path, tuple(overrides or ()), copy.deepcopy(tree))
    return validate_config(apply_overrides(tree, overrides or []), source=source, sources=sources)


def config_from_parameter(tree: Any, overrides: list[str] | None = None, *, name: str = "config",
                          overrides_name: str = "overrides") -> tuple[PipelineConfig, ConfigSources]:
    """A config passed as a mapping (a deployment's typed `config` parameter, the whole tree) with its
    `key.sub=value` overrides, validated; errors name the parameters as the values' origin."""
    if not isinstance(tree, dict):
        raise ConfigError(f"the deployment parameter `{name}` must be a mapping of config sections, "
                          f"got {type(tree).__name__}")
    sources = ConfigSources(overrides=tuple(overrides or ()), tree=tree, name=f"the deployment parameter `{name}`",
                            overrides_from=f"the deployment parameter `{overrides_name}`")
    source = sources.name + (f" with `{overrides_name}` {' '.join(overrides)}" if overrides else "")
    # The overrides go into a copy: `tree` (the parameter's value, and the sources' record of it) stays as given.
    return validate_config(apply_overrides(copy.deepcopy(tree), overrides or []), source, sources), sources


def resolve_paths(cfg: PipelineConfig, base: Path | None = None) -> PipelineConfig:
    """A copy whose local storage root and SQLite tracking file are absolute.

    Ray workers may run in another working directory; relative paths would
    then point elsewhere. Remote URIs are left as they are. (Cache keys do
    not include these paths, so resolving never changes a key.)
    """
    base = base or Path.cwd()
    infra = cfg.infra
    root = infra.storage.root
    if is_local_uri(root):
        root = str(local_path(root, base))
    uri = infra.mlflow_tracking_uri
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
        uri = prefix + str(local_path(uri[len(prefix):], base))
    storage = infra.storage.model_copy(update={"root": root})
    return cfg.model_copy(update={"infra": infra.model_copy(update={"storage": storage, "mlflow_tracking_uri": uri})})


def load_callable(path: str, what: str) -> Callable:
    """`module:function` named by a config field (a reward rule, the checker, an agent) -> the function; a
    ConfigError naming the field `what`."""
    module, _, name = path.partition(":")
    if not name:
        raise ConfigError(f"{what} {path!r} must be 'module:function'")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{what} {path!r} cannot be imported: {err}") from None
    if not callable(fn):
        raise ConfigError(f"{what} {path!r} is not callable")
    return fn
