"""Where alignflow's process groups meet: a TCP store whose server listens on the one address its peers
are given, and nowhere else.

    reserve_address(host)                                        a port this process will serve a store on
    tcp_store(address, world_size, is_master=..., timeout=...)   the store of a group (weight transport)
    init_training_group(master, rank, world_size, device)        the trainers' group (DeepSpeed's)

torch's TCPStore binds its server to every interface (`::`) whatever host it is given, and it has no
authentication: anyone who reaches it can join the group or rewrite its keys. Here the master binds a
socket to the address itself and hands it to the store (`master_listen_fd`): 127.0.0.1 under a local Ray,
the node's cluster address on a cluster. A port handed out (`reserve_address`) is listening from then on,
so no other process takes it before the store does. The groups' own connections (gloo, NCCL's bootstrap) follow
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, which a local Ray sets to the loopback interface
(alignflow/cluster.py: loopback_env).
"""

from __future__ import annotations

import datetime
import socket

import torch


_RESERVED: dict[tuple[str, int], int] = {}  # address handed out -> its listening socket's descriptor, until a store takes it


def _listening_fd(address: tuple[str, int]) -> tuple[int, int]:
    """A socket bound to `address` (port 0: one the OS picks) and listening: its file descriptor, owned by
    the caller from now on, and its port."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(address[0], address[1], type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {address[0]}:{address[1]} for a process group's store: {e}") from e
    port = sock.getsockname()[1]
    return sock.detach(), port


def reserve_address(host: str) -> tuple[str, int]:
    """(host, a port) where this process will serve a group's store (`tcp_store` as the master): listening
    from now on, so the port cannot be taken in between, as a port found free and let go could be."""
    fd, port = _listening_fd((host, 0))
    _RESERVED[(host, port)] = fd
    return host, port


def tcp_store(address: tuple[str, int], world_size: int, *, is_master: bool,
              timeout: datetime.timedelta) -> torch.distributed.TCPStore:
    """The store of a group of `world_size` processes at `address`; the master serves it on that address
    alone (module docstring), the others connect to it."""
    import torch.distributed as dist

    fd = _RESERVED.pop((address[0], int(address[1])), None) if is_master else None
    if is_master and fd is None:
        fd = _listening_fd(address)[0]
    return dist.TCPStore(address[0], address[1], world_size, is_master=is_master, timeout=timeout,
                         master_listen_fd=fd)


def init_training_group(master: tuple[str, int], rank: int, world_size: int, device: torch.device,
                        backend: str) -> None:
    """This process's default torch.distributed group, the one DeepSpeed trains over: `backend` (its
    accelerator's: nccl on GPUs, gloo on the CPU), on a store served by rank 0 at `master`. DeepSpeed's
    own timeout (DEEPSPEED_TIMEOUT minutes, 10 by default). A GPU rank binds its device up front, as
    DeepSpeed does where it makes the group itself."""
    import torch.distributed as dist
    from deepspeed.constants import default_pg_timeout

    store = tcp_store(master, world_size, is_master=rank == 0, timeout=default_pg_timeout)
    extra = {"device_id": device} if device.type == "cuda" and world_size > 1 else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=default_pg_timeout,
                            **extra)
