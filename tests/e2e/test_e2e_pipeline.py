"""End to end: the `alignflow` CLI in a subprocess, on real components.

Real Prefect API (the one the CLI starts), real local Ray, DeepSpeed on CPU,
vLLM on CPU, MLflow in SQLite, and S3 through `moto_server` over HTTP. One
S3-backed pipeline run (plus its cached rerun) is shared by the S3, MLflow
and checkpoint tests; the failure/retry and kill/resume tests use local
storage roots of their own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
import textwrap
from pathlib import Path

import pytest

from flows import console

pytestmark = pytest.mark.e2e

UPSTREAM = ("data", "base_model", "sft", "reward_model")
BASE_STAGES = {*UPSTREAM, "eval_base", "eval_sft", "eval_reward_model"}


# ---- reading what the CLI printed -------------------------------------------------


def parse_stages(stdout: str) -> dict[str, tuple[str, str]]:
    """The `stages:` block -> {stage: (state, uri)}."""
    lines = stdout.splitlines()
    assert "stages:" in lines, f"no 'stages:' block in:\n{stdout[-3000:]}"
    stages = {}
    for line in lines[lines.index("stages:") + 1 :]:
        if not line.startswith("  "):
            break
        parts = line.split()
        assert len(parts) == 3, f"stage line without a state: {line!r}"
        stages[parts[0]] = (parts[1], parts[2])
    assert stages, "empty stages block"
    return stages


def parse_table(stdout: str) -> dict[str, dict[str, float]]:
    """The comparison table -> {policy: {column: value}}."""
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["policy"])
    cols = lines[header].split()[1:]
    rows = {}
    for line in lines[header + 2 :]:
        parts = line.split()
        if not parts or parts[0] == "reward" or parts[0].endswith(":"):
            break
        rows[parts[0]] = {c: None if v == "-" else float(v) for c, v in zip(cols, parts[1:])}
    return rows


def parent_run_id(stdout: str) -> str:
    m = re.search(r"\(parent run ([0-9a-f]{32})\)", stdout)
    assert m, f"no MLflow parent run id in:\n{stdout[-2000:]}"
    return m.group(1)


def stage_json(stdout: str) -> dict:
    """`alignflow stage` prints the StageResult as indented JSON, last."""
    lines = stdout.splitlines()
    start = max(i for i, line in enumerate(lines) if line == "{")
    return json.loads("\n".join(lines[start:]))


def mlflow_client(tracking_uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri)


def experiment_id(client) -> str:
    exp = client.get_experiment_by_name("alignflow")
    assert exp is not None, "no 'alignflow' MLflow experiment"
    return exp.experiment_id


def child_runs(client, parent_id: str) -> list:
    return client.search_runs([experiment_id(client)], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'",
                              max_results=1000)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- the shared S3 pipeline run ---------------------------------------------------


@dataclasses.dataclass
class PipelineRun:
    result: object  # CliResult
    args: list[str]
    root: str
    base: Path
    mlflow_uri: str

    def require_ok(self) -> None:
        if self.result.returncode != 0:
            pytest.fail("the shared S3 pipeline run failed:\n" + self.result.describe())

    @property
    def stages(self) -> dict[str, tuple[str, str]]:
        return parse_stages(self.result.stdout)


@pytest.fixture(scope="module")
def s3_run(moto_s3, small_pipeline_args, cli_env, alignflow_cli, tmp_path_factory) -> PipelineRun:
    """One fresh pipeline run with every artifact on S3 (moto over HTTP)."""
    base = tmp_path_factory.mktemp("s3_run")
    root = f"s3://{moto_s3.bucket}/run"
    args = ["run", *small_pipeline_args(base, storage_root=root, endpoint_url=moto_s3.endpoint_url)]
    result = alignflow_cli(args, env=cli_env(), cwd=base / "cwd")
    return PipelineRun(result, args, root, base, f"sqlite:///{base / 'mlflow.db'}")


def s3_snapshot(fs, root: str) -> dict[str, tuple]:
    """Every stage object under root (not Prefect's result records, not a run's curves) with size, ETag, mtime."""
    found = fs.find(root, detail=True)
    return {path: (info.get("size"), info.get("ETag"), str(info.get("LastModified")))
            for path, info in found.items() if "/prefect-results/" not in path and "/curves/" not in path}


@pytest.fixture(scope="module")
def s3_cached_run(s3_run, moto_s3, cli_env, alignflow_cli):
    """The same command again, with S3 snapshots taken before and after."""
    s3_run.require_ok()
    fs = moto_s3.fs()
    before = s3_snapshot(fs, s3_run.root)
    result = alignflow_cli(s3_run.args, env=cli_env(), cwd=s3_run.base / "cwd")
    fs.invalidate_cache()
    after = s3_snapshot(fs, s3_run.root)
    return result, before, after


# ---- 7a: bad config (first: seconds, and it needs nothing) ---------------------------


def test_bad_config_value_fails_fast_naming_the_field(cli_env, alignflow_cli, tmp_path):
    res = alignflow_cli(["run", "sft.learning_rate=-1"], env=cli_env(), cwd=tmp_path, timeout=120)
    assert res.returncode == 2, res.describe()
    assert "sft.learning_rate" in res.stderr, res.describe()
    assert "Prefect API" not in res.output, "a Prefect API was started for an invalid config"
    assert res.seconds < 30, f"validation took {res.seconds:.1f} s"
    assert not (tmp_path / "artifacts").exists()


@pytest.mark.parametrize("broken", ["prefect", "ray"])
def test_a_service_that_does_not_start_is_one_error_line(broken, small_pipeline_args, cli_env, alignflow_cli,
                                                         tmp_path):
    """The Prefect server the CLI starts exits at once (its database cannot be opened), or the local Ray
    cannot (its socket paths, under a long TMPDIR, pass the 107 bytes AF_UNIX allows): one `error:` line
    naming what failed and its log, exit status 1, no traceback, and no scratch directory left."""
    if broken == "prefect":
        tmp = Path(tempfile.mkdtemp(prefix="af-", dir="/tmp"))
        env = cli_env(PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{tmp_path}/no/such/dir/prefect.db",
                      TMPDIR=str(tmp))
    else:
        tmp = tmp_path / ("t" * 60)
        tmp.mkdir()
        env = cli_env(TMPDIR=str(tmp))
    try:
        res = alignflow_cli(["run", *small_pipeline_args(tmp_path)], env=env, cwd=tmp_path / "cwd", timeout=300,
                            verbose=False)
        left = sorted(p.name for p in tmp.glob("alignflow-*"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert res.returncode == 1, res.describe()
    last = res.stderr.strip().splitlines()[-1]
    if broken == "prefect":
        log = tmp_path / "artifacts" / "logs" / "prefect-server.log"
        assert last.startswith("error: the Prefect server did not start (exited with status ") and \
            last.endswith(f"its log: {log}"), res.describe()
        assert log.is_file()
        # Ray started (quiet console): its token notice went to the log file, not the console.
        assert "Token authentication" not in res.stderr, res.describe()
        assert "Token authentication is enabled" in Path(res.stderr.split("log: ")[1].split()[0]).read_text()
    else:
        assert last.startswith("error: a local Ray did not start: OSError: ") and "(Ray's logs: " in last, \
            res.describe()
    assert "Traceback" not in res.stderr, res.describe()
    assert left == [], left


# ---- 1, 2: the pipeline on S3, then from cache -------------------------------------


def test_pipeline_completes_on_s3(s3_run, moto_s3):
    s3_run.require_ok()
    out = s3_run.result.stdout
    table = parse_table(out)
    assert {"base", "sft"} <= set(table), out
    for name in ("base", "sft"):
        assert 0.0 <= table[name]["accuracy"] <= 1.0
        assert table[name]["response_length"] > 0
    assert re.search(r"reward model held-out pairwise accuracy: \d\.\d{3}", out)

    stages = s3_run.stages
    assert BASE_STAGES <= set(stages), stages
    fs = moto_s3.fs()
    for name, (state, uri) in stages.items():
        assert state == "Completed", f"{name} was {state} in a fresh run"
        assert uri.startswith(f"{s3_run.root}/{name}/"), uri
        manifest = json.loads(fs.cat_file(f"{uri}/manifest.json"))
        assert manifest["meta"]["stage"] == name and uri.endswith(manifest["meta"]["key"])
        assert manifest["files"], f"{name}: empty manifest"
        for rel, info in manifest["files"].items():
            assert fs.info(f"{uri}/{rel}")["size"] == info["size"], f"{name}/{rel}"
    for name, (_, uri) in stages.items():  # mid-stage checkpoints are pruned once committed
        assert not fs.exists(f"{uri}/checkpoints"), name
    assert fs.find(f"{s3_run.root}/prefect-results"), "no Prefect result records on S3"
    assert not (s3_run.base / "cwd" / "artifacts").exists(), "artifacts were written locally"


def test_second_identical_run_is_all_cached(s3_run, s3_cached_run, moto_s3):
    result, before, after = s3_cached_run
    assert result.returncode == 0, result.describe()
    stages = parse_stages(result.stdout)
    assert set(stages) == set(s3_run.stages)
    not_cached = {name: (state, uri) for name, (state, uri) in stages.items() if state != "Cached"}
    assert not not_cached, f"not from cache: {not_cached}\nfirst run: {s3_run.stages}"
    assert {n: uri for n, (_, uri) in stages.items()} == {n: uri for n, (_, uri) in s3_run.stages.items()}
    assert parse_table(result.stdout) == parse_table(s3_run.result.stdout)
    # Nothing recomputed: no stage object written or rewritten, no stage child run opened.
    assert after == before, f"changed: {sorted(set(after.items()) ^ set(before.items()))[:10]}"
    parent = parent_run_id(result.stdout)
    assert child_runs(mlflow_client(s3_run.mlflow_uri), parent) == []
    # Nothing to compute: no Prefect flow run, no Ray; the curves of the cached stages still drawn.
    assert "every stage is committed" in result.stderr and "Prefect API" not in result.output
    curves = moto_s3.fs().find(f"{s3_run.root}/curves/{parent}")
    assert sorted(p.rsplit("/", 1)[1] for p in curves) == ["eval.png", "loss.png", "rounds.png"]
    print(f"fresh run {s3_run.result.seconds:.0f} s, cached run {result.seconds:.0f} s")


def test_same_config_and_seed_give_the_same_results(s3_run, small_pipeline_args, cli_env, alignflow_cli, tmp_path):
    """A fresh run of the same config (another storage root, which no key covers) on the same
    pipeline seed: the same keys, and the same evaluation table to the last printed digit.

    This run is the quiet console a user sees without `-v`: its plan, a line per stage as it
    ends (with its key metric), the table, where things are; no third-party INFO lines."""
    s3_run.require_ok()
    res = alignflow_cli(["run", *small_pipeline_args(tmp_path)], env=cli_env(), cwd=tmp_path / "cwd", verbose=False)
    assert res.returncode == 0, res.describe()
    keys = dict(re.findall(r"^  (\w+) .* ([0-9a-f]{20})  will run", res.stdout, re.M))
    assert keys == {n: uri.rsplit("/", 1)[1] for n, (_, uri) in s3_run.stages.items()}
    assert f"stages:     {len(keys)} Completed;" in res.stdout

    def results(stdout: str) -> list[str]:
        lines = stdout.splitlines()
        start = next(i for i, line in enumerate(lines) if line.split()[:1] == ["policy"])
        return lines[start:next(i for i, line in enumerate(lines) if line.startswith("stages:"))]

    assert results(res.stdout) == results(s3_run.result.stdout)
    output = res.stdout + res.stderr
    assert re.search(r"^  sft +done +[\d.]+ s  8/8 steps  loss \d", output, re.M), output
    assert re.search(r"^  round_1 +done +[\d.]+ s  2/2 steps  reward -?\d", output, re.M), output
    assert re.search(r"^  data +done .* prompt tokens <= \d+  response tokens <= \d+", output, re.M), output
    assert "httpx" not in output and "mlflow.store" not in output and "Traceback" not in output
    assert not re.search(console.CPU_ADVICE, output), output  # CPU-build advice Ray forwards from workers
    assert len(output.splitlines()) <= 60, output


# ---- 4: checkpoints from S3 load with transformers -------------------------------


def _fetch(fs, uri: str, dest: Path) -> Path:
    dest.mkdir(parents=True)
    fs.get(f"{uri}/", f"{dest}/", recursive=True)
    manifest = json.loads((dest / "manifest.json").read_text())
    for rel, info in manifest["files"].items():
        assert sha256(dest / rel) == info["sha256"], f"{uri}/{rel} does not match its manifest"
    return dest


def test_s3_checkpoints_load_with_transformers(s3_run, moto_s3, tmp_path):
    s3_run.require_ok()
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    fs = moto_s3.fs()
    stages = s3_run.stages
    policies = ["sft", *[name for name in stages if name.startswith("round_")][-1:]]  # and the last RL round
    for name in policies:
        policy_dir = _fetch(fs, stages[name][1], tmp_path / name)
        tok = AutoTokenizer.from_pretrained(policy_dir)
        model, info = AutoModelForCausalLM.from_pretrained(policy_dir, output_loading_info=True)
        assert not info["missing_keys"], (name, info)
        ids = tok("Which digit is largest? 3 1 4 1 5", return_tensors="pt")
        with torch.no_grad():
            logits = model(**ids).logits
        assert logits.shape[:2] == ids["input_ids"].shape and logits.shape[-1] >= len(tok), name
        assert torch.isfinite(logits).all(), name
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        generated = model.generate(**ids, max_new_tokens=4, do_sample=False, pad_token_id=pad)
        assert generated.shape[1] > ids["input_ids"].shape[1], name

    rm_dir = _fetch(fs, stages["reward_model"][1], tmp_path / "reward_model")
    rm, info = AutoModelForSequenceClassification.from_pretrained(rm_dir, num_labels=1, output_loading_info=True)
    assert not info["missing_keys"], f"reward head not in the checkpoint: {info}"
    rm_tok = AutoTokenizer.from_pretrained(rm_dir)
    if rm.config.pad_token_id is None:
        rm.config.pad_token_id = rm_tok.pad_token_id if rm_tok.pad_token_id is not None else rm_tok.eos_token_id
    with torch.no_grad():
        scores = rm(**rm_tok("3 1 4 1 5 -> 5", return_tensors="pt")).logits
    assert scores.shape == (1, 1) and torch.isfinite(scores).all()


# ---- 5: MLflow parent and child runs ---------------------------------------------


def test_mlflow_parent_and_child_runs(s3_run, moto_s3):
    s3_run.require_ok()
    client = mlflow_client(s3_run.mlflow_uri)
    pid = parent_run_id(s3_run.result.stdout)
    parent = client.get_run(pid)
    assert "mlflow.parentRunId" not in parent.data.tags
    assert parent.info.status == "FINISHED"
    params = parent.data.params
    from alignflow.config import load_config

    assert float(params["sft.learning_rate"]) == load_config().sft.learning_rate  # from the embedded config
    assert params["sft.max_steps"] == "8"
    assert params["infra.storage.root"] == s3_run.root
    table = parse_table(s3_run.result.stdout)
    assert parent.data.metrics["sft/accuracy"] == pytest.approx(table["sft"]["accuracy"], abs=5e-4)
    # The experiment opens on its runs, its artifacts (curves, report.txt) sit beside the SQLite file, and
    # the run wrote nothing into its working directory (this harness's own cli-* output files aside).
    exp = client.get_experiment(parent.info.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert list((s3_run.base / "mlflow-artifacts").rglob("report.txt")), exp.artifact_location
    assert sorted(p.name for p in (s3_run.base / "cwd").iterdir() if not p.name.startswith("cli-")) == []

    children = {r.data.tags["alignflow.stage"]: r for r in child_runs(client, pid)}
    assert BASE_STAGES <= set(children), sorted(children)
    assert set(children) == set(s3_run.stages), "one child run per stage"
    for name, run in children.items():
        assert run.info.status == "FINISHED", name
        assert run.data.tags.get("alignflow.uri") == s3_run.stages[name][1], name
    for name in ("sft", "reward_model"):
        history = client.get_metric_history(children[name].info.run_id, "train/loss")
        steps = sorted({m.step for m in history})
        assert len(steps) >= 2, f"{name} train/loss logged at steps {steps}"
    for name in ("eval_base", "eval_sft"):
        assert 0.0 <= children[name].data.metrics["eval/accuracy"] <= 1.0
    assert 0.0 <= children["eval_reward_model"].data.metrics["eval/rm_pairwise_accuracy"] <= 1.0
    for name, run in children.items():
        if name.startswith("round_"):
            assert any(k.startswith("rl/") for k in run.data.metrics), f"{name}: {sorted(run.data.metrics)}"
        if name.startswith("eval_") and name != "eval_reward_model":
            assert f"{name.removeprefix('eval_')}/accuracy" in parent.data.metrics, name
            # On CPUs every evaluation's engine is built in the run's one engine host (tasks/eval_engine.py).
            assert run.data.tags.get("alignflow.engine_process") == "run host", name

    every = client.search_runs([experiment_id(client)], max_results=1000)
    for run in every:
        for k, v in {**run.data.params, **run.data.tags}.items():
            assert moto_s3.secret_access_key not in v and moto_s3.access_key_id not in v, \
                f"credential in run {run.info.run_name}: {k}"


# ---- rounds of any kind, in any order, and only the stages they need ------------------


def test_rule_reward_rounds_of_mixed_kinds_need_no_reward_model(small_pipeline_args, cli_env, alignflow_cli,
                                                               tmp_path):
    small = {"steps": 2, "prompts_per_step": 8, "generation": {"num_samples": 2, "max_new_tokens": 8},
             "ppo": {"epochs": 1, "minibatch_size": 16}, "reward": {"source": "rule"}}
    # (Rejection sampling's round is in tests/engines/rl; here what matters is a critic-free round, then
    # one whose critic starts from the policy since there is no reward model to start it from.)
    rounds = [{**small, "algorithm": "grpo"}, {**small, "algorithm": "ppo", "critic": {"init": "policy"}}]
    args = ["run", *small_pipeline_args(tmp_path, rounds=0), f"rounds={json.dumps(rounds)}"]
    res = alignflow_cli(args, env=cli_env(), cwd=tmp_path / "cwd")
    assert res.returncode == 0, res.describe()
    assert "skipped: reward_model (no round scores with it or starts a critic from it)" in res.stdout
    stages = parse_stages(res.stdout)
    assert set(stages) == {"data", "base_model", "sft", "round_1", "round_2", "eval_base", "eval_sft", "eval_round_1",
                           "eval_round_2"}
    assert all(state == "Completed" for state, _ in stages.values()), stages
    assert not (tmp_path / "artifacts" / "reward_model").exists()
    table = parse_table(res.stdout)
    assert set(table) == {"base", "sft", "round_1", "round_2"}
    assert all(row["reward"] is None and 0.0 <= row["accuracy"] <= 1.0 for row in table.values()), table
    assert "reward model held-out" not in res.stdout
    print(f"grpo -> ppo without a reward model: {res.seconds:.0f} s")


def test_the_gpu_config_runs_end_to_end_on_the_cpu(gpu_config_on_cpu, cli_env, alignflow_cli, tmp_path):
    """configs/gpu-small.yaml at a small shape and without GPUs: tied embeddings, bf16, gradient
    checkpointing, PPO rounds with every model colocated (the engines, as they count it, put to sleep
    once a step while the models train), and evaluations whose engine is built and closed inside one
    call (in the run's engine host), before their scorer starts. Its SFT checkpoint stays tied."""
    from safetensors import safe_open

    # One step a round: the second round still starts from the first's checkpoint, and each step sleeps once.
    small = ["data.synthetic.num_sft=128", "data.synthetic.num_preference=128", "data.synthetic.num_rl_prompts=64",
             "data.synthetic.num_eval=8", "rounds.0.steps=1", "rounds.1.steps=1", "rounds.0.prompts_per_step=16",
             "rounds.1.prompts_per_step=16", f"infra.mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    res = alignflow_cli(["run", str(gpu_config_on_cpu(tmp_path)), *small], env=cli_env(), cwd=tmp_path / "cwd")
    assert res.returncode == 0, res.describe()
    stages = parse_stages(res.stdout)
    assert set(stages) == {*BASE_STAGES, "round_1", "round_2", "eval_round_1", "eval_round_2"}
    assert all(state == "Completed" for state, _ in stages.values()), stages
    assert set(parse_table(res.stdout)) == {"base", "sft", "round_1", "round_2"}
    client = mlflow_client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = {r.data.tags.get("alignflow.stage"): r for r in client.search_runs([experiment_id(client)])}
    assert [runs[f"round_{i}"].data.metrics["rl/engine_sleeps"] for i in (1, 2)] == [1.0, 1.0]
    evals = [n for n in runs if n and n.startswith("eval_") and n != "eval_reward_model"]
    assert len(evals) == 4 and {runs[n].data.tags["alignflow.engine_process"] for n in evals} == {"run host"}
    (sft,) = (tmp_path / "cwd" / "artifacts" / "sft").iterdir()
    with safe_open(str(sft / "model.safetensors"), framework="pt") as st:
        assert "model.embed_tokens.weight" in st.keys() and "lm_head.weight" not in st.keys()
    print(f"gpu-small at a small shape on the CPU: {res.seconds:.0f} s")


# ---- 3: a failed stage, fixed and rerun -------------------------------------------

BROKEN_CHECKER = '''
def check(response, answer):
    raise RuntimeError("E2E_CHECKER_BROKEN: this checker fails on purpose")
'''

FIXED_CHECKER = '''
from alignflow.data.synthetic import check_answer


def check(response, answer):
    """Fixed: the bundled checker."""
    return check_answer(response, answer)
'''


def test_failed_stage_fixed_and_rerun_runs_alone(small_pipeline_args, cli_env, alignflow_cli, tmp_path):
    src = tmp_path / "checker_src"
    src.mkdir()
    module = src / "e2e_flaky_checker.py"
    module.write_text(textwrap.dedent(BROKEN_CHECKER))
    pythonpath = os.pathsep.join(p for p in (str(src), os.environ.get("PYTHONPATH")) if p)
    env = cli_env(PYTHONPATH=pythonpath, PYTHONDONTWRITEBYTECODE="1")
    # No RL rounds here (the S3 run covers them): retry semantics only, in less time.
    args = ["run", *small_pipeline_args(tmp_path, rounds=0), "evaluation.checker=e2e_flaky_checker:check",
            "infra.task_retries=0"]
    root = tmp_path / "artifacts"

    failed = alignflow_cli(args, env=env, cwd=tmp_path / "cwd")
    assert failed.returncode != 0, failed.describe()
    assert "E2E_CHECKER_BROKEN" in failed.output, failed.describe()
    committed = {}
    for name in UPSTREAM:
        dirs = [p.parent for p in root.glob(f"{name}/*/manifest.json")]
        assert len(dirs) == 1, f"{name}: committed {dirs}\n{failed.describe()}"
        committed[name] = str(dirs[0])
    for name in ("eval_base", "eval_sft"):
        assert not list(root.glob(f"{name}/*/manifest.json")), f"{name} committed though its checker failed"
    client = mlflow_client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    statuses = {r.data.tags.get("alignflow.stage"): r.info.status
                for r in client.search_runs([experiment_id(client)], max_results=1000)}
    assert statuses.get("eval_base") == "FAILED" or statuses.get("eval_sft") == "FAILED", statuses

    module.write_text(textwrap.dedent(FIXED_CHECKER))  # same import path, same config: same keys
    fixed = alignflow_cli(args, env=env, cwd=tmp_path / "cwd")
    assert fixed.returncode == 0, fixed.describe()
    stages = parse_stages(fixed.stdout)
    for name in UPSTREAM:
        assert stages[name] == ("Cached", committed[name]), f"{name}: {stages[name]}"
    for name in ("eval_base", "eval_sft"):
        assert stages[name][0] == "Completed", f"{name}: {stages[name]}"
    for name, (state, _) in stages.items():
        if not name.startswith("eval_"):  # everything upstream of evaluation finished in the failed run
            assert state == "Cached", f"{name}: {state}"
        elif name != "eval_reward_model":  # every policy evaluation (it calls the checker) ran again
            assert state == "Completed", f"{name}: {state}"
        else:  # independent of the checker: it may have finished in the failed run
            assert state in ("Cached", "Completed"), f"{name}: {state}"
    print(f"failed run {failed.seconds:.0f} s, fixed rerun {fixed.seconds:.0f} s")


# ---- 6: a killed stage resumes from its mid-stage checkpoint ----------------------


@dataclasses.dataclass(frozen=True)
class Resumed:
    stage_dir: Path
    checkpoint_step: int  # the last committed checkpoint when the run was killed
    rerun: object  # CliResult
    run: object  # the one FINISHED MLflow run of the stage


# SFT stopped once a checkpoint exists (step 20, or 40 where the signal came after the next one) and resumed:
# the rerun trains the rest, so every step past the stop is paid twice. A tiny SFT step takes about 0.05 s
# here and the kill is polled every 0.2 s, so 100 steps leave it a wide margin.
SFT_TOTAL = 100


def kill_and_resume(stage: str, args: list[str], tmp_path: Path, *, alignflow_cli, cli_env, process_tools) -> Resumed:
    """Kill `alignflow ARGS` at the stage's first committed checkpoint, check
    that nothing looks committed, rerun it, and check the stage committed with
    its checkpoints pruned. Returns what the caller checks the resume against."""
    root, cwd, env = tmp_path / "artifacts", tmp_path / "cwd", cli_env()
    pattern = f"{stage}/*/checkpoints/step-*/manifest.json"
    process_tools.kill_at_checkpoint(args, env=env, cwd=cwd, checkpoint_glob=root / pattern)

    stage_dirs = {p.parent.parent.parent for p in root.glob(pattern)}
    assert len(stage_dirs) == 1
    stage_dir = stage_dirs.pop()
    assert not (stage_dir / "manifest.json").exists(), f"the killed {stage} looks committed"
    step = max(int(p.parent.name.removeprefix("step-")) for p in stage_dir.glob("checkpoints/step-*/manifest.json"))

    rerun = alignflow_cli(args, env=env, cwd=cwd)
    assert rerun.returncode == 0, rerun.describe()
    assert stage_json(rerun.stdout)["uri"] == str(stage_dir)
    assert (stage_dir / "manifest.json").exists()
    assert not list(stage_dir.glob("checkpoints/step-*")), f"checkpoints left after {stage} committed"

    client = mlflow_client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([experiment_id(client)], filter_string=f"tags.`alignflow.stage` = '{stage}'")
    finished = [r for r in runs if r.info.status == "FINISHED" and r.data.tags.get("alignflow.uri") == str(stage_dir)]
    assert len(finished) == 1, [(r.info.run_id, r.info.status, r.data.tags.get("alignflow.uri")) for r in runs]
    run = finished[0]
    assert int(run.data.tags["alignflow.resumed_from_step"]) == step
    return Resumed(stage_dir=stage_dir, checkpoint_step=step, rerun=rerun, run=run)


def test_ctrl_c_mid_sft_ends_the_runs_killed_and_the_rerun_resumes(small_pipeline_args, cli_env, alignflow_cli,
                                                                    process_tools, tmp_path):
    """SIGINT to `alignflow run` mid-SFT, sent to its process group as Ctrl-C sends it: the CLI stops with a
    nonzero status and nothing it started outlives it, the MLflow parent run ends KILLED and no stage run is
    left RUNNING. Then `alignflow stage sft` resumes it from that checkpoint and trains exactly the rest.
    (A stage killed outright, SIGKILL with no clean-up, and resumed: the round's and DPO's tests below.)"""
    import signal

    total = SFT_TOTAL
    args = [*small_pipeline_args(tmp_path, rounds=0), "sft.epochs=25", f"sft.max_steps={total}",
            "sft.checkpoint_every=20", "sft.log_every=50"]
    root, cwd, env = tmp_path / "artifacts", tmp_path / "cwd", cli_env()
    pattern = "sft/*/checkpoints/step-*/manifest.json"
    tmp = Path(tempfile.mkdtemp(prefix="af-", dir="/tmp"))  # short: Ray's socket paths live under it too
    try:
        status = process_tools.kill_at_checkpoint(["run", *args], env={**env, "TMPDIR": str(tmp)}, cwd=cwd,
                                                  checkpoint_glob=root / pattern, signum=signal.SIGINT)
        left = sorted(p.name for p in tmp.glob("alignflow-*"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    err = (cwd / "killed.err").read_text()
    step = max(int(p.parent.name.removeprefix("step-")) for p in root.glob(pattern))
    # One line says what stopped and how to go on; no traceback; the scratch directory is gone.
    assert status == 130, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(rf"interrupted: sft stopped at step \d+ of {total}; alignflow run resumes it", last), err[-3000:]
    assert [line for line in err.strip().splitlines() if not line.startswith("log: ")] == [last], err[-6000:]
    assert left == [], left

    client = mlflow_client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([experiment_id(client)])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert [r.info.status for r in parents] == ["KILLED"], [(r.info.run_name, r.info.status) for r in runs]
    assert not [r for r in runs if r.info.status == "RUNNING"], [(r.info.run_name, r.info.status) for r in runs]
    [sft] = [r for r in runs if r.data.tags.get("alignflow.stage") == "sft"]
    assert sft.info.status == "KILLED"
    [stage_dir] = {p.parent.parent.parent for p in root.glob(pattern)}
    assert not (stage_dir / "manifest.json").exists(), "the interrupted sft looks committed"

    rerun = alignflow_cli(["stage", "sft", *args], env=env, cwd=cwd)
    assert rerun.returncode == 0, rerun.describe()
    result = stage_json(rerun.stdout)
    assert result["uri"] == str(stage_dir) and (stage_dir / "manifest.json").exists()
    assert not list(stage_dir.glob("checkpoints/step-*")), "checkpoints left after sft committed"
    metrics = result["metrics"]
    assert metrics["train/resumed_from_step"] == step and metrics["train/steps_run"] == total - step
    assert metrics["train/steps"] == total
    runs = client.search_runs([experiment_id(client)], filter_string="tags.`alignflow.stage` = 'sft'")
    [finished] = [r for r in runs if r.info.status == "FINISHED"]
    assert int(finished.data.tags["alignflow.resumed_from_step"]) == step
    print(f"Ctrl-C after checkpoint step {step}; the rerun resumed in {rerun.seconds:.0f} s")


def test_killed_round_resumes_and_finishes_its_steps(small_pipeline_args, cli_env, alignflow_cli, process_tools,
                                                    tmp_path):
    total = 12  # killed at step 4 or 8: a tiny round's step takes about 1.5 s here, so 4+ steps of margin
    # GRPO on the rule: no reward model to train first, no critic or reward actor to start, twice.
    round_cfg = {"algorithm": "grpo", "steps": total, "checkpoint_every": 4, "prompts_per_step": 8,
                 "generation": {"num_samples": 2, "max_new_tokens": 8}, "ppo": {"epochs": 1, "minibatch_size": 16},
                 "reward": {"source": "rule"}}
    args = ["stage", "rl", *small_pipeline_args(tmp_path, rounds=0), f"rounds={json.dumps([round_cfg])}"]
    r = kill_and_resume("round_1", args, tmp_path, alignflow_cli=alignflow_cli, cli_env=cli_env,
                        process_tools=process_tools)
    resumed = r.checkpoint_step
    assert 4 <= resumed < total
    assert r.run.data.metrics["rl/steps"] == total
    assert r.run.data.metrics["rl/steps_run"] == total - resumed
    # The resumed run logged exactly the remaining steps: resumed+1 .. total.
    client = mlflow_client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    history = client.get_metric_history(r.run.info.run_id, "rl/reward/mean")
    assert sorted(m.step for m in history) == list(range(resumed + 1, total + 1))
    print(f"round killed after checkpoint step {resumed}; rerun {r.rerun.seconds:.0f} s")


# ---- 7b: bad user data --------------------------------------------------------------


def test_bad_data_row_fails_naming_file_row_and_key(small_pipeline_args, cli_env, alignflow_cli, moto_s3, tmp_path):
    # Row 8 of a remote file, past the rows preflight reads of it (data.preflight_rows=5): the data stage
    # itself finds it (preflight reads every row of a local file).
    rows = [{"prompt": f"Which digit is largest? {i} 2 3", "response": "3"} for i in range(10)]
    del rows[7]["response"]
    bad = f"s3://{moto_s3.bucket}/bad-data/bad.jsonl"
    with moto_s3.fs().open(bad, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text("".join(json.dumps({"prompt": f"p{i}", "chosen": "a", "rejected": "b"}) + "\n" for i in range(20)))
    evals = tmp_path / "eval.jsonl"
    evals.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": "1"}) + "\n" for i in range(4)))
    args = ["run", *small_pipeline_args(tmp_path), "data.source=files", f"data.sft.path={bad}",
            f"data.preference.path={prefs}", f"data.eval.path={evals}", "data.preflight_rows=5"]

    res = alignflow_cli(args, env=cli_env(AWS_ENDPOINT_URL=moto_s3.endpoint_url), cwd=tmp_path / "cwd")
    assert res.returncode == 2, res.describe()
    assert f"preflight: data.sft: {bad} is remote, so its first 5 rows were checked" in res.stderr, res.describe()
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and f"{bad}, row 8: missing key 'response'" in last, res.describe()
    # A user error is not retried (the default infra.task_retries=2 would retry anything else).
    assert "Retry" not in res.output and "AwaitingRetry" not in res.output, res.describe()
    assert not (tmp_path / "artifacts" / "sft").exists(), "training started on bad data"
    print(f"bad data failed after {res.seconds:.0f} s")


# ---- 8: the preference stage (DPO and kin) ------------------------------------------


def test_kto_then_packed_dpo_killed_and_resumed_reuse_the_cached_reference_and_log_per_step_rewards(
        small_pipeline_args, cli_env, alignflow_cli, process_tools, tmp_path):
    small = {"max_steps": 4, "batch_size": 16, "log_every": 1}
    base = ["stage", "preference", *small_pipeline_args(tmp_path, rounds=0), "sft.packing=true"]
    root, client = tmp_path / "artifacts", mlflow_client(f"sqlite:///{tmp_path / 'mlflow.db'}")

    def committed(stage: str) -> list[Path]:
        return sorted(p.parent for p in root.glob(f"{stage}/*/manifest.json"))

    def runs(stage: str) -> list:
        return client.search_runs([experiment_id(client)], filter_string=f"tags.`alignflow.stage` = '{stage}'")

    kto = alignflow_cli([*base, f"preference={json.dumps({**small, 'loss': 'kto'})}"], env=cli_env(),
                        cwd=tmp_path / "cwd")
    assert kto.returncode == 0, kto.describe()
    [ref_dir] = committed("preference_reference")
    assert (ref_dir / "reference_logps.safetensors").exists()
    [kto_dir] = committed("preference")
    assert (kto_dir / "model.safetensors").exists() and stage_json(kto.stdout)["uri"] == str(kto_dir)
    [run] = runs("preference")
    for name in ("accuracy", "reward_margin", "chosen_reward", "rejected_reward", "kl_reference_point"):
        history = client.get_metric_history(run.info.run_id, f"train/{name}")
        assert sorted(m.step for m in history) == [1, 2, 3, 4], name

    # Another loss and beta: the same data and reference, so the reference's log-probabilities come from cache.
    # Packed rows this time (per-sample positions, block mask): the same stage code, through DeepSpeed on Ray.
    # Rows of 64 tokens hold several of these short pairs' rows (of the batch's padded width, each holds one).
    # Killed outright (SIGKILL) at its first checkpoint (step 10, or 20 where the kill came after the next;
    # a step takes about 0.1 s here, the kill is polled every 0.2 s), then rerun: it trains the rest.
    total = 40
    dpo_cfg = {"loss": "dpo", "beta": 0.3, "packing": True, "packing_max_tokens": 64, "epochs": 25,
               "max_steps": total, "batch_size": 16, "checkpoint_every": 10, "log_every": 1}
    r = kill_and_resume("preference", [*base, f"preference={json.dumps(dpo_cfg)}"], tmp_path,
                        alignflow_cli=alignflow_cli, cli_env=cli_env, process_tools=process_tools)
    assert 10 <= r.checkpoint_step < total
    assert committed("preference_reference") == [ref_dir] and len(runs("preference_reference")) == 1
    assert len(committed("preference")) == 2 and len(runs("preference")) == 3
    metrics = stage_json(r.rerun.stdout)["metrics"]
    assert metrics["train/steps"] == total and 0.0 <= metrics["train/final_accuracy"] <= 1.0
    assert metrics["train/resumed_from_step"] == r.checkpoint_step
    assert metrics["train/steps_run"] == total - r.checkpoint_step
    kto_run, killed_run, dpo_run = sorted(runs("preference"), key=lambda r: r.info.start_time)
    assert dpo_run.info.run_id == r.run.info.run_id

    def history(run, name: str) -> list[tuple[int, float]]:
        return [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, f"train/{name}"),
                                                  key=lambda m: m.step)]

    # The resumed run logged exactly the steps after its checkpoint. Packed: every step's samples shared rows
    # (fewer rows than samples); the KTO run, unpacked, reports none.
    packing = history(dpo_run, "packing/rows_per_sample")
    assert [step for step, _ in packing] == list(range(r.checkpoint_step + 1, total + 1)), packing
    assert all(0 < v < 1 for _, v in packing), packing
    assert all(0 < v <= 1 for _, v in history(dpo_run, "packing/fill"))
    assert history(kto_run, "packing/rows_per_sample") == []
    # DPO through the packed rows: the first step's policy is the reference (the SFT model), so its loss (in the
    # killed run) is -log sigmoid(0) = log 2 and its margin 0; by the resumed run's last step the loss has fallen.
    (first, loss), (_, margin) = history(killed_run, "loss")[0], history(killed_run, "reward_margin")[0]
    assert first == 1 and loss == pytest.approx(math.log(2), abs=1e-3) and margin == pytest.approx(0.0, abs=1e-3)
    assert history(dpo_run, "loss")[-1][1] < loss, history(dpo_run, "loss")
