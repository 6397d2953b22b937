"""MLflow tracking: credential scrubbing, parent/child runs in a real SQLite store."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from alignflow.config import load_config
from alignflow.tracking.params import flatten_params, param_values
from alignflow.tracking.runs import Tracker


# ---- flatten_params ------------------------------------------------------------------------


def test_flatten_nested():
    out = flatten_params({"a": {"b": {"c": 1}, "d": "x"}, "e": 2.5, "f": None, "g": True})
    assert out == {"a.b.c": 1, "a.d": "x", "e": 2.5, "f": None, "g": True}


def test_flatten_lists_as_json():
    out = flatten_params({"a": [1, "two", None], "t": (1, 2), "long": list(range(1000))})
    assert out["a"] == '[1, "two", null]'
    assert json.loads(out["t"]) == [1, 2]
    assert json.loads(out["long"]) == list(range(1000))


def test_a_value_past_mlflows_limit_is_cut_and_says_so():
    values = param_values({"short": "x" * 6000, "long": list(range(2000))})
    assert values["short"] == "x" * 6000
    full = json.dumps(list(range(2000)))
    assert len(values["long"]) == 6000
    assert values["long"].endswith(f"... [cut: {len(full)} characters]")
    assert full.startswith(values["long"].split("... [cut")[0])


def test_credentials_in_urls_are_taken_out_of_lists_and_query_strings():
    tree = {"reward": {"url": "https://rm.example/score?api_key=s3cr3t&batch=4",
                       "sources": [{"source": "remote", "url": "https://bob:hunter2@rm.example/s?token=t0k"},
                                   {"source": "rule", "rule": "pkg.mod:fn"}]},
            "presigned": "https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA&X-Amz-Signature=abcd&x-id=GetObject"}
    out = flatten_params(tree)
    text = json.dumps(out)
    for secret in ("s3cr3t", "hunter2", "bob", "t0k", "AKIA", "abcd"):
        assert secret not in text
    assert out["reward.url"] == "https://rm.example/score?api_key=***&batch=4"
    assert json.loads(out["reward.sources"]) == [{"source": "remote", "url": "https://rm.example/s?token=***"},
                                                 {"source": "rule", "rule": "pkg.mod:fn"}]
    assert out["presigned"] == "https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***&x-id=GetObject"


def test_a_credential_named_key_inside_a_list_is_kept_as_a_redacted_value():
    out = flatten_params({"sources": [{"api_key": "s3cr3t", "n": 1}, {"hf_token": None}]})
    assert json.loads(out["sources"]) == [{"api_key": "***", "n": 1}, {"hf_token": None}]


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


def test_a_retried_flow_run_continues_its_parent_and_its_unfinished_stage_runs(tracker, caplog):
    """The same Prefect flow run id: the parent is reopened, a stage that failed continues its own run
    (one metric history across attempts), a finished one is not reused, and changed params are named."""
    client = _client(tracker)
    tags = {"alignflow.prefect_flow_run_id": "0b6f-flow-run", "alignflow.key.sft": "k1"}
    parent = tracker.start_parent("pipeline", {"lr": 1}, tags=tags, reopen_tag="alignflow.prefect_flow_run_id")
    with tracker.stage_run(parent, "data", {"rows": 3}, tags={"alignflow.key": "d1"}) as run:
        data_id = run.run_id
    with pytest.raises(RuntimeError):
        with tracker.stage_run(parent, "round_1", {"steps": 4}, tags={"alignflow.key": "r1"}) as run:
            run.log_metrics({"rl/loss": 2.0}, step=1)
            run.log_metrics({"rl/loss": 1.5}, step=2)
            round_id = run.run_id
            raise RuntimeError("rule raised at step 3")
    tracker.finish(parent, status="FAILED")
    other = tracker.start_parent("pipeline", {"lr": 1}, tags={**tags, "alignflow.prefect_flow_run_id": "another"},
                                 reopen_tag="alignflow.prefect_flow_run_id")
    assert other != parent

    with caplog.at_level(logging.WARNING, logger="alignflow"):
        again = tracker.start_parent("pipeline", {"lr": 2, "new": 3}, tags=tags,
                                     reopen_tag="alignflow.prefect_flow_run_id")
    assert again == parent
    p = client.get_run(parent)
    assert p.info.status == "RUNNING" and p.data.tags["alignflow.attempt"] == "2"
    assert p.data.params == {"lr": "1", "new": "3"}  # MLflow keeps a param's first value
    assert p.data.tags["alignflow.params_changed_at_attempt_2"] == "lr"
    assert "1 param(s) changed" in caplog.text
    with tracker.stage_run(parent, "data", {"rows": 3}, tags={"alignflow.key": "d1"}) as run:
        assert run.run_id != data_id  # FINISHED runs are records, not continued
    assert client.get_run(run.run_id).data.params == {"rows": "3"}  # a new run, with its params
    with tracker.stage_run(parent, "round_1", {"steps": 4}, tags={"alignflow.key": "r1"}) as run:
        assert run.run_id == round_id
        run.log_metrics({"rl/loss": 1.0}, step=3)
    with tracker.stage_run(parent, "round_1", {"steps": 4}, tags={"alignflow.key": "r2"}) as run:
        assert run.run_id != round_id  # another key is another stage run
    r = client.get_run(round_id)
    assert r.info.status == "FINISHED" and r.data.tags["alignflow.attempt"] == "2"
    assert sorted((m.step, m.value) for m in client.get_metric_history(round_id, "rl/loss")) == \
        [(1, 2.0), (2, 1.5), (3, 1.0)]
    assert tracker.metric_histories(parent)["round_1"]["rl/loss"] == [(1, 2.0), (2, 1.5), (3, 1.0)]


def test_a_stage_resumed_by_a_new_pipeline_run_takes_the_steps_before_its_checkpoint_from_the_run_it_resumes(
        tracker, tmp_path):
    """`alignflow run` after a stop: a new parent, and the stage's new run resumes from its step-4 checkpoint.
    Its curve (in the MLflow UI, and the learning curves read from it) starts at step 1, not 5."""
    from alignflow.store.artifacts import local_dir
    from alignflow.store.storage import Storage
    from tasks.checkpoints import StageCheckpoints

    storage = Storage(root=str(tmp_path / "root"))
    stage = storage.stage_uri("sft", "k")
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "step.txt").write_text("4")
    storage.commit(tmp_path / "state", storage.checkpoint_uri(stage, 4))
    client, tags = _client(tracker), {"alignflow.key": "k"}
    first = tracker.start_parent("pipeline", {}, tags={"alignflow.key.sft": "k"})
    with pytest.raises(KeyboardInterrupt):
        with tracker.stage_run(first, "sft", {}, tags=tags) as run:
            stopped = run.run_id
            for step in range(1, 6):
                run.log_metrics({"train/loss": 10.0 - step, "progress/step": step}, step=step)
            time.sleep(0.002)  # a retry in place from a checkpoint at 2 ran steps 3-5 again, later; stopped in 6
            for step in range(3, 6):
                run.log_metrics({"train/loss": 30.0 - step, "progress/step": step}, step=step)
            raise KeyboardInterrupt
    tracker.finish(first, status="KILLED")
    second = tracker.start_parent("pipeline", {}, tags={"alignflow.key.sft": "k"})
    with tracker.stage_run(second, "sft", {}, tags=tags) as run:
        run.log_metrics({"data/rows": 3.0})  # before the resume, at step 0, as a round logs its prompts' counts
        start = StageCheckpoints(storage, stage, "sft", every=2).resume(
            lambda ref: int((Path(local_dir(ref)) / "step.txt").read_text()), run, total=6)
        for step in range(start + 1, 7):
            run.log_metrics({"train/loss": 20.0 - step, "progress/step": step}, step=step)
        assert run.take_history(start) == 0  # a run with steps of its own (a retry continuing it) takes none
    assert start == 4 and run.run_id != stopped
    want = [(1, 9.0), (2, 8.0), (3, 27.0), (4, 26.0), (5, 15.0), (6, 14.0)]  # each step once, the latest
    assert sorted((m.step, m.value) for m in client.get_metric_history(run.run_id, "train/loss")) == want
    assert client.get_run(run.run_id).data.tags["alignflow.history_from"] == stopped
    assert tracker.metric_histories(second)["sft"]["train/loss"] == want
    assert [(m.step, m.value) for m in client.get_metric_history(run.run_id, "data/rows")] == [(0, 3.0)]


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


def test_an_experiment_opens_on_its_runs_and_keeps_artifacts_beside_its_sqlite_file(tmp_path, monkeypatch):
    """MLflow's `mlflow.experimentKind` tag makes the UI open a model-training experiment on its runs table;
    artifacts go beside the SQLite file, and nothing lands in the working directory (MLflow's default is
    ./mlruns there)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    store = tmp_path / "store"
    store.mkdir()
    tracker = Tracker(f"sqlite:///{store / 'mlflow.db'}", "alignflow-kind", artifact_root="s3://unused/root")
    with tracker.stage_run(None, "evaluate", {}) as run:
        run.log_text("hello", "samples/sample.txt")
    client = _client(tracker)
    exp = client.get_experiment(tracker.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert exp.artifact_location == (store / "mlflow-artifacts").as_uri()
    assert [p.name for p in (store / "mlflow-artifacts").rglob("sample.txt")] == ["sample.txt"]
    assert list(cwd.iterdir()) == []
    # An experiment made elsewhere (e.g. by `mlflow ui`) gets the tag when alignflow first uses it.
    other = client.create_experiment("made-by-someone-else")
    assert "mlflow.experimentKind" not in client.get_experiment(other).tags
    assert Tracker(tracker.tracking_uri, "made-by-someone-else").experiment_id == other
    assert client.get_experiment(other).tags["mlflow.experimentKind"] == "custom_model_development"


@pytest.mark.parametrize("uri, expected", [
    ("postgresql://db.host/mlflow", "s3://bucket/root/mlflow-artifacts"),
    ("mysql+pymysql://db.host/mlflow", "s3://bucket/root/mlflow-artifacts"),
    ("http://127.0.0.1:5000", None),  # a tracking server places artifacts itself
    ("file:///srv/mlruns", None),
])
def test_artifact_location_of_other_stores(uri, expected):
    from alignflow.tracking.params import artifact_location

    assert artifact_location(uri, "s3://bucket/root/mlflow-artifacts") == expected


# ---- how runs end: interrupts, signals, processes that died -------------------------------------


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupted_stage_is_marked_killed(tracker, interrupt):
    parent = tracker.start_parent("pipeline", {})
    with pytest.raises(interrupt):
        with tracker.stage_run(parent, "sft", {}) as run:
            run_id = run.run_id
            raise interrupt()
    ended = _client(tracker).get_run(run_id)
    assert ended.info.status == "KILLED"
    assert ended.info.end_time is not None


def test_runs_record_the_process_that_owns_them(tracker):
    parent = tracker.start_parent("pipeline", {})
    with tracker.stage_run(parent, "sft", {}) as run:
        child = run.run_id
    for run_id in (parent, child):
        tags = _client(tracker).get_run(run_id).data.tags
        assert tags["alignflow.pid"] == str(os.getpid())
        assert tags["alignflow.host"] == socket.gethostname()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_start_parent_marks_runs_of_dead_processes_on_this_host_killed(tracker, caplog):
    reaper = Tracker(tracker.tracking_uri, "alignflow-test-stale")
    client = _client(tracker)
    here, dead = socket.gethostname(), _dead_pid()

    def running(pid, host):
        tags = {"alignflow.pid": str(pid), "alignflow.host": host}
        return client.create_run(reaper.experiment_id, tags=tags).info.run_id

    orphan = running(dead, here)
    alive = running(os.getpid(), here)
    elsewhere = running(dead, "another-host-xyz")
    with caplog.at_level(logging.WARNING, logger="alignflow"):
        parent = reaper.start_parent("pipeline", {})

    assert client.get_run(orphan).info.status == "KILLED"
    assert client.get_run(orphan).data.tags["alignflow.end_reason"] == f"process {dead} on {here} died"
    assert client.get_run(alive).info.status == "RUNNING"
    assert client.get_run(elsewhere).info.status == "RUNNING"
    assert client.get_run(parent).info.status == "RUNNING"
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"marked 1 MLflow run(s) KILLED: left RUNNING by processes on {here} that are gone"]


