"""End to end: the `alignflow` CLI in a subprocess, on real components.

Real Prefect API (one the module's runs share, or the CLI's own where that is
what a test is about), real local Ray, DeepSpeed on CPU,
vLLM on CPU, MLflow in SQLite, and S3 through `moto_server` over HTTP. One
S3-backed pipeline run (plus its cached rerun) is shared by the S3, MLflow
and checkpoint tests; the others use local storage roots of their own (the
failure/retry and kill/resume tests are in test_e2e_resume.py).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import tempfile
from pathlib import Path

import pytest
from e2e_cli import (BASE_STAGES, UPSTREAM, child_runs, experiment_id, mlflow_client, parent_run_id, parse_stages, parse_table,
                     sha256, stage_json, stage_runs)

from flows import console

pytestmark = pytest.mark.e2e

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
def s3_run(moto_s3, small_pipeline_args, cli_env, shared_prefect_api, alignflow_cli, tmp_path_factory) -> PipelineRun:
    """One fresh pipeline run with every artifact on S3 (moto over HTTP), on the module's Prefect server."""
    base = tmp_path_factory.mktemp("s3_run")
    root = f"s3://{moto_s3.bucket}/run"
    args = ["run", *small_pipeline_args(base, storage_root=root, endpoint_url=moto_s3.endpoint_url)]
    result = alignflow_cli(args, env=cli_env(PREFECT_API_URL=shared_prefect_api()), cwd=base / "cwd")
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


@pytest.mark.parametrize("broken", ["prefect", "ray", "mlflow"])
def test_a_service_that_does_not_start_is_one_error_line(broken, small_pipeline_args, cli_env, alignflow_cli,
                                                         tmp_path):
    """The Prefect server the CLI starts exits at once (its database cannot be opened), the local Ray
    cannot (its socket paths, under a long TMPDIR, pass the 107 bytes AF_UNIX allows), or the MLflow SQLite
    file is not a database (preflight sees a writable file): one `error:` line naming what failed (and its
    log), exit status 1, no traceback, and no scratch directory left."""
    args = small_pipeline_args(tmp_path)
    if broken == "mlflow":
        tmp = Path(tempfile.mkdtemp(prefix="af-", dir="/tmp"))
        (tmp_path / "mlflow.db").write_bytes(b"not a database, " * 64)
        env = cli_env(TMPDIR=str(tmp))
    elif broken == "prefect":
        tmp = Path(tempfile.mkdtemp(prefix="af-", dir="/tmp"))
        env = cli_env(PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{tmp_path}/no/such/dir/prefect.db",
                      TMPDIR=str(tmp))
    else:
        tmp = tmp_path / ("t" * 60)
        tmp.mkdir()
        env = cli_env(TMPDIR=str(tmp))
    try:
        res = alignflow_cli(["run", *args], env=env, cwd=tmp_path / "cwd", timeout=300, verbose=False)
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
        # Ray starts beside the server (quiet console): its token notice, where Ray got as far before the
        # server's exit ended the run (on a loaded machine it may not), goes to the log file, not the console.
        assert "Token authentication" not in res.stderr, res.describe()
    elif broken == "ray":
        assert last.startswith("error: a local Ray did not start: OSError: ") and "(Ray's logs: " in last, \
            res.describe()
    else:
        assert last.startswith(f"error: the MLflow store sqlite:///{tmp_path / 'mlflow.db'} did not open: "), \
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
    # The CLI had a stage worker import the stages' modules while the flow started (flows/stage_tasks.py):
    # the first stages ran in it, not in a fresh worker that imports them all again.
    output = s3_run.result.output
    warmed = re.search(r"stage worker pid (\d+) has the stages' modules loaded", output)
    assert warmed, output
    assert re.search(rf"\((base_model|data) pid={warmed[1]}\)", output), output


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


