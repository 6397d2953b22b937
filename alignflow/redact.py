"""Credentials kept out of what alignflow writes down: MLflow params, the plan's reasons, stored manifests
and error messages. A credential reaches a config in two ways: under a key that names one (`api_key:`,
`hf_token:`) or inside a URL, as `user:pass@` or as a query parameter (`?api_key=...`, a presigned
`X-Amz-Signature`). Both are taken out here, at any depth of a config tree.

A config never holds one written out: it is kept with every flow run, in Prefect's database and UI, which
no redaction reaches. `written_credentials` finds them when a config loads (alignflow/config/loading.py),
and each is refused with where its client reads it from the environment instead. A reward service's URL
may name environment variables, `?api_key=${RM_API_KEY}`, which `expand_env` fills in where it is called.
"""

from __future__ import annotations

import base64
import os
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

# `token` but not `tokens`/`tokenizer`: max_new_tokens etc. are settings, not credentials.
SECRET_NAME = re.compile(r"(secret|password|passwd|token(?!s|izer)|credential|access_key|api_key|apikey|private)",
                         re.I)
# Query parameters that carry a credential under a name that says less: `?key=`, `?sig=`, `?auth=`,
# S3's presigned `X-Amz-Signature` / `X-Amz-Credential`, an Azure SAS's `sig`.
_SECRET_QUERY = re.compile(r"^(key|sig|signature|auth|authorization|code|session|x-amz-signature|x-amz-credential"
                           r"|x-amz-security-token)$", re.I)
REDACTED = "***"


def is_secret_name(name: str) -> bool:
    """Whether a config key (or a URL's query parameter) names a credential."""
    return bool(SECRET_NAME.search(name))


def redact_url(text: str) -> str:
    """A URL without its `user:pass@` and with its credential-like query values replaced by `***`.
    Text that is not a URL (no `scheme://`) is returned unchanged.

    >>> redact_url("https://bob:pw@rm.example:8443/score?api_key=Z&batch=4")
    'https://rm.example:8443/score?api_key=***&batch=4'
    """
    if not isinstance(text, str) or "://" not in text:
        return text
    try:
        parts = urlsplit(text)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:  # not a URL after all (a bad port, an unclosed `[`): keep nothing after the scheme
        return text.split("://", 1)[0] + "://" + REDACTED
    netloc, query = parts.netloc, parts.query
    if parts.username or parts.password:
        netloc = f"{host}:{port}" if port else host
    pairs = parse_qsl(query, keep_blank_values=True)
    if any(_secret_query(k) for k, _ in pairs):
        query = urlencode([(k, REDACTED if _secret_query(k) else v) for k, v in pairs], safe="*")
    if (netloc, query) == (parts.netloc, parts.query):
        return text  # as written: urlunsplit would turn `sqlite:///x` into `sqlite:/x`
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _secret_query(name: str) -> bool:
    return is_secret_name(name) or bool(_SECRET_QUERY.match(name))


