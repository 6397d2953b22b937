"""Where flows run: one Prefect API, a Ray task runner, result storage.

With no API configured, Prefect would start a temporary server in the
driver *and one in every Ray worker*. `prefect_api` makes sure there is one:
the configured URL, or a `prefect server start` bound to 127.0.0.1 for the
duration of the run, exported as PREFECT_API_URL before Ray starts so the
workers inherit it.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from alignflow.config import InfraConfig
from alignflow.errors import StartError
from alignflow.net import server_port
from alignflow.store.storage import is_local_uri, local_path

STARTUP_TIMEOUT_S = 120


# What stops the server the CLI starts: uvicorn shuts down gracefully on it. Not SIGTERM, which the server
# holds blocked (see _server_signals).
SERVER_STOP = signal.SIGINT


def _server_signals():
    """A pre-exec hook: the server ends with the CLI, and outlives a stop sent to every process at once.

    - It runs in its own session (a Ctrl-C in the terminal must not stop it before the CLI has recorded the
      stop in it), so Linux's parent-death signal (SERVER_STOP, even where the CLI is SIGKILLed) ends it.
    - SIGTERM stays blocked in it: systemd's and Slurm's stops send SIGTERM to every process of the unit or
      job step at once, and a server gone with the CLI's first breath would leave the stop unrecorded (the
      flow run, the stopped stages' task runs) and each call of the stop path retrying for a minute. The mask
      survives exec; the CLI ends it with SERVER_STOP once it is done.
    - SERVER_STOP's default action is restored: a CLI started in the background by a shell without job
      control (`cmd &`, a batch script) has SIGINT ignored, which a child would inherit, and then nothing
      but SIGKILL would stop it until uvicorn sets its handlers.
    The server is one process (uvicorn, one worker): no child of its own would wait out a SIGTERM.
    Built before the fork: the hook itself only makes system calls.
    """
    def block() -> None:
        signal.signal(SERVER_STOP, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    if not sys.platform.startswith("linux"):
        return block
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def hook() -> None:
        block()
        prctl(1, SERVER_STOP)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the CLI died before the hook ran
            os.kill(os.getpid(), SERVER_STOP)

    return hook


def _healthy(url: str) -> bool:
    """The API answers its health check; False while it starts, or where another server (not HTTP) holds the
    port: the server process then exits, which the caller sees."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except (OSError, http.client.HTTPException):
        return False


@contextlib.contextmanager
def prefect_api(infra: InfraConfig, log_dir: Path, while_starting: Callable[[], None] | None = None) -> Iterator[str]:
    """Yield the API URL every process of this run uses (starting one if needed).

    The URL is exported before the server is up, so `while_starting` (e.g.
    starting Ray, whose workers inherit the variable) overlaps the server's
    start-up instead of following it.
    """
    url = infra.prefect_api_url or os.environ.get("PREFECT_API_URL")
    if url:
        os.environ["PREFECT_API_URL"] = url
        if while_starting:
            while_starting()
        yield url
        return
    port = server_port()
    url = f"http://127.0.0.1:{port}/api"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "prefect-server.log"
    prefect_bin = Path(sys.executable).with_name("prefect")
    # Its UI asks the API at PREFECT_UI_API_URL, 127.0.0.1:4200 unless told: on any other port every page
    # would say "Can't connect to Server API".
    env = {**os.environ, "PREFECT_UI_API_URL": url, "PREFECT_UI_URL": url.removesuffix("/api")}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [str(prefect_bin), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_server_signals(), env=env,
        )
    try:
        os.environ["PREFECT_API_URL"] = url
        if while_starting:
            while_starting()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                why = f"exited with status {proc.returncode}" if proc.poll() is not None else \
                    f"not answering after {STARTUP_TIMEOUT_S} s"
                raise StartError(f"the Prefect server did not start ({why}); its log: {log_path}")
            time.sleep(0.3)
        yield url
    finally:
        proc.send_signal(SERVER_STOP)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


def unreachable_api(api_url: str, node_addresses: list[str], own_addresses: set[str]) -> str | None:
    """Why Ray nodes on other machines cannot reach the Prefect API at `api_url`, or None: a loopback
    address is, on each machine, that machine itself. Nodes at one of this machine's `own_addresses` (a
    local cluster, `ray.cluster_utils.Cluster`, on 127.0.0.1 or the host's address) reach it."""
    import ipaddress
    from urllib.parse import urlparse

    host = urlparse(api_url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    others = sorted({a for a in node_addresses if a not in own_addresses and not ipaddress.ip_address(a).is_loopback})
    if not loopback or not others:
        return None
    return (f"the Prefect API of this run is {api_url}, on this machine only, and Prefect tasks also run on the "
            f"Ray nodes at {', '.join(others)}, which cannot reach it: set infra.prefect_api_url (or PREFECT_API_URL) "
            "to a Prefect server every node reaches")


def check_api_reachable(infra: InfraConfig) -> None:
    """Raise a ConfigError where a joined Ray cluster spans machines that cannot reach this run's Prefect API
    (`unreachable_api`), before any stage starts. A local Ray reaches it."""
    import psutil
    import ray

    from alignflow.errors import ConfigError

    if not infra.ray_address or not os.environ.get("PREFECT_API_URL"):  # no API of a server's: nothing to reach
        return
    nodes = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
    own = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    why = unreachable_api(os.environ["PREFECT_API_URL"], nodes, own)
    if why:
        raise ConfigError(why)


def warn_local_root_on_cluster(infra: InfraConfig) -> None:
    if infra.ray_address and is_local_uri(infra.storage.root):
        logging.getLogger("alignflow").warning(
            "infra.storage.root %s is a local path and the pipeline joins the Ray cluster at %s: actors on "
            "other nodes read and write it at the same path, so it must be a filesystem every node mounts; "
            "otherwise use an object store (s3://...)", infra.storage.root, infra.ray_address)


def result_storage(infra: InfraConfig):
    """Prefect results live under the artifact root, next to what they describe.

    Prefect needs the storage block saved server-side (so Ray workers can
    resolve it); its name is derived from the root, so reruns reuse it. The
    block holds no credentials: s3fs takes them from the environment.
    """
    import hashlib

    root = infra.storage.root.rstrip("/")
    name = "alignflow-results-" + hashlib.sha256(root.encode()).hexdigest()[:12]
    if is_local_uri(root):
        from prefect.filesystems import LocalFileSystem

        path = local_path(root) / "prefect-results"
        block = LocalFileSystem(basepath=str(path))
    else:
        from prefect.filesystems import RemoteFileSystem

        settings = {}
        if infra.storage.endpoint_url:
            settings["client_kwargs"] = {"endpoint_url": infra.storage.endpoint_url}
        block = RemoteFileSystem(basepath=f"{root}/prefect-results", settings=settings)
    block.save(name, overwrite=True)
    return block