def test_a_run_whose_pid_was_reused_is_marked_killed(tracker):
    reaper = Tracker(tracker.tracking_uri, "alignflow-test-reused-pid")
    client = _client(tracker)
    # This process is alive, but it started long after this run did: its pid was reused.
    tags = {"alignflow.pid": str(os.getpid()), "alignflow.host": socket.gethostname()}
    stale = client.create_run(reaper.experiment_id, start_time=1_000_000_000_000, tags=tags).info.run_id
    reaper.start_parent("pipeline", {})
    assert client.get_run(stale).info.status == "KILLED"


def test_a_run_reopened_by_a_process_younger_than_it_is_not_reaped(tracker):
    # A flow run retried from the Prefect UI a day later: its parent run and unfinished stage run are
    # continued by new processes. The next pipeline start must not take them for runs of dead ones.
    reaper = Tracker(tracker.tracking_uri, "alignflow-test-reopened")
    client = _client(tracker)
    day_ago = int((time.time() - 86400) * 1000)
    tags = {"alignflow.pid": str(_dead_pid()), "alignflow.host": socket.gethostname(), "prefect.flow_run": "fr-1"}
    parent = client.create_run(reaper.experiment_id, start_time=day_ago, tags=tags).info.run_id
    stage = client.create_run(reaper.experiment_id, start_time=day_ago, tags={
        **tags, "mlflow.parentRunId": parent, "alignflow.stage": "sft", "alignflow.key": "k1"}).info.run_id
    for run_id in (parent, stage):
        client.set_terminated(run_id, status="FAILED")

    assert reaper.start_parent("pipeline", {}, tags={"prefect.flow_run": "fr-1"}, reopen_tag="prefect.flow_run") == parent
    with reaper.stage_run(parent, "sft", {}, tags={"alignflow.key": "k1"}) as run:
        assert run.run_id == stage
        assert Tracker(tracker.tracking_uri, "alignflow-test-reopened").reap_stale() == []
        assert {client.get_run(r).info.status for r in (parent, stage)} == {"RUNNING"}


