"""Shared fixtures: a real S3 endpoint (moto over HTTP), small pipeline
overrides, and a way to run the `alignflow` CLI in a subprocess that never
outlives its test.

Nothing here is mocked: `moto_s3` is `moto_server` listening on
127.0.0.1, reached by s3fs/boto3 over HTTP exactly like MinIO or AWS.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from alignflow.net import free_port

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
CLI_TIMEOUT_S = 1800  # a hang's guard: the small pipeline took 208-366 s; a loaded CI machine, several times that


# ---- order: the longest files first ----------------------------------------------

# The README's test command runs two workers (`-n 2 --dist loadfile`): each file runs whole on one of them
# (its module-scoped Ray or servers started once), handed out in collection order as a worker frees up.
# The longest go first, so that neither worker is left running one alone at the end. Within a file, and
# for every file not named, the collection order stays.
LONGEST_FIRST = (
    "e2e/test_e2e_pipeline.py",
    "e2e/test_e2e_resume.py",
    "engines/rl/test_rl_rounds.py",
    "engines/train/test_train_trainer.py",
    "e2e/test_e2e_deploy.py",
    "engines/train/test_train_memory.py",
    "e2e/test_e2e_multinode.py",
    "engines/rl/test_rl_wiring.py",
    "engines/test_engines_lora.py",
    "engines/test_engines_bench.py",
)


def pytest_configure(config):
    # xdist hands files out by their number of tests unless told not to: by this order instead.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    tests = REPO / "tests"
    items.sort(key=lambda item: rank.get(item.path.relative_to(tests).as_posix(), len(rank)))


@pytest.fixture(autouse=True)
def _environment_restored():
    """Whatever a test sets in os.environ (console.setup's quiet settings, a cluster helper's) ends with it:
    a later test, in whichever order the workers run them, starts from the environment its fixtures made.
    (A deployed run whose worker inherited PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL=WARNING from a console test
    printed no stage lines.)"""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


# ---- processes -----------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, session id, start time) of a process, None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[3]), int(fields[19])


def process_tree(root: int) -> dict[int, int]:
    """{pid: start time} of `root`, its descendants and everything in its session.

    Descendants cover processes that left the session (the CLI's Prefect
    server); the session covers those reparented to init (orphaned Ray
    workers). Start times guard against pid reuse when killing later.
    """
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st and st[0] != "Z":
                table[int(entry.name)] = st
    found = {pid: st[3] for pid, st in table.items() if st[2] == root}
    if root in table:
        found[root] = table[root][3]
    changed = True
    while changed:
        changed = False
        for pid, st in table.items():
            if pid not in found and st[1] in found:
                found[pid] = st[3]
                changed = True
    return found


def alive(pids: dict[int, int]) -> dict[int, int]:
    """The processes of `pids` still running (zombies count as gone)."""
    out = {}
    for pid, start in pids.items():
        st = _stat(pid)
        if st and st[0] != "Z" and st[3] == start:
            out[pid] = start
    return out


def kill_tree(pids: dict[int, int], sig: int = signal.SIGKILL) -> None:
    for pid in alive(pids):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


@dataclasses.dataclass
class CliResult:
    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        return self.stdout + "\n" + self.stderr

    def describe(self) -> str:
        """For assertion messages: the command and the tail of its output."""
        return (f"alignflow {' '.join(self.args)}\n-> exit {self.returncode} after {self.seconds:.0f} s\n"
                f"--- stdout (tail) ---\n{self.stdout[-3000:]}\n--- stderr (tail) ---\n{self.stderr[-6000:]}")


def run_cli(args: list[str], *, env: dict[str, str], cwd: Path, timeout: float = CLI_TIMEOUT_S,
            verbose: bool = True) -> CliResult:
    """`python -m flows.cli ARGS` in its own session; on timeout the whole tree is killed.

    `verbose` adds `-v` after the command (the per-stage `stages:` block the
    tests parse, every log line); the quiet console has a test of its own.
    Output goes to files next to `cwd` (a CLI run prints a lot through Ray).
    """
    if verbose and args:
        args = [args[0], "-v", *args[1:]]
    cwd.mkdir(parents=True, exist_ok=True)
    tag = f"{int(time.time() * 1000)}-{secrets.token_hex(2)}"
    out_path, err_path = cwd / f"cli-{tag}.out", cwd / f"cli-{tag}.err"
    t0 = time.monotonic()
    with open(out_path, "w") as out, open(err_path, "w") as err:
        # SIGINT as a terminal's foreground job has it: a shell without job control (`cmd &`, some CI
        # runners) starts its background jobs with SIGINT ignored, and children inherit that.
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=env,
                                stdout=out, stderr=err, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            tree = process_tree(proc.pid)
            kill_tree(tree)
            proc.wait()
            pytest.fail(f"alignflow {' '.join(args)} did not finish in {timeout} s; output in {out_path}, {err_path}")
        finally:
            kill_tree(process_tree(proc.pid))  # nothing it started outlives it
    return CliResult(args, rc, out_path.read_text(), err_path.read_text(), time.monotonic() - t0)


@pytest.fixture(scope="session")
def alignflow_cli() -> Callable[..., CliResult]:
    """`run(args, env=..., cwd=..., timeout=900) -> CliResult` (see run_cli)."""
    return run_cli


def kill_at_checkpoint(args: list[str], *, env: dict[str, str], cwd: Path, checkpoint_glob: Path,
                       timeout: float = 600, signum: int = signal.SIGKILL, every_process: bool = False) -> int:
    """Start `python -m flows.cli ARGS`, send `signum` to its process group as soon as a
    file matching `checkpoint_glob` (absolute, with wildcards) exists (SIGINT: what Ctrl-C
    sends a terminal's foreground group), or with `every_process` to every process it started,
    its servers and Ray's included (a systemd or Slurm stop), and assert that everything it started (CLI, Ray
    head and workers, the Prefect server) is gone within 60 s of the CLI's exit, without
    `ray stop`. Returns the CLI's exit status.
    """
    root, pattern = Path(checkpoint_glob.anchor), str(checkpoint_glob.relative_to(checkpoint_glob.anchor))
    cwd.mkdir(parents=True, exist_ok=True)
    with open(cwd / "killed.out", "w") as out, open(cwd / "killed.err", "w") as err:
        # SIGINT as a terminal's foreground job has it: a shell without job control (`cmd &`, some CI
        # runners) starts its background jobs with SIGINT ignored, and children inherit that.
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=env,
                                stdout=out, stderr=err, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    tree: dict[int, int] = {}
    try:
        deadline = time.monotonic() + timeout
        while not list(root.glob(pattern)):
            assert proc.poll() is None, \
                f"exited ({proc.returncode}) before a checkpoint: {(cwd / 'killed.err').read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"no checkpoint {checkpoint_glob} within {timeout} s"
            time.sleep(0.2)
        # The run's session (CLI, Ray head, Ray workers) and descendants in other
        # sessions (the CLI's Prefect server).
        tree = process_tree(proc.pid)
        if every_process:  # as systemd's and Slurm's stops do: every process of the unit or job step at once
            kill_tree(tree, signum)
        else:
            os.killpg(proc.pid, signum)
        proc.wait(timeout=30 if signum == signal.SIGKILL else 180)  # a stop ends its runs and servers first
        # Ray workers (own process groups) and the Prefect server (own session)
        # must go by themselves: Ray fate-sharing; the server's parent-death signal.
        deadline = time.monotonic() + 60
        while alive(tree) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = alive(tree)
        assert not left, "still running after the CLI was killed: " + ", ".join(
            f"{pid}: {Path(f'/proc/{pid}/cmdline').read_bytes()[:120]!r}" for pid in left)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        kill_tree(tree)
    return proc.returncode


@pytest.fixture(scope="session")
def process_tools():
    """process_tree / alive / kill_tree, for tests that kill a run on purpose."""
    import types

    return types.SimpleNamespace(tree=process_tree, alive=alive, kill=kill_tree, kill_at_checkpoint=kill_at_checkpoint,
                                 stop_session=stop_session)


# ---- MLflow ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_local(request):
    """A local Ray for one test module, started as the pipeline starts it (127.0.0.1, process env).

    Functions defined in the test module are shipped to Ray workers by value:
    the workers cannot import test modules by name.
    """
    import ray
    import ray.cloudpickle

    from alignflow.cluster import init_ray, ray_init_kwargs
    from alignflow.config import InfraConfig

    if ray.is_initialized():  # one an in-process flow of an earlier module started (a stage's ensure_ray)
        ray.shutdown()
    ray.cloudpickle.register_pickle_by_value(request.module)
    init_ray(**ray_init_kwargs(InfraConfig()))  # started again if its node times out starting
    try:
        yield ray
    finally:
        ray.shutdown()
        ray.cloudpickle.unregister_pickle_by_value(request.module)


@pytest.fixture(scope="module")
def warm_actors(ray_local):
    """Trainer ranks, rollout engines and scorers reused across one test module's tests (engines/placement/warm.py:
    `keep_warm()`): a start takes the process the last of its kind left where it matches, about 10-17 s of CPU
    each not spent on imports. A test that counts the processes a round starts and ends runs inside
    `warm_actors.paused()`."""
    from engines.placement.warm import keep_warm

    with keep_warm() as pool:
        yield pool


@pytest.fixture(scope="module")
def tracker(tmp_path_factory):
    """A Tracker (experiment `alignflow-test`) on a fresh SQLite file, per test module;
    MLflow's process-wide settings restored afterwards."""
    import mlflow.tracking._tracking_service.utils as tracking_utils
    import mlflow.tracking.fluent as fluent

    tmp_path = tmp_path_factory.mktemp("mlflow")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tracking_utils, "_tracking_uri", tracking_utils._tracking_uri)
        mp.setattr(fluent, "_active_experiment_id", fluent._active_experiment_id)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
        mp.chdir(tmp_path)  # the default artifact location (./mlruns) stays in tmp_path
        from alignflow.tracking.runs import Tracker

        yield Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "alignflow-test")


