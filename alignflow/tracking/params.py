"""What alignflow hands MLflow: a config tree as params (flattened to dotted names, with nothing that
could be a credential), and where a new experiment keeps its artifacts."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from alignflow.redact import is_secret_name, redact, redact_url

PARAM_CHARS = 6000  # MLflow's limit on a param value


def flatten_params(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config -> {"a.b": value}, without credential-like keys; a list is its JSON, and every
    URL (in a list too) loses its credentials (alignflow/redact.py)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if is_secret_name(str(key)):
            continue
        if isinstance(value, Mapping):
            out.update(flatten_params(value, prefix=f"{name}."))
        elif isinstance(value, (list, tuple)):
            out[name] = json.dumps(redact(value))
        else:
            out[name] = redact_url(value)
    return out


def param_values(params: Mapping[str, Any]) -> dict[str, str]:
    """A config as MLflow param values: flattened without credentials. A value over MLflow's 6000
    characters is cut, and says so and how long it was."""
    return {k: _fit(str(v)) for k, v in flatten_params(params).items()}


def _fit(value: str) -> str:
    if len(value) <= PARAM_CHARS:
        return value
    mark = f"... [cut: {len(value)} characters]"
    return value[:PARAM_CHARS - len(mark)] + mark


DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


def sqlite_file(tracking_uri: str) -> Path | None:
    """The SQLite file a tracking URI names (`sqlite:///rel.db`, `sqlite:////abs.db`) as written; None for
    anything else (a server, another database, an in-memory SQLite)."""
    prefix = "sqlite:///"
    return Path(tracking_uri.removeprefix(prefix)) if tracking_uri.startswith(prefix) else None


def artifact_location(tracking_uri: str, artifact_root: str | None) -> str | None:
    """Where a new experiment of a database store keeps its artifacts: `mlflow-artifacts` beside a SQLite
    file, else `artifact_root`; None (the store's own choice) for a server or a file store."""
    if (file := sqlite_file(tracking_uri)) is not None:
        return (file.resolve().parent / "mlflow-artifacts").as_uri()
    scheme = tracking_uri.split(":", 1)[0].split("+", 1)[0]
    return artifact_root if scheme in DATABASE_SCHEMES else None