def test_same_config_and_seed_give_the_same_results(s3_run, small_pipeline_args, cli_env, shared_prefect_api,
                                                    alignflow_cli, tmp_path):
    """A fresh run of the same config (another storage root, which no key covers) on the same
    pipeline seed: the same keys, and the same evaluation table to the last printed digit.

    This run is the quiet console a user sees without `-v`: its plan, a line per stage as it
    ends (with its key metric), the table, where things are; no third-party INFO lines."""
    s3_run.require_ok()
    res = alignflow_cli(["run", *small_pipeline_args(tmp_path)], env=cli_env(PREFECT_API_URL=shared_prefect_api()),
                        cwd=tmp_path / "cwd", verbose=False)
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
    # On the CPU the evaluations share the run's engine host, and take turns (flows/stage_tasks.py): no two at once.
    spans = sorted((r.info.start_time, r.info.end_time, n) for n, r in children.items() if n.startswith("eval_"))
    assert len(spans) >= 4, spans
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        assert end <= start, f"{first} and {second} ran at once: {spans}"
    assert 0.0 <= children["eval_reward_model"].data.metrics["eval/rm_pairwise_accuracy"] <= 1.0
    for name, run in children.items():
        if name.startswith("round_"):
            assert any(k.startswith("rl/") for k in run.data.metrics), f"{name}: {sorted(run.data.metrics)}"
        if name.startswith("eval_") and name != "eval_reward_model":
            assert f"{name.removeprefix('eval_')}/accuracy" in parent.data.metrics, name
            # On CPUs every evaluation's engine is built in the run's one engine host (tasks/stages/eval_engine.py).
            assert run.data.tags.get("alignflow.engine_process") == "run host", name

    every = client.search_runs([experiment_id(client)], max_results=1000)
    for run in every:
        for k, v in {**run.data.params, **run.data.tags}.items():
            assert moto_s3.secret_access_key not in v and moto_s3.access_key_id not in v, \
                f"credential in run {run.info.run_name}: {k}"


# ---- rounds of any kind, in any order, and only the stages they need ------------------


def test_rule_reward_rounds_of_mixed_kinds_need_no_reward_model(small_pipeline_args, cli_env, shared_prefect_api,
                                                               alignflow_cli, tmp_path):
    """The rounds alone (`alignflow stage rl`: their evaluations are the S3 run's business): GRPO on a mix
    of two rules, PPO whose critic starts from the policy, then on-policy distillation of round 1 into SFT;
    then, from the same config, offline distillation of round 1 (`alignflow stage distill`), the rounds
    taken from cache."""
    small = {"steps": 2, "prompts_per_step": 8, "generation": {"num_samples": 2, "max_new_tokens": 8},
             "ppo": {"epochs": 1, "minibatch_size": 16}, "reward": {"source": "rule"}}
    mix = {"sources": [{"source": "rule"}, {"source": "rule", "name": "again", "weight": 0.5}]}
    # (Rejection sampling's round is in tests/engines/rl; here what matters is a critic-free round, then
    # one whose critic starts from the policy since there is no reward model to start it from.)
    rounds = [{**small, "algorithm": "grpo", "reward": mix}, {**small, "algorithm": "ppo", "critic": {"init": "policy"}},
              {**small, "algorithm": "distill", "teacher": "round_1", "start_from": "sft"}]
    distill = {"teacher": "round_1", "top_k": 5, "epochs": 1, "batch_size": 32, "max_steps": 6}
    config = [*small_pipeline_args(tmp_path, rounds=0), f"rounds={json.dumps(rounds)}", f"distill={json.dumps(distill)}"]
    env = cli_env(PREFECT_API_URL=shared_prefect_api())
    res = alignflow_cli(["stage", "rl", *config], env=env, cwd=tmp_path / "cwd")
    assert res.returncode == 0, res.describe()
    assert "skipped: reward_model (no round scores with it or starts a critic from it)" in res.stdout
    runs = stage_runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert set(runs) == {"data", "base_model", "sft", "round_1", "round_2", "round_3"}, sorted(runs)
    assert all(r.info.status == "FINISHED" for r in runs.values()), {n: r.info.status for n, r in runs.items()}
    assert not (tmp_path / "artifacts" / "reward_model").exists()
    critic = {n: [k for k in runs[n].data.metrics if "critic/" in k] for n in ("round_1", "round_2")}
    assert runs["round_2"].data.metrics["rl/steps"] == 2 and critic["round_2"] and not critic["round_1"], critic
    m = runs["round_1"].data.metrics  # each component of the mix, and their weighted sum
    assert m["rl/reward/task_mean"] == pytest.approx(m["rl/reward/rule"] + 0.5 * m["rl/reward/again"], abs=1e-6)
    assert "rl/distill/reverse_kl_per_token" in runs["round_3"].data.metrics
    printed = stage_json(res.stdout)  # the target's stages: every round, each with its own result
    assert list(printed) == ["round_1", "round_2", "round_3"], printed
    assert printed["round_3"]["uri"].startswith(str(tmp_path / "artifacts" / "round_3"))

    offline = alignflow_cli(["stage", "distill", *config], env=env, cwd=tmp_path / "cwd")
    assert offline.returncode == 0, offline.describe()
    planned = {line.split()[0]: line for line in offline.stdout.splitlines()  # the plan's rows
               if line.startswith("  ") and ("Cached" in line or "will run" in line)}
    assert all(planned[n].endswith("Cached") for n in ("sft", "round_1")), offline.stdout  # from the rl stage
    assert all("will run" in planned[n] for n in ("distill_teacher", "distill")), offline.stdout
    assert [r["stage"] for r in stage_json(offline.stdout).values()] == ["distill"]  # a stage's own name
    runs = stage_runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert runs["distill_teacher"].data.metrics["distill/positions"] > 0
    assert 0 < runs["distill_teacher"].data.metrics["distill/teacher_topk_mass"] <= 1
    assert runs["distill"].data.metrics["train/steps"] == 6
    print(f"grpo (mixed rules) -> ppo without a reward model -> distill: {res.seconds:.0f} s; "
          f"offline distillation: {offline.seconds:.0f} s")


