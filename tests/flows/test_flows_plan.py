"""`alignflow plan`, targets, the report, and a real Prefect flow walking the planned graph.

The CLI runs in a subprocess, as a user runs it; `plan` must start neither
Prefect nor Ray. The flow test uses a Prefect test server and the thread
pool task runner (the Ray task runner is covered end to end in tests/e2e).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from alignflow.config import cache_relevant, load_config, resolve_paths
from alignflow.store.storage import Storage
from tasks.plan import plan_pipeline

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(cwd), "PYTHONPATH": str(REPO)})


def plan_rows(stdout: str) -> dict[str, list[str]]:
    """{stage: [kind, inputs, key, state]} from the plan table, cut at the header's column starts."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == ["stage"])
    header = lines[start]
    cuts = [header.index(col) for col in ("stage", "kind", "inputs", "key", "state")] + [None]
    rows = {}
    for line in lines[start + 1:]:
        if not line.startswith("  ") or line.split()[0] == "skipped:":
            break
        cells = [line[a:b].strip() for a, b in zip(cuts, cuts[1:])]
        rows[cells[0]] = cells[1:]
    return rows


def test_plan_prints_every_stage_with_key_and_state(tmp_path):
    res = cli("plan", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rows = plan_rows(res.stdout)
    expected = plan_pipeline(resolve_paths(load_config(), tmp_path))
    assert list(rows) == list(expected.stages)
    for name, stage in expected.stages.items():
        kind, _, key, state = rows[name]
        assert (kind, key) == (stage.kind, stage.key), name
        assert state == "will run: never committed", name
    assert rows["round_2"][1] == "data, policy=round_1, reference=sft, reward=reward_model"
    assert "Prefect API" not in res.stdout + res.stderr
    assert not (tmp_path / "artifacts").exists(), "plan wrote artifacts"
    assert res.stderr.strip().splitlines()[-1] == ("inputs not checked (data files, model, rewards, storage): "
                                                   "`alignflow validate` checks them")


def test_a_bare_command_prints_help_and_a_closed_pipe_ends_quietly(tmp_path):
    """`alignflow` alone printed a usage error; `alignflow plan | head -1` a BrokenPipeError traceback (where the
    reader is gone before the plan is written: `| true`, which reads nothing)."""
    bare = cli(cwd=tmp_path)
    assert bare.returncode == 0 and bare.stdout.startswith("usage: alignflow") and "{run,plan,validate,stage}" in \
        bare.stdout, bare.stderr
    piped = subprocess.run(["bash", "-c", f"{sys.executable} -m flows.cli plan | true; exit ${{PIPESTATUS[0]}}"],
                           cwd=tmp_path,
                           capture_output=True, text=True, timeout=120,
                           env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(REPO)})
    assert piped.returncode == 0 and "Traceback" not in piped.stderr, piped.stderr


def test_a_broken_pipe_inside_a_run_is_its_error_not_a_closed_stdout(tmp_path, monkeypatch):
    """Only a write to stdout that finds its reader gone ends quietly: a stage's own broken connection (S3, a
    reward service) failed the run but returned 0 when every BrokenPipeError counted as the reader's."""
    import flows.cli as cli_module

    def broken(*args, **kwargs):
        raise BrokenPipeError("the reward service closed its connection")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli_module, "_run", broken)
    with pytest.raises(BrokenPipeError, match="reward service"):
        cli_module.main(["run", f"infra.storage.root={tmp_path / 'a'}"])


def test_plan_says_cached_and_why(tmp_path):
    root = tmp_path / "artifacts"
    stage = plan_pipeline(resolve_paths(load_config(), tmp_path)).stages["sft"]
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"weights")
    Storage(root=str(root)).commit(src, f"{root}/sft/{stage.key}", meta={
        "config": cache_relevant(stage.config), "input_keys": stage.input_keys, "code_version": stage.code_version})

    same = plan_rows(cli("plan", cwd=tmp_path).stdout)
    assert same["sft"][3] == "Cached"
    changed = cli("plan", "sft.epochs=4", "reward_model=null", 'rounds=[{"algorithm": "grpo", "reward": {"source": "rule"}}]',
                  cwd=tmp_path)
    rows = plan_rows(changed.stdout)
    assert rows["sft"][3] == "will run: config changed: train.epochs 3.0 -> 4.0"
    assert "reward_model" not in rows
    assert "skipped: reward_model (the config has no reward_model section)" in changed.stdout


