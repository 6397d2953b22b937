"""Task adapters: the one task body every stage kind shares, its cache key and retry rule.

The data stage runs for real here (local storage root, MLflow in a SQLite
file); it needs no Ray.
"""

from __future__ import annotations

import inspect
import json

import pytest
from pydantic import ValidationError

from alignflow.config import load_config
from alignflow.errors import ConfigError, DataError
from alignflow.records import StageResult
from tasks.context import RunContext
from tasks.plan import plan_pipeline
from tasks.registry import STAGE_KINDS
from tasks.runner import retry_unless_user_error, run_stage, stage_cache_key

SMALL = ["data.synthetic.num_sft=20", "data.synthetic.num_preference=20", "data.synthetic.num_eval=5",
         "data.synthetic.num_rl_prompts=5"]


@pytest.fixture
def ctx(tmp_path) -> RunContext:
    cfg = load_config(None, [*SMALL, f"infra.storage.root={tmp_path / 'artifacts'}",
                             f"infra.mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    return RunContext(infra=cfg.infra)


def test_a_credential_in_a_url_reaches_neither_the_manifest_nor_mlflow(ctx, tmp_path):
    from mlflow import MlflowClient

    from tasks.context import compute_stage

    # A config refuses a credential written out (test_core_config); one copied past validation (model_copy)
    # still keeps it out of what a stage writes down.
    cfg = load_config(None, ['rounds=[{"algorithm": "grpo", "reward": {"source": "remote", "url": "https://x"}}]'])
    reward = cfg.rounds[0].reward.model_copy(update={"url": "https://bob:hunter2@rm.example/score?api_key=s3cr3t"})
    plan = plan_pipeline(cfg.model_copy(update={"rounds": [cfg.rounds[0].model_copy(update={"reward": reward})]}))

    def compute(out, run):
        (out.dir / "policy.txt").write_text("trained")
        return {"rl/reward": 1.0}

    result = compute_stage(ctx, plan.stages["round_1"], compute)
    manifest = (tmp_path / "artifacts" / "round_1" / result.key / "manifest.json").read_text()
    assert json.loads(manifest)["meta"]["config"]["round"]["reward"]["url"] == "https://rm.example/score?api_key=***"
    [run] = MlflowClient(ctx.infra.mlflow_tracking_uri).search_runs(
        [MlflowClient(ctx.infra.mlflow_tracking_uri).get_experiment_by_name(ctx.infra.mlflow_experiment).experiment_id])
    params = json.dumps(run.data.params)
    assert run.data.params["round.reward.url"] == "https://rm.example/score?api_key=***"
    for text in (manifest, params):
        assert "hunter2" not in text and "s3cr3t" not in text


def test_every_kind_names_a_runnable_stage_function():
    for kind in STAGE_KINDS.values():
        fn = kind.runner()
        assert list(inspect.signature(fn).parameters) == ["stage", "inputs", "ctx"], kind.name


def test_the_planner_gives_each_kind_its_declared_config():
    plan = plan_pipeline(load_config())
    for stage in plan.stages.values():
        assert type(stage.config) is STAGE_KINDS[stage.kind].config, stage.name


def test_run_stage_commits_with_its_plan_record_and_is_idempotent(ctx, tmp_path):
    plan = plan_pipeline(load_config(None, SMALL))
    stage = plan.stages["data"]
    model = run_stage(plan.stages["base_model"], {}, ctx)
    first = run_stage(stage, {"model": model}, ctx)
    assert first == StageResult(stage="data", key=stage.key, uri=str(tmp_path / "artifacts" / "data" / stage.key),
                                metrics=first.metrics)
    assert first.metrics["data/sft_rows"] == 20
    manifest = json.loads((tmp_path / "artifacts" / "data" / stage.key / "manifest.json").read_text())
    meta = manifest["meta"]
    assert meta["input_keys"] == {"model": model.key} and meta["code_version"] == STAGE_KINDS["data"].code_version
    assert meta["config"]["data"]["synthetic"]["num_sft"] == 20 and meta["config"]["seed"] == stage.config.seed
    mtime = (tmp_path / "artifacts" / "data" / stage.key / "sft.jsonl").stat().st_mtime_ns
    again = run_stage(stage, {"model": model}, ctx)
    assert again == first
    assert (tmp_path / "artifacts" / "data" / stage.key / "sft.jsonl").stat().st_mtime_ns == mtime


def test_a_result_cached_before_the_root_moved_is_read_from_where_the_root_is_now(ctx, tmp_path):
    """A cached StageResult (Prefect's results travel with the root) keeps the URI it was committed at; after
    the root moves, or on a host that mounts it at another path, its inputs are read under the root as it is."""
    import shutil

    from tasks.context import RunContext
    from tasks.stages.data import load_split

    plan = plan_pipeline(load_config(None, SMALL))
    model = run_stage(plan.stages["base_model"], {}, ctx)
    data = run_stage(plan.stages["data"], {"model": model}, ctx)
    rows = load_split(data, ctx, "sft")
    moved = tmp_path / "bigger-disk" / "artifacts"
    shutil.move(str(tmp_path / "artifacts"), str(moved))
    there = RunContext(infra=ctx.infra.model_copy(update={"storage": ctx.infra.storage.model_copy(
        update={"root": str(moved)})}))
    assert data.uri.startswith(str(tmp_path / "artifacts")) and load_split(data, there, "sft") == rows
    assert there.ref(model).uri == str(moved / "base_model" / model.key)


def test_run_stage_rejects_missing_inputs_before_any_work(ctx, tmp_path):
    stage = plan_pipeline(load_config(None, SMALL)).stages["sft"]
    data = StageResult(stage="data", key="k", uri=str(tmp_path / "nowhere"))
    with pytest.raises(ValidationError, match="init"):
        run_stage(stage, {"data": data}, ctx)
    assert not (tmp_path / "artifacts").exists()


def test_cache_key_is_the_stage_key():
    stage = plan_pipeline(load_config()).stages["round_2"]
    assert stage_cache_key(None, {"stage": stage, "inputs": {}, "ctx": None}) == f"round_2-{stage.key}"


def test_user_errors_are_not_retried():
    from prefect.states import Completed, Failed

    assert retry_unless_user_error(None, None, Failed(data=RuntimeError("flaky network"))) is True
    assert retry_unless_user_error(None, None, Failed(data=DataError("f.jsonl, row 3: missing key"))) is False
    assert retry_unless_user_error(None, None, Failed(data=ConfigError("reward.rule cannot be imported"))) is False
    assert retry_unless_user_error(None, None, Completed(data=1)) is True


def test_an_input_corrupted_at_its_size_is_set_aside_and_not_retried(ctx, tmp_path, monkeypatch):
    """The cache's check before a stage runs compares sizes (one listing): an input changed at the same size was
    handed on, and its dependant failed reading it at every retry, and at every later run. Found where it is
    read, the input is set aside (uncommitted, files kept) and the error is not retried; the next run's
    lost_artifact sees it uncommitted, and its stage runs again."""
    import tasks.stages.train as train
    from prefect.states import Failed

    from alignflow.store.faults import CorruptArtifact, CorruptInput, corrupt_artifacts
    from flows.stage_tasks import lost_artifact

    plan = plan_pipeline(load_config(None, SMALL))
    model = run_stage(plan.stages["base_model"], {}, ctx)
    data = run_stage(plan.stages["data"], {"model": model}, ctx)
    sft = tmp_path / "artifacts" / "data" / data.key / "sft.jsonl"
    text = sft.read_text()
    sft.write_text(text.replace('"', "'", 1))  # one byte, the size unchanged

    def reads_its_data(stage, inputs, ctx):  # a stage body's first act: its input, fetched and verified
        ctx.storage().fetch(ctx.uri(inputs.data))

    monkeypatch.setattr(train, "sft", reads_its_data)
    with pytest.raises(CorruptInput) as err:
        run_stage(plan.stages["sft"], {"data": data, "init": model}, ctx)
    assert str(err.value).startswith(f"sft: its input 'data' (data at {sft.parent}) no longer matches its manifest "
                                     "(sft.jsonl (sha256 mismatch)): set aside (")
    assert (sft.parent / "manifest.corrupt.json").exists() and not (sft.parent / "manifest.json").exists()
    assert sft.read_text() != text  # the files are kept for a look
    assert retry_unless_user_error(None, None, Failed(data=err.value)) is False
    assert lost_artifact(ctx.storage(), str(sft.parent)) is True  # the next run computes data again

    class RayTaskError(Exception):  # Ray's shape: the task's own exception as `cause`, the message a traceback
        def __init__(self, cause):
            super().__init__(f"ray::TrainWorker.load() (pid=1)\n  ...\n{type(cause).__name__}: {cause}")
            self.cause = cause

    inner = CorruptArtifact(f"{sft.parent}/x: files do not match the manifest: a (missing or wrong size)")
    try:
        raise RuntimeError("the round failed") from RayTaskError(inner)
    except RuntimeError as outer:
        [found] = corrupt_artifacts(outer)
    assert found is inner and found.uri == f"{sft.parent}/x"


def test_a_failure_after_the_commit_leaves_the_stage_run_finished(ctx, monkeypatch, caplog):
    """Committed, a stage is done (a retry finds it committed and starts no run): pruning its checkpoints failing
    left its MLflow run FAILED beside a good artifact. Now said, and the run FINISHED."""
    from mlflow import MlflowClient

    from alignflow.store.storage import Storage
    from tasks.context import compute_stage

    def refused(self, uri, keep_step=None):
        raise PermissionError("s3: AccessDenied on delete")

    monkeypatch.setattr(Storage, "prune_checkpoints", refused)
    stage = plan_pipeline(load_config(None, SMALL)).stages["data"]

    def compute(out, run):
        (out.dir / "sft.jsonl").write_text("{}\n")
        return {"data/sft_rows": 1.0}

    with caplog.at_level("WARNING", logger="alignflow"):
        result = compute_stage(ctx, stage, compute)
    assert ctx.storage().is_committed(result.uri) and result.metrics == {"data/sft_rows": 1.0}
    client = MlflowClient(ctx.infra.mlflow_tracking_uri)
    [run] = client.search_runs([client.get_experiment_by_name(ctx.infra.mlflow_experiment).experiment_id])
    assert run.info.status == "FINISHED"
    assert any(f"data: committed at {result.uri}, but pruning its checkpoints failed (PermissionError: s3: "
               "AccessDenied on delete)" in r.getMessage() for r in caplog.records)
    assert run.data.tags["alignflow.uri"] == result.uri  # the tag after it is still set
