"""Learning curves: metric histories read back from a real MLflow SQLite store, the PNGs drawn
from them, and their publication by `close_run` (parent-run artifacts, a copy under the
storage root, local or a real S3 endpoint). Nothing is mocked."""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path

import pytest

from alignflow.config.pipeline import InfraConfig, StorageConfig
from alignflow.store.storage import Storage
from alignflow.tracking.runs import Tracker
from flows.curves import draw_curves, publish_curves, wanted
from flows.report import PipelineReport, close_run
from tasks.context import RunContext

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
EXPERIMENT = "alignflow-test"  # the shared `tracker` fixture's (tests/conftest.py)




def _client(tracker):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracker.tracking_uri)


def _key(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:12]}"  # content keys unique to one test: the store is shared


def _stage(tracker, parent, stage, steps, key=None, summary=None, fail=False):
    """A child run of `parent` logging `steps` ({step: {key: value}}, in the order given)."""
    try:
        with tracker.stage_run(parent, stage, {}, tags={"alignflow.key": key or _key(stage)}) as run:
            for step, metrics in steps.items():
                run.log_metrics(metrics, step=step)
            if summary:
                run.log_metrics(summary)  # no step: step 0, as the stages log their summaries
            if fail:
                raise RuntimeError("attempt failed")
    except RuntimeError:
        assert fail
    time.sleep(0.01)  # runs one after another start at distinct milliseconds


def _pipeline_stages(tracker, parent):
    _stage(tracker, parent, "sft", {2: {"train/loss": 2.0}, 1: {"train/loss": 3.0}, 3: {"train/loss": 1.5}},
           summary={"train/final_loss": 1.5})
    _stage(tracker, parent, "round_1", {1: {"rl/reward/mean": 0.25, "rl/kl": 0.0},
                                        2: {"rl/reward/mean": 0.5, "rl/kl": 0.125}})
    _stage(tracker, parent, "round_2", {1: {"rl/reward/mean": 0.75, "rl/kl": 0.0625},
                                        2: {"rl/reward/mean": 1.0, "rl/kl": 0.25}})
    _stage(tracker, parent, "eval_sft", {}, summary={"eval/accuracy": 0.375, "eval/reward": -0.5})


# ---- metric_histories ----------------------------------------------------------------------


def test_metric_histories_are_the_logged_steps_of_each_child_run(tracker):
    parent = tracker.start_parent("pipeline", {})
    _pipeline_stages(tracker, parent)
    other = tracker.start_parent("another pipeline", {})
    _stage(tracker, other, "sft", {1: {"train/loss": 99.0}})

    assert tracker.metric_histories(parent) == {
        "sft": {"train/loss": [(1, 3.0), (2, 2.0), (3, 1.5)], "train/final_loss": [(0, 1.5)]},
        "round_1": {"rl/reward/mean": [(1, 0.25), (2, 0.5)], "rl/kl": [(1, 0.0), (2, 0.125)]},
        "round_2": {"rl/reward/mean": [(1, 0.75), (2, 1.0)], "rl/kl": [(1, 0.0625), (2, 0.25)]},
        "eval_sft": {"eval/accuracy": [(0, 0.375)], "eval/reward": [(0, -0.5)]},
    }
    assert tracker.metric_histories(parent, keep=wanted) == {
        "sft": {"train/loss": [(1, 3.0), (2, 2.0), (3, 1.5)]},
        "round_1": {"rl/reward/mean": [(1, 0.25), (2, 0.5)], "rl/kl": [(1, 0.0), (2, 0.125)]},
        "round_2": {"rl/reward/mean": [(1, 0.75), (2, 1.0)], "rl/kl": [(1, 0.0625), (2, 0.25)]},
        "eval_sft": {"eval/accuracy": [(0, 0.375)]},
    }


def test_a_retried_stage_is_its_attempts_merged_the_later_winning(tracker):
    parent = tracker.start_parent("pipeline", {})
    key = _key("round_1")
    # Attempt 1 dies after step 3; attempt 2 resumes from its step-2 checkpoint and redoes step 3.
    _stage(tracker, parent, "round_1", {1: {"rl/kl": 0.5}, 2: {"rl/kl": 1.0}, 3: {"rl/kl": 8.0}}, key=key, fail=True)
    _stage(tracker, parent, "round_1", {3: {"rl/kl": 1.5}, 4: {"rl/kl": 2.0}}, key=key)

    assert tracker.metric_histories(parent) == {"round_1": {"rl/kl": [(1, 0.5), (2, 1.0), (3, 1.5), (4, 2.0)]}}