def test_unknown_target_fails_before_anything_starts(tmp_path):
    res = cli("stage", "sfft", cwd=tmp_path)
    assert res.returncode == 2
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: no stage 'sfft' in this pipeline; did you mean 'sft'? valid: ") and "rl" in last and "sft" in last
    assert "Prefect API" not in res.stdout + res.stderr


def documented_commands() -> list[str]:
    """Every `alignflow run|plan|validate|stage ...` command README.md quotes (code spans may wrap
    lines; fenced blocks) and every one in a config file's header comment."""
    import re

    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", readme, flags=re.S | re.M)
    spans = [line.split("#")[0].strip() for block in blocks for line in block.splitlines()]
    spans += [" ".join(m.split()) for m in re.findall(r"`([^`]+)`", re.sub(r"^```.*?^```", "", readme, flags=re.S | re.M))]
    spans += [line.lstrip("# ").strip() for f in sorted((REPO / "configs").glob("*.yaml"))
              for line in f.read_text().splitlines() if line.startswith("#")]
    found = [re.search(r"(?:\.venv/bin/)?alignflow (?:run|plan|validate|stage)\b.*", s) for s in spans]
    return sorted({m.group(0).removeprefix(".venv/bin/") for m in found if m})


def test_every_documented_command_parses_and_plans(tmp_path):
    """A command the docs give is one a user will paste: each plans (its arguments parse, its config
    and overrides load, the graph builds) from a directory holding the repository's configs."""
    import shlex
    import shutil

    shutil.copytree(REPO / "configs", tmp_path / "configs")
    commands = documented_commands()
    assert {"alignflow run", "alignflow run configs/dpo.yaml", "alignflow run configs/gpu-small.yaml"} <= set(commands)
    for command in commands:
        words = shlex.split(command)[1:]
        args = words[2:] if words[0] == "stage" else words[1:]
        res = cli("plan", *args, cwd=tmp_path)
        assert res.returncode == 0, f"{command}: {res.stderr.strip().splitlines()[-1:]}"
        assert "base_model" in plan_rows(res.stdout), command


