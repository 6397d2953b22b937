"""A local Ray started by alignflow, and the process groups it runs, listen on loopback only; a local Ray whose
node times out starting (Ray gives its raylet a fixed 30 s) is ended and started once more.

Every listening TCP socket and every bound, unconnected UDP socket of the Ray
session (driver, gcs_server, raylet, dashboard/runtime-env agents, monitor,
idle workers, an actor) must be on 127.0.0.1 or ::1; anything else is named.
The session also trains: two DeepSpeed ranks, whose group's store rank 0
serves, and a weight update streamed into a rollout engine over a transport
group whose store the trainer serves. torch's TCPStore listens on every
interface unless it is handed a socket (engines/placement/rendezvous.py).

Ray runs in a subprocess of its own session, so it neither disturbs nor
reuses a Ray of this test session, and the child imports `ray` before
alignflow sets anything: that is the order in which a loopback start used to
come out on the host's address (alignflow/cluster.py: loopback_only).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]
LOOPBACK = {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")}

CHILD = r"""
import os, sys
import ray  # first, as in a test session or the CLI's warm-up
from alignflow.cluster import ensure_ray
from alignflow.config import InfraConfig

ensure_ray(InfraConfig(ray_num_cpus=4))

@ray.remote(num_cpus=1)
class Echo:
    def pid(self):
        return os.getpid()

actor = Echo.remote()
pid = ray.get(actor.pid.remote())

# Process groups, kept up while the test looks: the trainers' (rank 0 serves its store) and the weight
# transport's (the trainer serves its store; the engine joins it).
from alignflow.config import EngineConfig, TinyModelConfig
from engines.models import build_tiny_model
from engines.rollout.actors import RolloutEngines, start_rollout_actor
from engines.train.group import TrainerGroup
from engines.train.spec import EngineSpec
from engines.transport.sync import WeightSync

model = build_tiny_model(TinyModelConfig(hidden_size=32, num_layers=1, intermediate_size=64), seed=0,
                         out_dir=sys.argv[1])
spec = EngineSpec.from_config(EngineConfig(), model_path=str(model), kind="causal", total_steps=1, global_batch=2,
                              dtype="float32", torch_threads=1, seed=0)
group = TrainerGroup(spec, 2)
engine = start_rollout_actor("hf", str(model), num_cpus=0, torch_threads=1)
WeightSync(group, RolloutEngines([engine]), bucket_bytes=2**20).push()
print("READY", pid, flush=True)
sys.stdin.readline()  # until the test closes stdin
ray.shutdown()
"""


def _on_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped  # ::ffff:127.0.0.1: IPv4 loopback through an IPv6 socket
    return addr in LOOPBACK


def _label(proc: psutil.Process) -> str:
    """The process name; for Python, with its script (monitor.py, dashboard.py) or `-c` (the driver)."""
    name = proc.name()
    if name.startswith("python"):
        args = proc.cmdline()[1:]
        script = next((os.path.basename(a) for a in args if a.endswith(".py")), args[0] if args else "")
        name = f"{name} {script}".strip()
    return name


def _listeners(pids) -> dict[tuple, str]:
    """{(pid, proto, ip, port): process} of listening TCP and bound, unconnected UDP sockets."""
    found = {}
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            name = _label(proc)
            conns = proc.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        for c in conns:
            tcp = c.type == socket.SOCK_STREAM
            if (tcp and c.status == psutil.CONN_LISTEN) or (not tcp and c.laddr and not c.raddr):
                found[(pid, "TCP" if tcp else "UDP", c.laddr.ip, c.laddr.port)] = name
    return found


def _wait_ready(proc: subprocess.Popen, timeout: float) -> int:
    box: list[int] = []

    def read():
        for line in proc.stdout:
            if line.startswith("READY "):
                box.append(int(line.split()[1]))
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    assert box, f"the local Ray did not start within {timeout} s (exit code {proc.poll()})"
    return box[0]


def test_local_ray_listens_onloopback_only(process_tools, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    # A local Ray is the run's own: not the cluster RAY_ADDRESS names (nothing listens there; joining it would
    # fail), nor one another process started on this machine (ray.init() with no address would join that).
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_ADDRESS="127.0.0.1:9")
    err_path = tmp_path / "ray_child.err"
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "model")], cwd=REPO, env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    tree: dict[int, int] = {}
    try:
        try:
            actor_pid = _wait_ready(proc, timeout=240)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{err_path.read_text()[-3000:]}") from None
        # Listeners opened a little after start (idle workers, metrics servers) are seen too:
        # sampled until nothing new comes for 2 s (8 s at most).
        found: dict[tuple, str] = {}
        quiet_since, deadline = time.monotonic(), time.monotonic() + 8
        while time.monotonic() - quiet_since < 2 and time.monotonic() < deadline:
            tree.update(process_tools.tree(proc.pid))
            new = _listeners(tree)
            if new.keys() - found.keys():
                found.update(new)
                quiet_since = time.monotonic()
            time.sleep(0.5)

        names = set(found.values())
        assert {"gcs_server", "raylet"} <= names, f"no listener of gcs_server and raylet among {sorted(names)}"
        # Only actors were started: a worker that ran none is one Ray started ahead for tasks of no
        # runtime_env, which a run's tasks (they have one) never take (alignflow/cluster.py: prestart off).
        assert not {n for n in names if "IDLE" in n}, sorted(names)
        assert any(pid == actor_pid for pid, *_ in found), f"the actor ({actor_pid}) has no listener: {found}"
        # The process groups' members were looked at: both trainer ranks (rank 0 serves both stores) and the engine.
        trainers = {pid for (pid, *_), name in found.items() if "TrainWorker" in name}
        assert len(trainers) == 2 and any("RolloutActor" in name for name in found.values()), sorted(found.items())
        exposed = [f"{name} (pid {pid}): {proto} {ip}:{port}"
                   for (pid, proto, ip, port), name in sorted(found.items()) if not _on_loopback(ip)]
        assert not exposed, (f"{len(exposed)} of {len(found)} sockets of the local Ray are not on loopback:\n"
                             + "\n".join(exposed))
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        tree.update(process_tools.tree(proc.pid))
        process_tools.kill(tree)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# Ray's own failure, injected where Ray raises it: the first node (or, "always", every node) starts its processes,
# then times out waiting for its raylet (as a busy machine made it do in CI). Meanwhile a child that is not Ray's
# starts too (as the CLI's Prefect server may): it is left alone. Any other error is not retried.
RETRY_CHILD = r"""
import json, os, subprocess, sys
import psutil, ray
import ray._private.node as node_mod
from alignflow.cluster import init_ray, ray_init_kwargs
from alignflow.config import InfraConfig