def test_a_cached_stage_is_found_by_its_key_under_an_earlier_parent(tracker):
    sft_key, round_key = _key("sft"), _key("round_1")
    first = tracker.start_parent("first", {}, tags={"alignflow.key.sft": sft_key})
    _stage(tracker, first, "sft", {1: {"train/loss": 4.0}}, key=sft_key)
    second = tracker.start_parent("second", {}, tags={"alignflow.key.sft": sft_key})
    _stage(tracker, second, "sft", {1: {"train/loss": 2.0}, 2: {"train/loss": 1.0}}, key=sft_key)
    _stage(tracker, second, "sft", {1: {"train/loss": 9.0}}, key=sft_key, fail=True)  # newest, but FAILED
    # The rerun: sft served from cache (no child run here), round_1 computed; eval_sft never ran anywhere.
    rerun = tracker.start_parent("rerun", {}, tags={"alignflow.key.sft": sft_key, "alignflow.key.round_1": round_key,
                                                   "alignflow.key.eval_sft": _key("eval_sft")})
    _stage(tracker, rerun, "round_1", {1: {"rl/reward/mean": 0.5}}, key=round_key)

    expected = {"sft": {"train/loss": [(1, 2.0), (2, 1.0)]}, "round_1": {"rl/reward/mean": [(1, 0.5)]}}
    assert tracker.metric_histories(rerun) == expected
    # The plan's keys, given explicitly, instead of the parent's tags.
    assert tracker.metric_histories(rerun, stage_keys={"sft": sft_key}) == expected
    assert tracker.metric_histories(rerun, stage_keys={}) == {"round_1": {"rl/reward/mean": [(1, 0.5)]}}


# ---- draw_curves ---------------------------------------------------------------------------

HISTORIES = {
    "sft": {"train/loss": [(1, 3.0), (2, 2.0), (3, 1.5)], "train/final_loss": [(0, 1.5)]},
    "reward_model": {"train/loss": [(2, 0.69), (4, 0.5)], "train/accuracy": [(2, 0.5), (4, 0.75)]},
    "round_1": {"rl/reward/mean": [(1, 0.25), (2, 0.5)], "rl/reward/std": [(1, 0.125), (2, 0.125)],
                "rl/kl": [(1, 0.0), (2, 0.125)]},
    "round_2": {"rl/reward/mean": [(1, 0.75), (2, 1.0)], "rl/kl": [(1, 0.0625), (2, 0.25)]},
    "eval_base": {"eval/accuracy": [(0, 0.125)]},
    "eval_sft": {"eval/accuracy": [(0, 0.375)]},
    "eval_round_2": {"eval/accuracy": [(0, 0.5)]},
    "eval_reward_model": {"eval/rm_pairwise_accuracy": [(0, 0.75)]},
}


