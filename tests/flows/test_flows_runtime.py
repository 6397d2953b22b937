"""The run's own Prefect server: a port nothing else is handed while it starts, and a health check that a
different server on that port cannot crash."""

from __future__ import annotations

import socket
import threading

from alignflow.net import RAY_WORKER_PORTS, ephemeral_ports, server_port
from flows.runtime import _healthy


def test_the_servers_port_is_outside_what_the_os_and_ray_hand_out():
    taken = ephemeral_ports()
    assert taken.start >= 1024 and len(taken) > 1000  # read from the OS (Linux: ip_local_port_range)
    for _ in range(20):
        port = server_port()
        assert port not in taken and port not in RAY_WORKER_PORTS and 1024 < port < 65536
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free when handed out


def test_a_port_held_by_another_server_reads_as_not_healthy_rather_than_failing():
    """What a Ray worker's gRPC port answers an HTTP request with: bytes that are no status line. The check
    says "not up" (the Prefect server, unable to bind, exits and the caller names it) instead of raising
    http.client.BadStatusLine out of the CLI."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]

    def answer_in_binary():
        for _ in range(2):
            conn, _ = listener.accept()
            with conn:
                conn.recv(1024)
                conn.sendall(b"\x00\x00\x12\x04\x00\x00\x00\x00\x00\x00\x03\x7f\xff\xff\xff\r\n\r\n")

    threading.Thread(target=answer_in_binary, daemon=True).start()
    try:
        assert _healthy(f"http://127.0.0.1:{port}/api") is False
    finally:
        listener.close()
