"""Loading a pipeline config: YAML, then `key.sub=value` overrides, then validation.

The whole tree is validated before any compute starts, and every error
names its source (the file, or the command-line override) and its field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from alignflow.config.pipeline import PipelineConfig
from alignflow.errors import ConfigError
from alignflow.storage import is_local_uri, local_path

DEFAULT_CONFIG = "tiny"

# Fields that place work on the cluster, or trade memory for time, without
# changing what it computes: left out of cache keys, so moving a stage to other
# hardware reuses its result.
RESOURCE_FIELDS = frozenset({"placement", "scorer_placement", "colocate_all", "offload", "gradient_checkpointing"})


def cache_relevant(cfg: BaseModel) -> dict[str, Any]:
    """A config as JSON, without its resource-only fields (at any depth)."""

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k not in RESOURCE_FIELDS}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    return strip(cfg.model_dump(mode="json"))


def default_config_path() -> Path:
    """The embedded default pipeline config (shipped inside the package)."""
    return Path(__file__).parents[1] / "configs" / f"{DEFAULT_CONFIG}.yaml"


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], yaml-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.sub=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {text!r} has an empty key segment")
    try:
        return parts, yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError(f"override {text!r}: the value is not valid YAML: {err}") from None


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each `key.sub=value` in a nested dict (creating levels as needed)."""
    for text in overrides:
        parts, value = parse_override(text)
        node = tree
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part!r} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return tree


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid pipeline config ({source}):"]
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "<root>"
        hint = ""
        if e["type"] == "extra_forbidden" and field.split(".")[-1] == "seed":
            hint = "; seeds derive from the one top-level `seed` (alignflow/seeds.py)"
        lines.append(f"  {field}: {e['msg']} (got {e.get('input')!r}){hint}")
    return "\n".join(lines)


def validate_config(tree: dict[str, Any], source: str = "<dict>") -> PipelineConfig:
    """Validate a raw tree; errors name every offending field."""
    try:
        return PipelineConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> PipelineConfig:
    """Load YAML (default: the embedded tiny config), apply overrides, validate."""
    path = Path(path) if path is not None else default_config_path()
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(tree).__name__}")
    source = f"{path} with overrides {' '.join(overrides)}" if overrides else str(path)
    return validate_config(apply_overrides(tree, overrides or []), source=source)


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
