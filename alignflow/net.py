"""Ports for the servers and process groups alignflow starts."""

from __future__ import annotations

import random
import socket

# Ray's workers listen on ports of this range by default (min_worker_port / max_worker_port).
RAY_WORKER_PORTS = range(10002, 20000)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the OS picks it; a race is possible but rare)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ephemeral_ports() -> range:
    """The ports the OS hands out to any socket bound to port 0 (Linux: ip_local_port_range)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return range(low, high + 1)
    except (OSError, ValueError):
        return range(32768, 61000)  # Linux's default; other systems' ranges lie above it too


def server_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A port free on `host` now for a server started in another process, which binds it seconds later.
    A port the OS picked (`free_port`) can be handed to the next socket bound to port 0 in between (a Ray
    worker's, a client's) and the server then fails to start, or its health check reaches that other
    server; so the port is drawn outside the OS's ephemeral range and Ray's worker ports. Where none of
    `tries` such ports is free, the OS picks one."""
    taken = ephemeral_ports()
    outside = [p for p in range(RAY_WORKER_PORTS.stop, 65536) if p not in taken]
    for port in random.sample(outside, min(tries, len(outside))):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    return free_port(host)