def _png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a valid PNG, read back by matplotlib."""
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[0] > 0 and pixels.shape[1] > 0
    return pixels.shape[1], pixels.shape[0]


def test_draw_curves_writes_loss_rounds_and_eval_pngs(tmp_path):
    paths = draw_curves(HISTORIES, tmp_path / "curves")
    assert paths == [tmp_path / "curves" / name for name in ("loss.png", "rounds.png", "eval.png")]
    assert _png_size(paths[0]) == (920, 340)  # two panels (sft, reward_model) of 4.6 x 3.4 in at 100 dpi
    assert _png_size(paths[1]) == (920, 340)  # reward and KL; no round logs an accuracy: no third panel
    assert _png_size(paths[2]) == (480, 340)  # three policies' bars


def test_a_round_accuracy_adds_a_panel(tmp_path):
    histories = {**HISTORIES, "round_1": {**HISTORIES["round_1"], "rl/accuracy": [(1, 0.25), (2, 0.5)]}}
    paths = draw_curves(histories, tmp_path)
    assert _png_size(tmp_path / "rounds.png") == (1380, 340)
    assert len(paths) == 3


def test_a_pipeline_without_rounds_draws_loss_and_eval_only(tmp_path):
    histories = {k: v for k, v in HISTORIES.items() if not k.startswith("round_")}
    assert draw_curves(histories, tmp_path) == [tmp_path / "loss.png", tmp_path / "eval.png"]
    assert not (tmp_path / "rounds.png").exists()
    _png_size(tmp_path / "loss.png")


def test_a_pipeline_without_training_or_evaluation_draws_the_rounds_only(tmp_path):
    histories = {"round_1": HISTORIES["round_1"], "sft": {"train/loss": [], "train/final_loss": [(0, 1.0)]}}
    assert draw_curves(histories, tmp_path) == [tmp_path / "rounds.png"]
    assert draw_curves({}, tmp_path / "none") == []


def test_draw_curves_draws_long_histories(tmp_path):
    long = {"sft": {"train/loss": [(s, 1 / s) for s in range(1, 501)]},
            **{f"round_{r}": {"rl/reward/mean": [(s, s / 200) for s in range(1, 201)],
                              "rl/reward/std": [(s, 0.1) for s in range(1, 201)],
                              "rl/kl": [(s, s / 1000) for s in range(1, 201)]} for r in (1, 2, 3)},
            **{f"eval_{p}": {"eval/accuracy": [(0, 0.5)]} for p in ("base", "sft", "round_1", "round_2", "round_3")}}
    paths = draw_curves(long, tmp_path / "long")
    assert len(paths) == 3 and all(p.stat().st_size > 0 for p in paths)


# ---- close_run / publish_curves ------------------------------------------------------------


def _report(parent: str, tracker, root: str) -> PipelineReport:
    return PipelineReport(mlflow_run_id=parent, mlflow_tracking_uri=tracker.tracking_uri, storage_root=root,
                          stage_uris={}, stage_states={}, policies={"sft": {"eval/accuracy": 0.375}})


def _ctx(tracker, parent: str, root: str | Path) -> RunContext:
    infra = InfraConfig(mlflow_tracking_uri=tracker.tracking_uri, mlflow_experiment=EXPERIMENT,
                        storage=StorageConfig(root=str(root)))
    return RunContext(infra=infra, parent_run_id=parent)


def test_close_run_logs_the_curves_to_the_parent_run_and_saves_them_beside_the_artifacts(tracker, tmp_path):
    parent = tracker.start_parent("pipeline", {})
    _pipeline_stages(tracker, parent)
    root = tmp_path / "artifacts"
    report = _report(parent, tracker, str(root))

    close_run(_ctx(tracker, parent, root), report)

    assert report.curves_uri == f"{root.resolve()}/curves/{parent}"
    saved = sorted(p.name for p in Path(report.curves_uri).iterdir())
    assert saved == ["eval.png", "loss.png", "rounds.png"]
    for name in saved:
        _png_size(Path(report.curves_uri) / name)
    client = _client(tracker)
    assert sorted(a.path for a in client.list_artifacts(parent, "curves")) == [f"curves/{n}" for n in saved]
    assert client.get_run(parent).info.status == "FINISHED"


def test_curves_that_cannot_be_saved_are_a_warning_not_a_failure(tracker, tmp_path, caplog):
    parent = tracker.start_parent("pipeline", {})
    _pipeline_stages(tracker, parent)
    root = tmp_path / "a-file"
    root.write_text("not a directory")  # nothing can be saved under it
    report = _report(parent, tracker, str(root))

    with caplog.at_level(logging.WARNING, logger="alignflow"):
        close_run(_ctx(tracker, parent, root), report)

    assert report.curves_uri is None
    assert any("learning curves not saved" in r.getMessage() for r in caplog.records)
    assert _client(tracker).get_run(parent).info.status == "FINISHED"


def test_a_run_with_nothing_to_draw_has_no_curves(tracker, tmp_path):
    parent = tracker.start_parent("pipeline", {})
    _stage(tracker, parent, "data", {}, summary={"data/rows": 8.0})
    assert publish_curves(tracker, Storage(root=str(tmp_path)), parent) is None
    assert not (tmp_path / "curves").exists()


def test_curves_are_copied_to_a_remote_root(tracker, moto_s3):
    parent = tracker.start_parent("pipeline", {})
    _pipeline_stages(tracker, parent)
    storage = Storage(root=f"s3://{moto_s3.bucket}/curves-test", endpoint_url=moto_s3.endpoint_url)

    uri = publish_curves(tracker, storage, parent)

    assert uri == f"s3://{moto_s3.bucket}/curves-test/curves/{parent}"
    fs = moto_s3.fs()
    for name in ("loss.png", "rounds.png", "eval.png"):
        assert fs.cat(f"{uri}/{name}")[:8] == PNG_SIGNATURE
