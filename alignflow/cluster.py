"""How alignflow starts or joins Ray, in one place (flows and tasks both use it)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from alignflow.config import InfraConfig
from alignflow.errors import ConfigError
from alignflow.interrupts import sigterm_handler_kept

log = logging.getLogger(__name__)

# Set in the driver before Ray starts; Ray workers inherit them.
PROCESS_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    # Ray's "local only" mode: 127.0.0.1 becomes the node address (see loopback_only, which a
    # local start also needs when `ray` was imported before this was set).
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    # vLLM in-process inside its Ray actor: 3-5 s start instead of ~30 s.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    # The first logprobs request would otherwise JIT-compile for 12-15 s. A GPU engine's process drops
    # it again: there vLLM compiles and captures CUDA graphs (engines/rollout/actors.py).
    "TORCH_COMPILE_DISABLE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_LOGGING_LEVEL": "WARNING",
}

# Forwarded to Ray workers explicitly (they may run on other nodes). Never
# credentials: runtime_env is recorded by Ray; workers of a local Ray inherit
# the driver's environment, and a cluster's nodes carry their own.
FORWARDED_ENV = ("PREFECT_API_URL", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "MLFLOW_S3_ENDPOINT_URL",
                 # the console's quiet mode (flows/console.py), where the CLI set it
                 "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL",
                 "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY", "TQDM_DISABLE", "MLFLOW_LOGGING_LEVEL", "PYTHONWARNINGS",
                 "ALIGNFLOW_QUIET", "ALIGNFLOW_SCRATCH")


# `infra.allocator`: the environment that chooses the CPU allocator of a new process. Measured
# by bench/step/rl_step.py on the GRPO step (2 cores): glibc as it comes unmaps large freed blocks and
# trims its heap at every free, so each step maps and faults the same pages again.
JEMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
                  "/usr/lib64/libjemalloc.so.2", "/usr/lib/libjemalloc.so.2")
GLIBC_RETAIN = {"MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**30),
                "MALLOC_TOP_PAD_": str(2**28)}


def allocator_env(allocator: str) -> dict[str, str]:
    """Environment variables that give new processes `allocator` (an `infra.allocator` value)."""
    if allocator == "glibc_retain":
        return dict(GLIBC_RETAIN)
    if allocator == "jemalloc":
        path = next((p for p in JEMALLOC_PATHS if os.path.exists(p)), None)
        if path is None:
            raise ConfigError(f"infra.allocator: jemalloc, but libjemalloc.so.2 is in none of {JEMALLOC_PATHS} "
                              "(Debian/Ubuntu: apt-get install libjemalloc2); or choose glibc_retain")
        return {"LD_PRELOAD": path, "MALLOC_CONF": "dirty_decay_ms:-1,muzzy_decay_ms:-1"}
    return {}


def apply_process_env(infra: InfraConfig | None = None, local: bool = False) -> dict[str, str]:
    """Set the process environment Ray workers inherit (values already set win); what it set. `local`: for a
    local Ray, whose process groups stay on the loopback interface (loopback_env)."""
    wanted = {**PROCESS_ENV, **(allocator_env(infra.allocator) if infra else {}), **(loopback_env() if local else {})}
    for k, v in wanted.items():
        os.environ.setdefault(k, v)
    return {k: os.environ[k] for k in wanted}


def loopback_only() -> None:
    """Make the local Ray's node address 127.0.0.1, so that every Ray listener binds to loopback.

    Ray 2.60 binds its listeners by the node address: with 127.0.0.1 the GCS, raylet (node and
    object manager), core workers (driver, actors, idle workers), dashboard and runtime-env agents
    and the dashboard/monitor processes all bind 127.0.0.1; with any other address most bind to
    `::`/0.0.0.0, and the runtime-env agent and dashboard agent to the host's address. But
    `ray.init(_node_ip_address="127.0.0.1")` is no help on its own: Ray replaces a loopback address
    by the host's (`services.resolve_ip_for_localhost`) unless `ray_constants.ENABLE_RAY_CLUSTER` is
    False, and that constant is read from RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, when `ray` is
    first imported. Where `ray` came first (a test session, a notebook, an earlier import), setting the
    variable now is too late: the constant is set here as well (tests/engines/test_engines_ray_loopback.py).
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # and for every process it starts
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False