def test_report_table_without_a_reward_model():
    from flows.report import PipelineReport

    report = PipelineReport(
        mlflow_run_id="r", mlflow_tracking_uri="sqlite:///x", storage_root="/a", stage_uris={}, stage_states={},
        policies={"sft": {"eval/accuracy": 0.25, "eval/kl_to_reference": -1e-7, "eval/response_length": 2.0},
                  "round_1": {"eval/accuracy": 0.5, "eval/kl_to_reference": 4.0, "eval/response_length": 2.0}},
        kl_budgets={"round_1": 3.0})
    lines = report.table().splitlines()
    assert lines[0].split() == ["policy", "accuracy", "reward", "kl_to_reference", "response_length"]
    assert lines[2].split() == ["sft", "0.250", "-", "0.000", "2.000"]
    assert "reward model" not in report.table()
    assert lines[-1] == "round_1: KL to reference 4.000 OVER budget 3"


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def test_partial_pipeline_flow_runs_the_target_and_its_inputs(prefect_server, tmp_path):
    """A real Prefect flow run: the data target, submitted from the plan, committed, its parent run closed."""
    from mlflow import MlflowClient
    from prefect.task_runners import ThreadPoolTaskRunner

    from flows.pipeline import partial_pipeline

    cfg = resolve_paths(load_config(None, [
        "data.synthetic.num_sft=20", "data.synthetic.num_preference=20", "data.synthetic.num_eval=5",
        "data.synthetic.num_rl_prompts=5", f"infra.mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        "infra.task_retries=0"]), tmp_path)
    result = partial_pipeline.with_options(task_runner=ThreadPoolTaskRunner(max_workers=1))(cfg, "data")
    stage = plan_pipeline(cfg).stages["data"]
    assert list(result) == ["data"] and (result["data"].stage, result["data"].key) == ("data", stage.key)
    assert (tmp_path / "artifacts" / "data" / stage.key / "manifest.json").exists()
    assert (tmp_path / "artifacts" / "base_model").exists(), "the data stage needs the base tokenizer"
    assert not (tmp_path / "artifacts" / "sft").exists(), "ran a stage the target does not need"
    client = MlflowClient(cfg.infra.mlflow_tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("alignflow").experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert [r.info.status for r in parents] == ["FINISHED"]
    assert parents[0].data.tags["alignflow.key.data"] == stage.key


def test_a_cluster_of_other_machines_must_reach_the_prefect_api():
    """The CLI's own Prefect server listens on 127.0.0.1: Ray nodes of the joined cluster on other machines,
    where Prefect tasks run too, cannot reach it. Refused with what to set, before any stage starts."""
    from flows.runtime import unreachable_api

    own = {"127.0.0.1", "10.0.0.5", "::1"}
    why = unreachable_api("http://127.0.0.1:4200/api", ["10.0.0.5", "10.0.0.7", "10.0.0.8", "10.0.0.7"], own)
    assert why and "10.0.0.7, 10.0.0.8" in why and "10.0.0.5" not in why and "infra.prefect_api_url" in why
    assert unreachable_api("http://localhost:4200/api", ["10.0.0.9"], own)
    # a server every node can reach, or nodes all on this machine (ray.cluster_utils.Cluster): fine
    assert unreachable_api("http://prefect.internal:4200/api", ["10.0.0.7"], own) is None
    assert unreachable_api("http://10.0.0.5:4200/api", ["10.0.0.7"], own) is None
    assert unreachable_api("http://127.0.0.1:4200/api", ["127.0.0.1", "10.0.0.5"], own) is None


def test_a_storage_root_that_cannot_be_read_is_one_error_line(tmp_path):
    """The plan reads the storage root before preflight checks it: an S3 endpoint nobody listens on was a
    botocore traceback and exit 1, where a user error is one `error:` line naming the field, and exit 2."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-m", "flows.cli", "plan", "infra.storage.root=s3://bucket/af",
                          f"infra.storage.endpoint_url=http://127.0.0.1:{port}"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                                                      "PYTHONPATH": str(REPO), "AWS_ACCESS_KEY_ID": "x",
                                                      "AWS_SECRET_ACCESS_KEY": "y", "AWS_MAX_ATTEMPTS": "1"})
    assert out.returncode == 2, out.stderr[-2000:]
    [line] = [line for line in out.stderr.splitlines() if line.strip()]
    assert line.startswith("error: infra.storage.root s3://bucket/af cannot be read (") and "Traceback" not in out.stderr


def test_verbose_goes_before_the_command_or_after_it(tmp_path):
    """`alignflow -v validate` was an argparse error: -v was the commands' option alone."""
    from flows.cli import parse_args

    for args in (["-v", "validate", "a.b=1"], ["validate", "-v", "a.b=1"], ["validate", "a.b=1"],
                 ["-v", "stage", "sft", "a.b=1"], ["stage", "sft", "a.b=1", "-v"], ["stage", "sft", "a.b=1"]):
        ns = parse_args(args)
        assert ns.verbose is ("-v" in args) and ns.command == args[args[0] == "-v"] and ns.args == ["a.b=1"], args
    out = cli("-v", "validate", f"infra.storage.root={tmp_path / 'a'}", cwd=tmp_path)
    assert out.returncode == 0 and "config is valid" in out.stderr, out.stderr[-1500:]


def test_stage_alone_asks_for_its_target_only(capsys):
    """`alignflow stage` said both `name` and `args` were required; the config and overrides are optional."""
    from flows.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["stage"])
    assert capsys.readouterr().err.strip().endswith("error: the following arguments are required: name")
    assert parse_args(["stage", "sft"]).args == []
