"""Credentials kept out of what alignflow writes down: MLflow params, the plan's reasons, stored manifests
and error messages. A credential reaches a config in two ways: under a key that names one (`api_key:`,
`hf_token:`) or inside a URL, as `user:pass@` or as a query parameter (`?api_key=...`, a presigned
`X-Amz-Signature`). Both are taken out here, at any depth of a config tree.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

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