def test_an_evaluation_sampling_a_nucleus_measures_its_kl_with_the_policys_own_log_probs(
        small_pipeline_args, cli_env, shared_prefect_api, alignflow_cli, tmp_path):
    """With top_p < 1 the engines' log-probs are of the renormalised nucleus (log pi - log Z, above log pi):
    taken as the policy's, they put a policy's KL to itself near 5 nats here. Without SFT the base model is
    both the evaluated policy and the reference, so the KL is 0."""
    config = [*small_pipeline_args(tmp_path, rounds=0), "sft=null", "evaluation.generation.top_p=0.5"]
    res = alignflow_cli(["stage", "eval_base", *config], env=cli_env(PREFECT_API_URL=shared_prefect_api()),
                        cwd=tmp_path / "cwd")
    assert res.returncode == 0, res.describe()
    m = stage_runs(f"sqlite:///{tmp_path / 'mlflow.db'}")["eval_base"].data.metrics
    assert m["eval/kl_to_reference"] == pytest.approx(0.0, abs=1e-4) and m["eval/response_length"] > 0, m


def test_the_gpu_config_runs_end_to_end_on_the_cpu(gpu_config_on_cpu, cli_env, shared_prefect_api, alignflow_cli,
                                                   tmp_path):
    """configs/gpu-small.yaml at a small shape and without GPUs, up to its rounds (`alignflow stage rl`;
    evaluations in the run's engine host are the S3 run's): tied embeddings, bf16, gradient checkpointing,
    PPO rounds with every model colocated (the engines, as they count it, put to sleep once a step while
    the models train). Its SFT checkpoint stays tied."""
    from safetensors import safe_open

    # One step a round: the second round still starts from the first's checkpoint, and each step sleeps once.
    small = ["data.synthetic.num_sft=128", "data.synthetic.num_preference=128", "data.synthetic.num_rl_prompts=64",
             "rounds.0.steps=1", "rounds.1.steps=1", "rounds.0.prompts_per_step=16", "rounds.1.prompts_per_step=16",
             f"infra.mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    res = alignflow_cli(["stage", "rl", str(gpu_config_on_cpu(tmp_path)), *small],
                        env=cli_env(PREFECT_API_URL=shared_prefect_api()),
                        cwd=tmp_path / "cwd")
    assert res.returncode == 0, res.describe()
    runs = stage_runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert set(runs) == {*UPSTREAM, "round_1", "round_2"}, sorted(runs)
    assert all(r.info.status == "FINISHED" for r in runs.values()), {n: r.info.status for n, r in runs.items()}
    assert [runs[f"round_{i}"].data.metrics["rl/engine_sleeps"] for i in (1, 2)] == [1.0, 1.0]
    (sft,) = (tmp_path / "cwd" / "artifacts" / "sft").iterdir()
    with safe_open(str(sft / "model.safetensors"), framework="pt") as st:
        assert "model.embed_tokens.weight" in st.keys() and "lm_head.weight" not in st.keys()
    print(f"gpu-small at a small shape on the CPU: {res.seconds:.0f} s")


# ---- 7b: bad user data --------------------------------------------------------------


def test_bad_data_row_fails_naming_file_row_and_key(small_pipeline_args, cli_env, shared_prefect_api, alignflow_cli,
                                                    moto_s3, tmp_path):
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

    res = alignflow_cli(args, env=cli_env(AWS_ENDPOINT_URL=moto_s3.endpoint_url, PREFECT_API_URL=shared_prefect_api()),
                        cwd=tmp_path / "cwd")
    assert res.returncode == 2, res.describe()
    assert f"preflight: data.sft: {bad} is remote, so its first 5 rows were checked" in res.stderr, res.describe()
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and f"{bad}, row 8: missing key 'response'" in last, res.describe()
    # A user error is not retried (the default infra.task_retries=2 would retry anything else).
    assert "Retry" not in res.output and "AwaitingRetry" not in res.output, res.describe()
    assert not (tmp_path / "artifacts" / "sft").exists(), "training started on bad data"
    print(f"bad data failed after {res.seconds:.0f} s")