@pytest.fixture
def mlflow_ui(tmp_path):
    """(the SQLite URI, the UI's base URL) of `mlflow ui` on a store of its own, started as the CLI's report
    tells a user to start it."""
    from alignflow.tracking.runs import Tracker

    uri, port = f"sqlite:///{tmp_path / 'mlflow.db'}", free_port()
    Tracker(uri, "alignflow")  # the store's tables, before the server reads it
    base = f"http://127.0.0.1:{port}"
    with http_server([str(VENV_BIN / "mlflow"), "ui", "--backend-store-uri", uri, "--port", str(port)],
                     f"{base}/health", tmp_path / "mlflow-ui.log", timeout=180, cwd=tmp_path):
        yield uri, base


# ---- S3 --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class S3Server:
    endpoint_url: str
    bucket: str
    access_key_id: str
    secret_access_key: str

    def fs(self):
        import s3fs

        return s3fs.S3FileSystem(client_kwargs={"endpoint_url": self.endpoint_url}, skip_instance_cache=True)


def stop_session(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM to a process started with start_new_session=True and all its session (the workers a
    server forked); SIGKILL to what is left after `timeout` s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def http_server(args: list[str], url: str, log_path: Path, timeout: float, cwd: Path | None = None
                ) -> Iterator[subprocess.Popen]:
    """A server process (its output in `log_path`), once `url` answers HTTP; stopped, session and all, after."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not _answers_http(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{Path(args[0]).name} did not start in {timeout:.0f} s; see {log_path}")
            time.sleep(0.2)
        yield proc
    finally:
        stop_session(proc, timeout=15)


def _answers_http(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True  # it answered
    except OSError:
        return False


@pytest.fixture(scope="session")
def moto_s3(tmp_path_factory) -> Iterator[S3Server]:
    """A real HTTP S3 endpoint (`moto_server`) with one bucket, for the session.

    Dummy credentials and the region are set in os.environ (so subprocesses
    inherit them) and restored afterwards.
    """
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("moto") / "moto_server.log"
    server = S3Server(endpoint_url=endpoint, bucket="alignflow-e2e",
                      access_key_id="e2e-dummy-key-id-" + secrets.token_hex(4),
                      secret_access_key="e2e-dummy-secret-" + secrets.token_hex(8))
    with http_server([str(VENV_BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)], endpoint, log_path,
                     timeout=60), pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", server.access_key_id)
        mp.setenv("AWS_SECRET_ACCESS_KEY", server.secret_access_key)
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        for var in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "FSSPEC_S3_ENDPOINT_URL"):
            mp.delenv(var, raising=False)
        import boto3

        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=server.bucket)
        yield server


# ---- pipeline runs -------------------------------------------------------------

# Small enough for a 2-core CPU, big enough that every stage does real work.
SMALL_OVERRIDES = [
    "data.synthetic.num_sft=256", "data.synthetic.num_preference=256",
    "data.synthetic.num_eval=32", "data.synthetic.num_rl_prompts=32",
    "sft.epochs=1", "sft.max_steps=8", "sft.batch_size=16", "sft.log_every=2",
    "reward_model.max_steps=8", "reward_model.batch_size=16", "reward_model.log_every=2",
    "evaluation.generation.num_samples=2",
]

# One small RL round per run (the default config has two of 20 steps each).
SMALL_ROUND = {"steps": 2, "prompts_per_step": 8, "generation": {"num_samples": 2, "max_new_tokens": 8},
               "ppo": {"epochs": 1, "minibatch_size": 16}}


def rounds_override(n: int) -> list[str]:
    """`rounds=[...]` with n small rounds (none: no RL stages at all)."""
    import json

    from alignflow.config import PipelineConfig, RoundConfig

    if "rounds" not in PipelineConfig.model_fields:
        return []
    small = {k: v for k, v in SMALL_ROUND.items() if k in RoundConfig.model_fields}
    return [f"rounds={json.dumps([small] * n)}"]


@pytest.fixture(scope="session")
def small_pipeline_args() -> Callable[..., list[str]]:
    """`make(base_dir, storage_root=None, endpoint_url=None, rounds=1) -> overrides`.

    Fast settings, artifacts under `storage_root` (default
    `base_dir/artifacts`), MLflow in `base_dir/mlflow.db`, remote-checkpoint
    cache in `base_dir/cache`. The overrides are validated here, so a config
    change that breaks them fails at once, naming the field.
    """
    from alignflow.config import load_config

    def make(base_dir: Path, storage_root: str | None = None, endpoint_url: str | None = None,
             rounds: int = 1) -> list[str]:
        args = [
            *SMALL_OVERRIDES,
            *rounds_override(rounds),
            f"infra.storage.root={storage_root or base_dir / 'artifacts'}",
            f"infra.storage.cache_dir={base_dir / 'cache'}",
            f"infra.mlflow_tracking_uri=sqlite:///{base_dir / 'mlflow.db'}",
        ]
        if endpoint_url:
            args.append(f"infra.storage.endpoint_url={endpoint_url}")
        load_config(None, args)  # ConfigError names the field
        return args

    return make


GPU_SHAPE = ("hidden_size: 1024, num_layers: 28, num_heads: 16, num_kv_heads: 2, intermediate_size: 4864",
             "hidden_size: 128, num_layers: 2, num_heads: 2, num_kv_heads: 1, intermediate_size: 256")


@pytest.fixture(scope="session")
def gpu_config_on_cpu() -> Callable[[Path], Path]:
    """`write(directory) -> path`: configs/gpu-small.yaml as it is, but at a small shape (2 layers,
    hidden 128; still Qwen2, tied, bf16) and with no GPU in any placement: its pipeline, colocated
    rounds included, on the CPU."""

    def write(directory: Path) -> Path:
        text = (REPO / "configs" / "gpu-small.yaml").read_text()
        assert text.count(GPU_SHAPE[0]) == 1 and text.count("num_gpus: 1") == 8, \
            "configs/gpu-small.yaml changed: update tests/conftest.py:gpu_config_on_cpu"
        path = Path(directory) / "gpu-small-on-cpu.yaml"
        path.write_text(text.replace(*GPU_SHAPE).replace("num_gpus: 1", "num_gpus: 0"))
        return path

    return write


@pytest.fixture(scope="session")
def cli_env(tmp_path_factory) -> Callable[..., dict[str, str]]:
    """`env(**extra) -> environment` for CLI subprocesses, from os.environ *now*
    (so S3 credentials set by `moto_s3` are in it).

    The CLI starts its own Prefect API (PREFECT_API_URL unset) unless given
    one (`PREFECT_API_URL=shared_prefect_api()`), on a Prefect home of this
    session's own.
    """
    prefect_home = str(tmp_path_factory.mktemp("prefect_home"))

    def make(**extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("PREFECT_API_URL", None)
        env.update({"PREFECT_HOME": prefect_home, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
                    "RAY_USAGE_STATS_ENABLED": "0"})
        env.update(extra)
        return env

    return make


@contextlib.contextmanager
def prefect_server_of_its_own(base: Path) -> Iterator[dict[str, str]]:
    """A Prefect server started as the CLI starts its own (flows.runtime.prefect_api), on a Prefect home and
    with its log under `base`; yields the variables that point a process at it (PREFECT_HOME, PREFECT_API_URL).
    prefect_api exports them in this process too: they are put back as they were once the server is up, so
    that only the processes given them use it."""
    from alignflow.config import InfraConfig
    from flows.runtime import prefect_api

    saved = {k: os.environ.get(k) for k in ("PREFECT_HOME", "PREFECT_API_URL")}

    def restore() -> None:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    home = str(base / "prefect_home")
    os.environ["PREFECT_HOME"] = home
    os.environ.pop("PREFECT_API_URL", None)
    try:
        with prefect_api(InfraConfig(), base) as url:
            restore()
            yield {"PREFECT_HOME": home, "PREFECT_API_URL": url}
    finally:
        restore()


@pytest.fixture(scope="session")
def own_prefect_server() -> Callable[[Path], contextlib.AbstractContextManager[dict[str, str]]]:
    """`prefect_server_of_its_own`, for a module's fixture that needs a server it alone uses."""
    return prefect_server_of_its_own


@pytest.fixture(scope="module")
def shared_prefect_api(tmp_path_factory) -> Iterator[Callable[[], str]]:
    """`url()`: the API of one Prefect server that a module's CLI runs share (`cli_env(PREFECT_API_URL=url())`,
    what a user with a Prefect server of their own does), started at the first call (prefect_server_of_its_own)
    and stopped with the module. A CLI run given it starts no server: about 7.5 s of CPU less a run on 2 cores.
    Runs that test the CLI's own server (one that does not start, a stopped CLI leaving nothing behind) keep
    theirs."""
    urls: list[str] = []
    with contextlib.ExitStack() as stack:

        def url() -> str:
            if not urls:
                server = stack.enter_context(prefect_server_of_its_own(tmp_path_factory.mktemp("shared_prefect")))
                urls.append(server["PREFECT_API_URL"])
            return urls[0]

        yield url


# ---- a real browser ----------------------------------------------------------------

CHROMIUM = Path("/usr/bin/chromium")  # Debian's (install.sh --test); playwright's own download is unreachable
# Headless, and nothing reaching out: on our closed network Chromium's background connections are refused.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


@pytest.fixture
def browser_page():
    """A page of a headless Debian Chromium driven by playwright, 1400x900; skips, saying why, without either."""
    if not CHROMIUM.exists():
        pytest.skip(f"no browser: {CHROMIUM} is not installed (as root: apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (./install.sh --test)")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.set_default_timeout(180_000)  # a page and its form, on a loaded machine
            yield page
        finally:
            browser.close()