def redact(tree: Any) -> Any:
    """A config tree (dicts, lists, scalars) with every credential replaced by `***`: the values of
    credential-named keys, and the credentials inside URLs. Keys and the tree's shape are kept, so two
    redacted configs still compare field by field."""
    if isinstance(tree, Mapping):
        return {k: REDACTED if is_secret_name(str(k)) and v is not None else redact(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [redact(v) for v in tree]
    return redact_url(tree) if isinstance(tree, str) else tree


# Keys refused with a value (an environment's or agent's own settings): a key that ends in a credential's name.
# Narrower than SECRET_NAME, which only hides values: `pad_token: "<pad>"` stays a setting, and so do keys that
# name where a credential is (`api_key_env: OPENAI_API_KEY`, `credentials_file`, `secret_name`).
_CREDENTIAL_KEY = re.compile(r"(^|_)(secret|password|passwd|credentials?|access_key|api_key|apikey|auth_token"
                             r"|access_token|hf_token|private_key)$", re.I)
ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
# Fields whose URL alignflow itself requests, filling in `${NAME}` from the environment (expand_env).
EXPANDED_URL = re.compile(r"^rounds\.\d+\.reward\.(sources\.\d+\.)?url$")
# Where the client of each other URL-valued field reads its credentials from the environment.
_ENV_HINTS = {
    "infra.mlflow_tracking_uri": "MLflow reads MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
    "MLFLOW_TRACKING_TOKEN) for a tracking server, and a database's driver reads its own (PGPASSWORD or ~/.pgpass "
    "for PostgreSQL, MYSQL_PWD for MySQL)",
    "infra.prefect_api_url": "Prefect reads PREFECT_API_KEY (Prefect Cloud) or PREFECT_API_AUTH_STRING (a server "
    "with basic auth)",
    "infra.storage": "s3fs reads AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)",
}


def written_credentials(text: str, *, references: bool = False) -> list[str]:
    """What a URL holds written out that is a credential: its password, and each credential-like query
    parameter with a value (`references`: a value that is wholly `${NAME}` is not). [] for text that is not a URL."""
    if not isinstance(text, str) or "://" not in text:
        return []
    try:
        parts = urlsplit(text)
        password = parts.password
    except ValueError:
        return []

    def written(value: str | None) -> bool:
        return bool(value) and not (references and ENV_REFERENCE.fullmatch(value))

    found = ["a password"] if written(password) else []
    return found + [f"query parameter {k!r}" for k, v in parse_qsl(parts.query, keep_blank_values=True)
                    if _secret_query(k) and written(v)]


def config_credentials(tree: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(field, why it is refused) for every credential a raw config tree holds written out."""
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            field = f"{path}.{key}" if path else str(key)
            if _CREDENTIAL_KEY.search(str(key)) and isinstance(value, str) and value:
                yield field, f"{field} names a credential: {_instead(field)}"
            else:
                yield from config_credentials(value, field)
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from config_credentials(value, f"{path}.{i}")
    elif isinstance(tree, str):
        found = written_credentials(tree, references=bool(EXPANDED_URL.match(path)))
        if found:
            yield path, f"{path}: {redact_url(tree)} holds {' and '.join(found)} written out: {_instead(path)}"


def _instead(field: str) -> str:
    stored = "a config is kept with every flow run, in Prefect's database and UI, so it takes none"
    if EXPANDED_URL.match(field):
        return (f"{stored}; write ${{NAME}} in its place (?api_key=${{RM_API_KEY}}, https://${{RM_USER}}:"
                f"${{RM_PASSWORD}}@host/...) and set NAME in the environment the run starts in (and a cluster's "
                "nodes): it is read where the service is called")
    hint = next((h for prefix, h in _ENV_HINTS.items() if field.startswith(prefix)), None)
    return f"{stored}; {hint}" if hint else f"{stored}; give it to its client through the environment"


def expand_env(text: str, field: str, quote: Callable[[str], str] = lambda v: v) -> str:
    """`text` with every `${NAME}` replaced by the environment's NAME (through `quote`: a URL part's encoding):
    where a URL is requested, so the config, and everything made from it, holds only the name. A ConfigError
    naming `field` and NAME where it is unset."""
    from alignflow.errors import ConfigError

    missing = [name for name in ENV_REFERENCE.findall(text) if name not in os.environ]
    if missing:
        raise ConfigError(f"{field}: {redact_url(text)} names {', '.join(missing)}, which the environment of "
                          f"this process does not set")
    return ENV_REFERENCE.sub(lambda m: quote(os.environ[m.group(1)]), text)


def request_target(url: str, field: str) -> tuple[str, dict[str, str]]:
    """(the URL to request, its headers): the URL split as written, then each part's `${NAME}`s filled in and
    encoded for that part (a value with `@`, `/`, `&` or a space stays inside it), and a `user:password@` taken
    out into an Authorization header (basic auth), which urllib does not do from the URL itself."""
    expand_env(url, field)  # every name set, or one error naming the whole URL (without its credentials)
    parts = urlsplit(url)

    def filled(text: str | None, safe: str = "") -> str:
        return expand_env(text or "", field, lambda v: quote(v, safe=safe))

    host = expand_env(parts.hostname or "", field)
    netloc = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
    query = urlencode([(k, expand_env(v, field)) for k, v in parse_qsl(parts.query, keep_blank_values=True)])
    target = urlunsplit((parts.scheme, netloc, filled(parts.path, "/"), query, filled(parts.fragment)))
    if parts.username is None:
        return target, {}
    user, password = (unquote(expand_env(x or "", field)) for x in (parts.username, parts.password))
    return target, {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}