STAGE_SCRIPT = """
import sys, time
from alignflow.interrupts import install_sigterm_handler
from alignflow.tracking.runs import Tracker

install_sigterm_handler()
tracker = Tracker(sys.argv[1], "alignflow-test-sigterm")
with tracker.stage_run(None, "sft", {}) as run:
    print(run.run_id, flush=True)
    while True:
        time.sleep(0.05)
"""


def test_sigterm_ends_a_stage_run_killed(tracker, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}  # this checkout's alignflow
    proc = subprocess.Popen([sys.executable, "-c", STAGE_SCRIPT, tracker.tracking_uri], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run_id = proc.stdout.readline().strip()
        assert run_id, proc.communicate(timeout=60)[1]
        assert _client(tracker).get_run(run_id).info.status == "RUNNING"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 143  # SystemExit(128 + SIGTERM)
    assert _client(tracker).get_run(run_id).info.status == "KILLED"


class _Stopped:
    """A stage future whose wait ends with `exc` (what Prefect's future re-raises)."""

    def __init__(self, exc: BaseException):
        self.exc = exc

    def wait(self):
        if not isinstance(self.exc, Exception):  # an interrupt ends the wait itself
            raise self.exc

    def result(self):
        raise self.exc


class _Finishing:
    """A stage future that ends (Completed) only when waited for."""

    def __init__(self):
        self.ended = False

    def wait(self):
        self.ended = True

    def result(self):
        assert self.ended, "result() before the stage ended"
        return "done"


def test_a_failed_stage_fails_the_run_once_the_other_stages_have_ended(tracker):
    from alignflow.config import InfraConfig
    from flows.report import wait_all
    from tasks.context import RunContext

    parent = tracker.start_parent("pipeline", {})
    infra = InfraConfig(mlflow_tracking_uri=tracker.tracking_uri, mlflow_experiment="alignflow-test")
    later = _Finishing()  # planned after the failing stage, and independent of it (e.g. eval_base)
    with pytest.raises(RuntimeError, match="rule raised"):
        wait_all(RunContext(infra=infra, parent_run_id=parent),
                 {"round_1": _Stopped(RuntimeError("rule raised")), "eval_base": later})
    assert later.ended
    assert _client(tracker).get_run(parent).info.status == "FAILED"


@pytest.mark.parametrize("exc, status", [(KeyboardInterrupt(), "KILLED"), (SystemExit(143), "KILLED"),
                                         (RuntimeError("stage failed"), "FAILED")])
def test_wait_all_closes_the_parent_killed_on_an_interrupt_failed_on_an_error(tracker, exc, status):
    from alignflow.config import InfraConfig
    from flows.report import wait_all
    from tasks.context import RunContext

    parent = tracker.start_parent("pipeline", {})
    with tracker.stage_run(parent, "data", {}) as done:
        pass
    # A stage still running when the wait ends (its owner, a Ray worker, ends with the CLI's Ray).
    running = tracker.stage_run(parent, "sft", {})
    sft = running.__enter__().run_id
    infra = InfraConfig(mlflow_tracking_uri=tracker.tracking_uri, mlflow_experiment="alignflow-test")
    with pytest.raises(type(exc)):
        wait_all(RunContext(infra=infra, parent_run_id=parent), {"sft": _Stopped(exc)})
    client = _client(tracker)
    assert client.get_run(parent).info.status == status
    # Stopped: the stage is stopped with it. Failed: the other stages go on, and end their runs themselves.
    assert client.get_run(sft).info.status == ("KILLED" if status == "KILLED" else "RUNNING")
    assert client.get_run(done.run_id).info.status == "FINISHED"
    if status == "KILLED":
        assert client.get_run(sft).data.tags["alignflow.end_reason"] == "the pipeline run was stopped"
    running.__exit__(None, None, None)


def test_resume_skips_a_corrupted_checkpoint_for_the_one_before(tracker, tmp_path):
    from alignflow.store.artifacts import local_dir
    from alignflow.store.storage import Storage
    from tasks.checkpoints import StageCheckpoints

    storage = Storage(root=str(tmp_path / "root"))
    stage = storage.stage_uri("sft", "k")
    for step in (10, 20):
        (tmp_path / f"state-{step}").mkdir()
        (tmp_path / f"state-{step}" / "step.txt").write_text(str(step))
        storage.commit(tmp_path / f"state-{step}", storage.checkpoint_uri(stage, step))
    (tmp_path / "root" / "sft" / "k" / "checkpoints" / "step-00000020" / "step.txt").write_text("2O")  # same size
    with tracker.stage_run(None, "sft", {}) as run:
        step = StageCheckpoints(storage, stage, "sft", every=10).resume(
            lambda ref: int((Path(local_dir(ref)) / "step.txt").read_text()), run, total=30)
    assert step == 10
    assert _client(tracker).get_run(run.run_id).data.tags["alignflow.resumed_from_step"] == "10"


def test_a_checkpoint_whose_weights_fail_where_they_load_is_set_aside_for_the_retry(tracker, tmp_path):
    # Weights are checked by size on the task's node; the actors that load them verify their digests.
    from alignflow.store.artifacts import local_dir
    from alignflow.store.storage import CorruptArtifact, Storage
    from tasks.checkpoints import StageCheckpoints

    storage = Storage(root=str(tmp_path / "root"))
    stage = storage.stage_uri("sft", "k")
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "model.safetensors").write_bytes(b"weights!")
    uri = storage.checkpoint_uri(stage, 20)
    storage.commit(tmp_path / "state", uri)
    (Path(uri) / "model.safetensors").write_bytes(b"WEIGHTS!")  # same size: passes the task's check
    checkpoints = StageCheckpoints(storage, stage, "sft", every=10)
    load = lambda ref: len(local_dir(ref))  # noqa: E731 (an actor's load: fetch and verify everything)
    with tracker.stage_run(None, "sft", {}) as run:
        with pytest.raises(CorruptArtifact, match=r"^sft: the checkpoint .*step-00000020 failed verification where "
                                                  r"it was loaded, and is set aside .*manifest.corrupt.json"):
            checkpoints.resume(load, run, total=30)
        assert not storage.is_committed(uri) and (Path(uri) / "model.safetensors").read_bytes() == b"WEIGHTS!"
        assert checkpoints.resume(load, run, total=30) == 0  # the retry starts over

