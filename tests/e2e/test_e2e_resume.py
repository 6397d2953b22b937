"""End to end, the CLI stopped and run again: a failed stage fixed and rerun (the rest from cache), Ctrl-C
mid-SFT and the rerun resuming, a round stopped by SIGTERM and a DPO stage killed outright at a checkpoint, each
resumed.
Local storage roots of their own; real Prefect, Ray, DeepSpeed, vLLM and MLflow, as in test_e2e_pipeline.py:
a CLI stopped has a Prefect server of its own (all it started must end with it); the other runs share one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import signal
import tempfile
import textwrap
from pathlib import Path

import pytest
from e2e_cli import UPSTREAM, experiment_id, mlflow_client, parse_stages, stage_json

pytestmark = pytest.mark.e2e


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


def test_failed_stage_fixed_and_rerun_runs_alone(small_pipeline_args, cli_env, shared_prefect_api, alignflow_cli,
                                                 tmp_path):
    src = tmp_path / "checker_src"
    src.mkdir()
    module = src / "e2e_flaky_checker.py"
    module.write_text(textwrap.dedent(BROKEN_CHECKER))
    pythonpath = os.pathsep.join(p for p in (str(src), os.environ.get("PYTHONPATH")) if p)
    env = cli_env(PYTHONPATH=pythonpath, PYTHONDONTWRITEBYTECODE="1", PREFECT_API_URL=shared_prefect_api())
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
    # And the data stage's artifact deleted behind Prefect's back (a bucket's lifecycle rule): Prefect still has
    # its cached result, but the stage runs again, into the same place; its dependants stay Cached.
    shutil.rmtree(committed["data"])
    fixed = alignflow_cli(args, env=env, cwd=tmp_path / "cwd")
    assert fixed.returncode == 0, fixed.describe()
    stages = parse_stages(fixed.stdout)
    assert stages["data"] == ("Completed", committed["data"]), stages["data"]
    assert (Path(committed["data"]) / "manifest.json").exists()
    for name in UPSTREAM:
        if name != "data":
            assert stages[name] == ("Cached", committed[name]), f"{name}: {stages[name]}"
    assert stages["eval_base"][0] == stages["eval_sft"][0] == "Completed", stages
    for name, (state, _) in stages.items():
        if name == "eval_reward_model":  # independent of the checker: it may have finished in the failed run
            assert state in ("Cached", "Completed"), f"{name}: {state}"
        elif name.startswith("eval_"):  # every policy evaluation (it calls the checker) ran again
            assert state == "Completed", f"{name}: {state}"
        elif name != "data":  # the rest finished in the failed run
            assert state == "Cached", f"{name}: {state}"
    print(f"failed run {failed.seconds:.0f} s, fixed rerun without data {fixed.seconds:.0f} s")


# ---- 6: a killed stage resumes from its mid-stage checkpoint ----------------------


@dataclasses.dataclass(frozen=True)
class Resumed:
    stage_dir: Path
    checkpoint_step: int  # the last committed checkpoint when the run was killed
    rerun: object  # CliResult
    run: object  # the one FINISHED MLflow run of the stage
    status: int  # the stopped CLI's exit status
    err: str  # and its stderr


# SFT stopped once a checkpoint exists (step 20, or 40 where the signal came after the next one) and resumed:
# the rerun trains the rest, so every step past the stop is paid twice. A tiny SFT step takes about 0.05 s
# here and the kill is polled every 0.2 s, so 100 steps leave it a wide margin.
SFT_TOTAL = 100


def kill_and_resume(stage: str, args: list[str], tmp_path: Path, *, alignflow_cli, cli_env, rerun_api: str,
                    process_tools, signum: int = signal.SIGKILL, every_process: bool = False) -> Resumed:
    """Send `signum` to `alignflow ARGS` at the stage's first committed checkpoint (the CLI with a Prefect
    server of its own: all it started must end with it), check that nothing looks committed, rerun it (on the
    Prefect API `rerun_api`), and check the stage committed with its checkpoints pruned. Returns what the
    caller checks the stop and the resume against."""
    root, cwd, env = tmp_path / "artifacts", tmp_path / "cwd", cli_env()
    pattern = f"{stage}/*/checkpoints/step-*/manifest.json"
    status = process_tools.kill_at_checkpoint(args, env=env, cwd=cwd, checkpoint_glob=root / pattern, signum=signum,
                                              every_process=every_process)
    err = (cwd / "killed.err").read_text()

    stage_dirs = {p.parent.parent.parent for p in root.glob(pattern)}
    assert len(stage_dirs) == 1
    stage_dir = stage_dirs.pop()
    assert not (stage_dir / "manifest.json").exists(), f"the killed {stage} looks committed"
    step = max(int(p.parent.name.removeprefix("step-")) for p in stage_dir.glob("checkpoints/step-*/manifest.json"))

    rerun = alignflow_cli(args, env=cli_env(PREFECT_API_URL=rerun_api), cwd=cwd)
    assert rerun.returncode == 0, rerun.describe()
    assert stage_json(rerun.stdout)[stage]["uri"] == str(stage_dir)
    assert (stage_dir / "manifest.json").exists()
    assert not list(stage_dir.glob("checkpoints/step-*")), f"checkpoints left after {stage} committed"

    client = mlflow_client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([experiment_id(client)], filter_string=f"tags.`alignflow.stage` = '{stage}'")
    finished = [r for r in runs if r.info.status == "FINISHED" and r.data.tags.get("alignflow.uri") == str(stage_dir)]
    assert len(finished) == 1, [(r.info.run_id, r.info.status, r.data.tags.get("alignflow.uri")) for r in runs]
    run = finished[0]
    assert int(run.data.tags["alignflow.resumed_from_step"]) == step
    return Resumed(stage_dir=stage_dir, checkpoint_step=step, rerun=rerun, run=run, status=status, err=err)


def test_ctrl_c_mid_sft_ends_the_runs_killed_and_the_rerun_resumes(small_pipeline_args, cli_env, shared_prefect_api,
                                                                    alignflow_cli, process_tools, tmp_path):
    """SIGINT to `alignflow run` mid-SFT, sent to its process group as Ctrl-C sends it: the CLI stops with a
    nonzero status and nothing it started outlives it, the MLflow parent run ends KILLED and no stage run is
    left RUNNING. Then `alignflow stage sft` resumes it from that checkpoint and trains exactly the rest.
    (A stage killed outright, SIGKILL with no clean-up, and resumed: DPO's test below.)"""
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

    rerun = alignflow_cli(["stage", "sft", *args], env=cli_env(PREFECT_API_URL=shared_prefect_api()), cwd=cwd)
    assert rerun.returncode == 0, rerun.describe()
    result = stage_json(rerun.stdout)["sft"]
    assert result["uri"] == str(stage_dir) and (stage_dir / "manifest.json").exists()
    assert not list(stage_dir.glob("checkpoints/step-*")), "checkpoints left after sft committed"
    metrics = result["metrics"]
    assert metrics["train/resumed_from_step"] == step and metrics["train/steps_run"] == total - step
    assert metrics["train/steps"] == total
    runs = client.search_runs([experiment_id(client)], filter_string="tags.`alignflow.stage` = 'sft'")
    [finished] = [r for r in runs if r.info.status == "FINISHED"]
    assert int(finished.data.tags["alignflow.resumed_from_step"]) == step
    print(f"Ctrl-C after checkpoint step {step}; the rerun resumed in {rerun.seconds:.0f} s")


def test_round_stopped_by_sigterm_ends_killed_and_resumes_its_steps(small_pipeline_args, cli_env, shared_prefect_api,
                                                                    alignflow_cli, process_tools, tmp_path):
    """SIGTERM mid-round to every process the run started at once, as systemd (KillMode=control-group) and Slurm
    (scancel) stop a unit or a job step, stops it as Ctrl-C does: status 143, one line saying what stopped, the
    runs KILLED, nothing left running. Its Ray goes down beside it; its Prefect server outlives the signal
    (which once left the CLI retrying the API for a minute until Ray's lost GCS ended it, status 1), and the
    CLI ends it. The stop comes while the CLI waits on Ray for the stages, where a handler raising inside Ray's
    wait once turned it into a SystemError with a traceback and status 1. Then the rerun resumes the round.
    (A signal to the CLI's process group alone: the Ctrl-C test.)"""
    total = 12  # stopped at step 4 or 8: a tiny round's step takes about 1.5 s here, so 4+ steps of margin
    # GRPO on the rule: no reward model to train first, no critic or reward actor to start, twice.
    round_cfg = {"algorithm": "grpo", "steps": total, "checkpoint_every": 4, "prompts_per_step": 8,
                 "generation": {"num_samples": 2, "max_new_tokens": 8}, "ppo": {"epochs": 1, "minibatch_size": 16},
                 "reward": {"source": "rule"}}
    args = ["stage", "rl", *small_pipeline_args(tmp_path, rounds=0), f"rounds={json.dumps([round_cfg])}"]
    r = kill_and_resume("round_1", args, tmp_path, alignflow_cli=alignflow_cli, cli_env=cli_env,
                        rerun_api=shared_prefect_api(), process_tools=process_tools, signum=signal.SIGTERM,
                        every_process=True)
    assert r.status == 143, r.err[-3000:]
    # Nothing but the run's warnings (its SFT's data), no traceback, and the one line.
    lines = [line for line in r.err.strip().splitlines() if not line.startswith("log: ") and "| WARNING |" not in line]
    assert len(lines) == 1, r.err[-6000:]
    stopped = re.fullmatch(rf"interrupted: round_1 stopped at step (\d+) of {total}; alignflow stage rl resumes it",
                           lines[0])
    assert stopped, r.err[-3000:]
    resumed = r.checkpoint_step
    assert 4 <= resumed <= int(stopped[1]) < total
    assert r.run.data.metrics["rl/steps"] == total
    assert r.run.data.metrics["rl/steps_run"] == total - resumed
    # The resumed run logged the remaining steps, resumed+1 .. total, and took 1 .. resumed from the stopped
    # run (the rerun is a new pipeline run: a new parent), so its curve starts at step 1.
    client = mlflow_client(f"sqlite:///{tmp_path / 'mlflow.db'}")
    history = {m.step: m.value for m in client.get_metric_history(r.run.info.run_id, "rl/reward/mean")}
    assert sorted(history) == list(range(1, total + 1)), sorted(history)
    stopped_run = r.run.data.tags["alignflow.history_from"]
    assert client.get_run(stopped_run).info.status == "KILLED"
    assert {m.step: m.value for m in client.get_metric_history(stopped_run, "rl/reward/mean")
            if m.step <= resumed} == {s: history[s] for s in range(1, resumed + 1)}
    runs = client.search_runs([experiment_id(client)])
    statuses = [(run.info.run_name, run.info.status) for run in runs]
    parents = [run.info.status for run in runs if "mlflow.parentRunId" not in run.data.tags]
    rounds = [run.info.status for run in runs if run.data.tags.get("alignflow.stage") == "round_1"]
    assert sorted(parents) == sorted(rounds) == ["FINISHED", "KILLED"], statuses
    assert "RUNNING" not in dict(statuses).values(), statuses
    print(f"round stopped by SIGTERM after checkpoint step {resumed}; rerun {r.rerun.seconds:.0f} s")


# ---- 8: the preference stage (DPO and kin) ------------------------------------------


def test_kto_then_packed_dpo_killed_and_resumed_reuse_the_cached_reference_and_log_per_step_rewards(
        small_pipeline_args, cli_env, shared_prefect_api, alignflow_cli, process_tools, tmp_path):
    small = {"max_steps": 4, "batch_size": 16, "log_every": 1}
    base = ["stage", "preference", *small_pipeline_args(tmp_path, rounds=0), "sft.packing=true"]
    root, client = tmp_path / "artifacts", mlflow_client(f"sqlite:///{tmp_path / 'mlflow.db'}")

    def committed(stage: str) -> list[Path]:
        return sorted(p.parent for p in root.glob(f"{stage}/*/manifest.json"))

    def runs(stage: str) -> list:
        return client.search_runs([experiment_id(client)], filter_string=f"tags.`alignflow.stage` = '{stage}'")

    kto = alignflow_cli([*base, f"preference={json.dumps({**small, 'loss': 'kto'})}"],
                        env=cli_env(PREFECT_API_URL=shared_prefect_api()),
                        cwd=tmp_path / "cwd")
    assert kto.returncode == 0, kto.describe()
    [ref_dir] = committed("preference_reference")
    assert (ref_dir / "reference_logps.safetensors").exists()
    [kto_dir] = committed("preference")
    assert (kto_dir / "model.safetensors").exists() and stage_json(kto.stdout)["preference"]["uri"] == str(kto_dir)
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
                        alignflow_cli=alignflow_cli, cli_env=cli_env, rerun_api=shared_prefect_api(),
                        process_tools=process_tools)
    assert 10 <= r.checkpoint_step < total
    assert committed("preference_reference") == [ref_dir] and len(runs("preference_reference")) == 1
    assert len(committed("preference")) == 2 and len(runs("preference")) == 3
    metrics = stage_json(r.rerun.stdout)["preference"]["metrics"]
    assert metrics["train/steps"] == total and 0.0 <= metrics["train/final_accuracy"] <= 1.0
    assert metrics["train/resumed_from_step"] == r.checkpoint_step
    assert metrics["train/steps_run"] == total - r.checkpoint_step
    kto_run, killed_run, dpo_run = sorted(runs("preference"), key=lambda r: r.info.start_time)
    assert dpo_run.info.run_id == r.run.info.run_id

    def history(run, name: str) -> list[tuple[int, float]]:
        return [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, f"train/{name}"),
                                                  key=lambda m: m.step)]

    # The resumed run logged the steps after its checkpoint and took the ones before it from the killed run (the
    # rerun is a new pipeline run: a new parent). Packed: every step's samples shared rows (fewer rows than
    # samples); the KTO run, unpacked, reports none.
    packing = history(dpo_run, "packing/rows_per_sample")
    assert [step for step, _ in packing] == list(range(1, total + 1)), packing
    assert packing[:r.checkpoint_step] == history(killed_run, "packing/rows_per_sample")[:r.checkpoint_step]
    assert dpo_run.data.tags["alignflow.history_from"] == killed_run.info.run_id
    assert all(0 < v < 1 for _, v in packing), packing
    assert all(0 < v <= 1 for _, v in history(dpo_run, "packing/fill"))
    assert history(kto_run, "packing/rows_per_sample") == []
    # DPO through the packed rows: the first step's policy is the reference (the SFT model), so its loss (in the
    # killed run) is -log sigmoid(0) = log 2 and its margin 0; by the resumed run's last step the loss has fallen.
    (first, loss), (_, margin) = history(killed_run, "loss")[0], history(killed_run, "reward_margin")[0]
    assert first == 1 and loss == pytest.approx(math.log(2), abs=1e-3) and margin == pytest.approx(0.0, abs=1e-3)
    assert history(dpo_run, "loss")[-1][1] < loss, history(dpo_run, "loss")

    # SimPO has no reference: the plan skips preference_reference (nothing new scored) and the stage trains the
    # pairs alone, from the same SFT checkpoint, packed too.
    simpo = alignflow_cli([*base, f"preference={json.dumps({**small, 'loss': 'simpo', 'beta': 2.0})}"],
                          env=cli_env(PREFECT_API_URL=shared_prefect_api()), cwd=tmp_path / "cwd")
    assert simpo.returncode == 0, simpo.describe()
    assert "skipped: preference_reference (preference.loss simpo has no reference model)" in simpo.stdout
    assert committed("preference_reference") == [ref_dir] and len(committed("preference")) == 3
    assert list(stage_json(simpo.stdout)) == ["preference"]
    [simpo_run] = [run for run in runs("preference") if run.info.run_id not in
                   {kto_run.info.run_id, killed_run.info.run_id, dpo_run.info.run_id}]
    assert [step for step, _ in history(simpo_run, "loss")] == [1, 2, 3, 4]
    assert all(v < 0 for _, v in history(simpo_run, "chosen_reward"))  # β x a mean token log-probability
