"""MLflow tracking: credential scrubbing, parent/child runs in a real SQLite store."""

from __future__ import annotations

import json

import pytest

from alignflow.config import load_config
from alignflow.tracking import Tracker, flatten_params


# ---- flatten_params ------------------------------------------------------------------------


def test_flatten_nested():
    out = flatten_params({"a": {"b": {"c": 1}, "d": "x"}, "e": 2.5, "f": None, "g": True})
    assert out == {"a.b.c": 1, "a.d": "x", "e": 2.5, "f": None, "g": True}


def test_flatten_lists_as_json():
    out = flatten_params({"a": [1, "two", None], "t": (1, 2), "long": list(range(1000))})
    assert out["a"] == '[1, "two", null]'
    assert json.loads(out["t"]) == [1, 2]
    assert len(out["long"]) == 500


@pytest.mark.parametrize(
    "key",
    ["secret", "client_secret", "password", "db_passwd", "token", "hf_token", "api_token", "access_key",
     "aws_access_key_id", "AWS_SECRET_ACCESS_KEY", "api_key", "OPENAI_API_KEY", "credentials", "private_key",
     "Password"],
)
def test_credential_like_keys_are_dropped_at_any_depth(key):
    tree = {key: "hunter2", "storage": {key: "hunter2", "root": "s3://b/p", "deeper": {key: "hunter2", "ok": 1}}}
    out = flatten_params(tree)
    assert out == {"storage.root": "s3://b/p", "storage.deeper.ok": 1}
    assert "hunter2" not in json.dumps(out)


def test_a_credential_like_section_is_dropped_whole():
    out = flatten_params({"credentials": {"user": "u", "region": "eu"}, "x": 1})
    assert out == {"x": 1}


def test_token_counts_and_tokenizers_are_not_credentials():
    out = flatten_params({"max_new_tokens": 16, "data": {"max_prompt_tokens": 64}, "tokenizer_path": "/m"})
    assert out == {"max_new_tokens": 16, "data.max_prompt_tokens": 64, "tokenizer_path": "/m"}


def test_every_pipeline_config_field_is_logged():
    # Nothing in the pipeline config is a credential: every leaf must reach MLflow.
    tree = load_config().model_dump(mode="json")

    def leaves(t, prefix=""):
        for k, v in t.items():
            if isinstance(v, dict):
                yield from leaves(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}"

    assert set(flatten_params(tree)) == set(leaves(tree))


@pytest.mark.parametrize(
    "value, expected",
    [
        ("http://user:pw@mlflow.internal:5000/path?q=1", "http://mlflow.internal:5000/path?q=1"),
        ("postgresql://admin:s3cr3t@db.host/mlflow", "postgresql://db.host/mlflow"),
        ("s3://AKIAXXXX:abc@bucket/prefix", "s3://bucket/prefix"),
        ("https://token@github.com/org/repo", "https://github.com/org/repo"),
        ("s3://bucket/prefix", "s3://bucket/prefix"),
        ("me@example.com", "me@example.com"),  # not a URI
        ("sqlite:///mlflow.db", "sqlite:///mlflow.db"),
    ],
)
def test_userinfo_is_stripped_from_uris(value, expected):
    assert flatten_params({"uri": value, "nested": {"uri": value}}) == {"uri": expected, "nested.uri": expected}


# ---- a real MLflow SQLite store ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tracker(tmp_path_factory):
    """A Tracker on a fresh SQLite file; MLflow's process-wide settings restored afterwards."""
    import mlflow.tracking._tracking_service.utils as tracking_utils
    import mlflow.tracking.fluent as fluent

    tmp_path = tmp_path_factory.mktemp("mlflow")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tracking_utils, "_tracking_uri", tracking_utils._tracking_uri)
        mp.setattr(fluent, "_active_experiment_id", fluent._active_experiment_id)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
        mp.chdir(tmp_path)  # the default artifact location (./mlruns) stays in tmp_path
        yield Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "alignflow-test")


def _client(tracker):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracker.tracking_uri)


def test_parent_and_child_runs(tracker):
    client = _client(tracker)
    parent = tracker.start_parent("pipeline", {"name": "tiny", "infra": {"secret_key": "x", "uri": "http://u:p@h/"}},
                                  tags={"alignflow.pipeline": "tiny"})
    with tracker.stage_run(parent, "sft", {"learning_rate": 0.003, "nested": {"steps": 7}},
                           tags={"alignflow.key": "k1"}) as run:
        run.log_metrics({"train/loss": 1.5, "train/accuracy": 0.25}, step=3)
        run.log_metrics({"train/loss": 0.5}, step=4)
        run.set_tag("alignflow.resumed_from_step", "2")
        child_id = run.run_id
    tracker.finish(parent)

    p = client.get_run(parent)
    assert p.info.experiment_id == tracker.experiment_id
    assert client.get_experiment(tracker.experiment_id).name == "alignflow-test"
    assert p.data.params == {"name": "tiny", "infra.uri": "http://h/"}
    assert p.data.tags["alignflow.pipeline"] == "tiny"
    assert p.info.status == "FINISHED"

    c = client.get_run(child_id)
    assert c.data.tags["mlflow.parentRunId"] == parent
    assert c.data.tags["alignflow.stage"] == "sft"
    assert c.data.tags["alignflow.key"] == "k1"
    assert c.data.tags["alignflow.resumed_from_step"] == "2"
    assert c.info.run_name == "sft"
    assert c.data.params == {"learning_rate": "0.003", "nested.steps": "7"}
    assert c.data.metrics == {"train/loss": 0.5, "train/accuracy": 0.25}  # latest values
    history = client.get_metric_history(child_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(3, 1.5), (4, 0.5)]
    assert c.info.status == "FINISHED"

    children = client.search_runs([tracker.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent}'")
    assert [r.info.run_id for r in children] == [child_id]


def test_failing_stage_is_marked_failed(tracker):
    client = _client(tracker)
    parent = tracker.start_parent("pipeline", {})
    with pytest.raises(RuntimeError, match="boom"):
        with tracker.stage_run(parent, "reward_model", {"lr": 1}) as run:
            run.log_metrics({"x": 1.0})
            failed_id = run.run_id
            raise RuntimeError("boom")
    failed = client.get_run(failed_id)
    assert failed.info.status == "FAILED"
    assert failed.info.end_time is not None
    assert failed.data.metrics == {"x": 1.0}
    assert failed.data.tags["mlflow.parentRunId"] == parent
    tracker.finish(parent, status="FAILED")
    assert client.get_run(parent).info.status == "FAILED"


def test_stage_run_without_parent_is_top_level(tracker):
    with tracker.stage_run(None, "evaluate", {}) as run:
        run_id = run.run_id
    assert "mlflow.parentRunId" not in _client(tracker).get_run(run_id).data.tags


def test_many_params_are_logged_in_batches(tracker):
    params = {f"p{i:03d}": i for i in range(250)}  # MLflow takes at most 100 params per batch
    parent = tracker.start_parent("pipeline", params)
    logged = _client(tracker).get_run(parent).data.params
    assert logged == {k: str(v) for k, v in params.items()}


def test_log_text_and_dict_artifacts(tracker, tmp_path):
    client = _client(tracker)
    with tracker.stage_run(None, "evaluate", {}) as run:
        run.log_text("hello", "samples/sample.txt")
        run.log_dict({"a": 1}, "report.json")
        run_id = run.run_id
    names = {a.path for a in client.list_artifacts(run_id)}
    assert names == {"samples", "report.json"}
    local = client.download_artifacts(run_id, "report.json", str(tmp_path))
    assert json.loads(open(local).read()) == {"a": 1}
