"""Where alignflow's process groups meet: a TCP store whose server listens on the one address its peers
are given, and nowhere else.

    tcp_store(address, world_size, is_master=..., timeout=...)   the store of a group (weight transport)
    init_training_group(master, rank, world_size, device)        the trainers' group (DeepSpeed's)

torch's TCPStore binds its server to every interface (`::`) whatever host it is given, and it has no
authentication: anyone who reaches it can join the group or rewrite its keys. Here the master binds a
socket to the address itself and hands it to the store (`master_listen_fd`): 127.0.0.1 under a local Ray,
the node's cluster address on a cluster. The groups' own connections (gloo, NCCL's bootstrap) follow
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, which a local Ray sets to the loopback interface
(alignflow/cluster.py: loopback_env).
"""

from __future__ import annotations

import datetime
import socket

import torch


def _listening_fd(address: tuple[str, int]) -> int:
    """A socket bound to `address` and listening; its file descriptor, owned by the caller from now on."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(address[0], address[1], type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {address[0]}:{address[1]} for a process group's store: {e}") from e
    return sock.detach()


def tcp_store(address: tuple[str, int], world_size: int, *, is_master: bool,
              timeout: datetime.timedelta) -> torch.distributed.TCPStore:
    """The store of a group of `world_size` processes at `address`; the master serves it on that address
    alone (module docstring), the others connect to it."""
    import torch.distributed as dist

    fd = _listening_fd(address) if is_master else None
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
