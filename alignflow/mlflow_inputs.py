"""What alignflow hands MLflow: a config tree as params (flattened to dotted names, with nothing that
could be a credential), and where a new experiment keeps its artifacts."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

# `token` but not `tokens`/`tokenizer`: max_new_tokens etc. are settings, not credentials.
_SECRET = re.compile(r"(secret|password|passwd|token(?!s|izer)|credential|access_key|api_key|private)", re.I)


def _scrub_value(value: Any) -> Any:
    """Strip `user:pass@` from URI-like strings."""
    if isinstance(value, str) and "://" in value and "@" in value:
        parts = urlsplit(value)
        if parts.username or parts.password:
            host = parts.hostname or ""
            if parts.port:
                host = f"{host}:{parts.port}"
            return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))
    return value


def flatten_params(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config -> {"a.b": value}, without credential-like keys."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if _SECRET.search(str(key)):
            continue
        if isinstance(value, Mapping):
            out.update(flatten_params(value, prefix=f"{name}."))
        elif isinstance(value, (list, tuple)):
            out[name] = json.dumps(value)[:500]
        else:
            out[name] = _scrub_value(value)
    return out


def param_values(params: Mapping[str, Any]) -> dict[str, str]:
    """A config as MLflow param values: flattened without credentials, each cut to MLflow's 6000 characters."""
    return {k: str(v)[:6000] for k, v in flatten_params(params).items()}


DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


def artifact_location(tracking_uri: str, artifact_root: str | None) -> str | None:
    """Where a new experiment of a database store keeps its artifacts: `mlflow-artifacts` beside a SQLite
    file, else `artifact_root`; None (the store's own choice) for a server or a file store."""
    scheme = tracking_uri.split(":", 1)[0].split("+", 1)[0]
    if scheme == "sqlite" and tracking_uri.startswith("sqlite:///"):
        return (Path(tracking_uri.removeprefix("sqlite:///")).resolve().parent / "mlflow-artifacts").as_uri()
    return artifact_root if scheme in DATABASE_SCHEMES else None