real, nodes, failure, bystanders = node_mod.Node.__init__, [], sys.argv[1], []

def fails(self, *args, **kwargs):
    real(self, *args, **kwargs)
    nodes.append(self)
    bystanders.append(subprocess.Popen(["sleep", "120"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    if len(nodes) == 1 or failure == "always":
        raise (ValueError("a node that does not start for another reason") if failure == "other" else
               Exception("The current node timed out during startup. This could happen because some of the "
                         "raylet failed to startup or the GCS has become overloaded."))

def alive(pids):
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]

node_mod.Node.__init__ = fails
result = {}
try:
    init_ray(**ray_init_kwargs(InfraConfig(ray_num_cpus=1)))
    result["answer"] = ray.get(ray.remote(lambda x: x + 1).remote(41))
except Exception as err:
    result["error"] = str(err)[:60]
ours = [[info.process.pid for infos in n.all_processes.values() for info in infos] for n in nodes]
result.update(nodes=len(nodes), started=[len(p) for p in ours], alive=[alive(p) for p in ours],
              bystanders=len(alive([b.pid for b in bystanders])))
print(json.dumps(result), flush=True)
for b in bystanders:
    b.kill()
ray.shutdown()
"""


@pytest.mark.parametrize("failure", ["timeout", "always", "other"])
def test_a_local_ray_that_times_out_starting_is_ended_and_started_again(failure, process_tools, tmp_path):
    import json

    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-c", RETRY_CHILD, failure], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        process_tools.kill(process_tools.tree(proc.pid))
    assert proc.returncode == 0, err[-3000:]
    got = json.loads(out.strip().splitlines()[-1])
    assert all(got["started"]) and got["bystanders"] == got["nodes"], got  # no child but Ray's was ended
    if failure == "other":  # not Ray's start timeout: raised as it came, not tried again
        assert got["error"] == "a node that does not start for another reason" and got["nodes"] == 1, got
        assert "starting it again" not in err
        return
    assert "attempt 2 of 3" in err and "a local Ray did not start in the 30 s Ray gives its node" in err, err[-3000:]
    if failure == "timeout":  # the second start serves; the first one's processes are gone
        assert got["nodes"] == 2 and got["answer"] == 42 and got["alive"][0] == [], got
    else:  # all three timed out: the error raised, and no start left a process
        assert got["nodes"] == 3 and "attempt 3 of 3" in err, got
        assert got["error"].startswith("The current node timed out during startup") and got["alive"] == [[]] * 3, got
