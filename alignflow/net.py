"""Ports for the servers and process groups alignflow starts."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the OS picks it; a race is possible but rare)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