def loopback_env() -> dict[str, str]:
    """A local Ray's torch.distributed traffic kept on the loopback interface: gloo's connections and NCCL's
    bootstrap listen on the interface these name, by default the one the host name resolves to (often the
    LAN's). The groups' stores bind their own address (engines/placement/rendezvous.py)."""
    import psutil

    name = next((n for n, addrs in psutil.net_if_addrs().items() if any(a.address == "127.0.0.1" for a in addrs)),
                None)
    if name is None:
        raise RuntimeError(f"no network interface holds 127.0.0.1 (interfaces: {sorted(psutil.net_if_addrs())}): "
                           "a local Ray needs the loopback interface")
    return {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": name}


def torch_extensions_dir() -> str:
    """Where this environment's JIT-built torch ops live (DeepSpeed's shared-memory collective), built by
    install.sh: inside the virtual environment. torch's default, one directory per user, is shared by every
    environment, and an op built by one (its include paths in the build hash) is rebuilt by the next, 30-40 s."""
    return os.path.join(sys.prefix, "torch_extensions")


# A custom resource a local Ray started for a run has one of: the run's CPU evaluations take turns at it
# (flows/stage_tasks.py `evaluations_take_turns`). A cluster joined by address has none, and nothing waits for it.
EVALUATION_TURN = "alignflow_evaluation_turn"


def ray_init_kwargs(infra: InfraConfig) -> dict[str, Any]:
    """`ray.init` arguments: a local Ray on 127.0.0.1, or the configured cluster."""
    if not infra.ray_address:
        loopback_only()
        # Only where the workers are this machine's (they inherit it; a cluster's nodes keep their own).
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", torch_extensions_dir())
    applied = apply_process_env(infra, local=not infra.ray_address)
    env = {**applied, **{k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}}
    kwargs: dict[str, Any] = {"runtime_env": {"env_vars": env}}
    if infra.ray_address:
        return {"address": infra.ray_address, **kwargs}
    return {
        # A new Ray of this run's own: not a cluster another process started on this machine (`ray start`,
        # a test's cluster), which ray.init() with no address would join, nor one RAY_ADDRESS names.
        "address": "local",
        "num_cpus": infra.ray_num_cpus,
        "resources": {EVALUATION_TURN: 1},
        "include_dashboard": False,
        "object_store_memory": 512 * 2**20,
        # Ray starts a worker per CPU ahead, for tasks of no runtime_env; a run's tasks have one (env_vars
        # above) and never take them: each would only import Ray (~2.6 s of CPU on 2 cores) and wait.
        "_system_config": {"enable_worker_prestart": False, "prestart_worker_first_driver": False},
        # Kept as 127.0.0.1 only with loopback_only() (called above).
        "_node_ip_address": "127.0.0.1",
        **kwargs,
    }


# A new local node's raylet has a fixed 30 s to register with its GCS (ray/_private/node.py), after which
# `ray.init` raises, leaving the processes it started. Two cores that two other runs keep busy can take longer
# (seen in CI); another start, after ending what the last left, gets through.
LOCAL_START_ATTEMPTS = 3
START_TIMED_OUT = "timed out during startup"


def init_ray(*args: Any, **kwargs: Any) -> Any:
    """`ray.init(*args, **kwargs)`, keeping this thread's SIGTERM handler: Ray sets its own (`sys.exit(15)`),
    which would replace the CLI's (exit 143) and, inside a flow run, Prefect's (cancellation). A new local Ray
    (address "local") that times out starting is ended and started again (LOCAL_START_ATTEMPTS in all), with a
    warning."""
    import ray

    address = args[0] if args else kwargs.get("address")
    attempts = LOCAL_START_ATTEMPTS if address == "local" else 1
    with sigterm_handler_kept():
        for attempt in range(1, attempts + 1):
            before = _children()
            try:
                return ray.init(*args, **kwargs)
            except Exception as err:
                if START_TIMED_OUT not in str(err):
                    raise
                ended = _end_rays_since(before)  # the last attempt's too: none outlives the error
                if attempt == attempts:
                    raise
                log.warning("a local Ray did not start in the 30 s Ray gives its node (a busy machine?): ended the "
                            "%d processes it left and starting it again (attempt %d of %d)", ended, attempt + 1,
                            attempts)
    raise AssertionError("unreachable")


def _children() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children()}


def _end_rays_since(before: set[int]) -> int:
    """SIGKILL what a failed start left: this process's children not in `before` that run Ray's programs (its
    package's binaries and scripts: GCS, raylet, monitors), with their descendants (workers, agents). Any
    other child (the CLI's Prefect server) is left alone. Their number."""
    import psutil
    import ray

    home = os.path.dirname(ray.__file__)
    left = []
    for child in psutil.Process().children():
        try:
            if child.pid not in before and any(home in arg for arg in child.cmdline()):
                left += [child, *child.children(recursive=True)]
        except psutil.Error:
            continue
    for proc in left:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(left, timeout=10)
    return len(left)


def ensure_ray(infra: InfraConfig) -> None:
    """Inside a RayTaskRunner worker Ray is already up; otherwise start or join one."""
    import ray

    if not ray.is_initialized():
        init_ray(**ray_init_kwargs(infra))


SCRATCH_ENV = "ALIGNFLOW_SCRATCH"


@contextlib.contextmanager
def run_scratch() -> Iterator[str]:
    """The scratch directory of one run's stages (ALIGNFLOW_SCRATCH, which the Ray it starts forwards), removed
    however the run ends, and with it what a killed stage left (a base model's whole weights); where this
    process has one already (the CLI's, around its flow), that one."""
    if os.environ.get(SCRATCH_ENV):
        yield os.environ[SCRATCH_ENV]
        return
    scratch = os.environ[SCRATCH_ENV] = tempfile.mkdtemp(prefix="alignflow-run-")
    try:
        yield scratch
    finally:
        os.environ.pop(SCRATCH_ENV, None)
        shutil.rmtree(scratch, ignore_errors=True)


def scratch_dir() -> str | None:
    """Where a stage writes its files before committing them: its run's scratch directory (`run_scratch`: the
    CLI's and a deployed flow's), else the system's temporary directory (None). Made on this node if missing."""
    path = os.environ.get(SCRATCH_ENV)
    if path:
        os.makedirs(path, exist_ok=True)
    return path or None
