"""Artifacts across nodes (alignflow/store/artifacts.py): writers upload from their own node, the task commits
the manifest; readers fetch into their node's cache; over a real S3 endpoint (moto_server)."""

from __future__ import annotations

import json
import os
import pickle
import secrets
from pathlib import Path

import pytest

from alignflow.store.artifacts import WEIGHT_FILES, ArtifactRef, child, local_dir, merge_entries, writing
from alignflow.store.storage import CACHE_ENV, Storage, StorageError

FILES = {"config.json": b'{"model_type": "qwen2"}', "model.safetensors": os.urandom(4096),
         "tokenizer.json": b"{}", "adapter/adapter_model.safetensors": os.urandom(512)}


@pytest.fixture
def s3(moto_s3, tmp_path) -> Storage:
    return Storage(root=f"s3://{moto_s3.bucket}/artifacts-{secrets.token_hex(4)}",
                   endpoint_url=moto_s3.endpoint_url, cache_dir=str(tmp_path / "config-cache"))


def _write(directory: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (directory / rel).parent.mkdir(parents=True, exist_ok=True)
        (directory / rel).write_bytes(data)


def test_an_actors_upload_is_committed_by_the_task_with_the_tasks_own_files(s3, tmp_path):
    ref = ArtifactRef(s3.stage_uri("sft", "k1"), s3)
    with writing(ref) as (scratch, uploaded):
        _write(scratch, FILES)
    assert scratch.exists() is False  # the writer's scratch is gone once uploaded
    assert uploaded == {rel: {"size": len(data), "sha256": _sha(data)} for rel, data in FILES.items()}
    assert not s3.is_committed(ref.uri), "an upload alone must not look finished"

    task_dir = tmp_path / "task"
    _write(task_dir, {"metrics.json": b"{}"})
    manifest = s3.commit(task_dir, ref.uri, uploaded=uploaded)
    assert sorted(manifest["files"]) == sorted([*FILES, "metrics.json"])
    fetched = s3.fetch(ref.uri)  # verifies every file against the manifest
    assert {rel: (fetched / rel).read_bytes() for rel in FILES} == FILES


def test_a_checkpoint_of_uploads_alone_commits_and_nothing_at_all_is_refused(s3):
    uri = s3.checkpoint_uri(s3.stage_uri("rl_round_1", "k"), 4)
    with writing(ArtifactRef(uri, s3).child("actor")) as (scratch, uploaded):
        _write(scratch, {"trainer-rank0.json": b"{}"})
    s3.commit(None, uri, uploaded=merge_entries([uploaded], "actor"))
    assert s3.read_manifest(uri)["files"].keys() == {"actor/trainer-rank0.json"}
    with pytest.raises(StorageError, match="no files"):
        s3.commit(None, s3.checkpoint_uri(s3.stage_uri("rl_round_1", "k"), 8), uploaded={})


def test_one_file_from_two_writers_is_an_error(s3, tmp_path):
    entry = {"size": 1, "sha256": "0" * 64}
    with pytest.raises(RuntimeError, match="actor/model.safetensors was uploaded twice"):
        merge_entries([{"model.safetensors": entry}, {"model.safetensors": entry}], "actor")
    uri = s3.stage_uri("sft", "k2")
    with writing(ArtifactRef(uri, s3)) as (scratch, uploaded):
        _write(scratch, {"config.json": b"{}"})
    _write(tmp_path / "task", {"config.json": b"{}"})
    with pytest.raises(StorageError, match="config.json was written by an actor and by the task"):
        s3.commit(tmp_path / "task", uri, uploaded=uploaded)


def test_each_node_fetches_into_its_own_cache_and_a_task_can_leave_the_weights(s3, tmp_path, monkeypatch):
    src = tmp_path / "src"
    _write(src, FILES)
    uri = s3.stage_uri("base_model", "k3")
    s3.commit(src, uri)
    ref = ArtifactRef(uri, s3)

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "node-a"))
    tokenizer_only = Path(local_dir(ref, skip=WEIGHT_FILES))
    assert tokenizer_only.is_relative_to(tmp_path / "node-a")
    assert sorted(p.name for p in tokenizer_only.rglob("*") if p.is_file()) == ["config.json", "tokenizer.json"]

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "node-b"))
    full = Path(local_dir(ref))
    assert full.is_relative_to(tmp_path / "node-b")
    assert {p.relative_to(full).as_posix() for p in full.rglob("*") if p.is_file()} == set(FILES)
    assert not list((tmp_path / "node-a").rglob("*.safetensors"))
    assert Path(local_dir(ref)) == full  # a second fetch on the node reuses its copy

    monkeypatch.delenv(CACHE_ENV)
    assert Path(local_dir(ref)).is_relative_to(tmp_path / "config-cache")  # without the variable: cache_dir


def test_a_ref_travels_without_credentials(s3, moto_s3):
    blob = pickle.dumps(ArtifactRef(s3.stage_uri("sft", "k"), s3))
    assert moto_s3.secret_access_key.encode() not in blob
    assert moto_s3.access_key_id.encode() not in blob


def test_a_path_is_a_directory_on_this_node(tmp_path):
    assert local_dir(str(tmp_path)) == str(tmp_path)
    assert child(str(tmp_path), "actor") == str(tmp_path / "actor")
    with writing(str(tmp_path / "out")) as (directory, uploaded):
        (directory / "x.txt").write_text("x")
    assert (tmp_path / "out" / "x.txt").read_text() == "x" and uploaded == {}


def _sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()



def _checkpoint(s3: Storage, step: int, tmp_path: Path) -> ArtifactRef:
    """A committed round checkpoint as the actors write it: `actor/` and `critic/` uploaded, round.json."""
    ref = ArtifactRef(s3.checkpoint_uri(s3.stage_uri("round_1", "k"), step), s3)
    parts = []
    for name in ("actor", "critic"):
        with writing(ref.child(name)) as (scratch, uploaded):
            _write(scratch, {"model.safetensors": os.urandom(2048), "trainer-rank0.json": b"{}"})
        parts.append(merge_entries([uploaded], name))
    _write(tmp_path / f"task-{step}", {"round.json": json.dumps({"step": step}).encode()})
    s3.commit(tmp_path / f"task-{step}", ref.uri, uploaded=merge_entries(parts))
    return ref


def test_a_checkpoints_subdirectory_is_fetched_alone(s3, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "node"))
    ref = _checkpoint(s3, 4, tmp_path)
    assert ref.child("actor").target == f"{ref.uri}/actor"
    actor = Path(local_dir(ref.child("actor")))
    assert actor.name == "actor" and sorted(p.name for p in actor.iterdir()) == ["model.safetensors",
                                                                              "trainer-rank0.json"]
    assert not (actor.parent / "critic").exists() and not (actor.parent / "round.json").exists()


def test_resume_verifies_small_files_here_and_weights_by_size_where_they_load(s3, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "task-node"))
    older, newest = _checkpoint(s3, 4, tmp_path), _checkpoint(s3, 8, tmp_path)
    fs = s3._fs()
    step, uri, local = s3.latest_valid_checkpoint(s3.stage_uri("round_1", "k"), skip=WEIGHT_FILES)
    assert (step, uri) == (8, newest.uri)
    assert json.loads((local / "round.json").read_text()) == {"step": 8}
    assert not list((tmp_path / "task-node").rglob("*.safetensors")), "the task downloaded weights"

    # Same size, other bytes: passes the task's size check, fails where the actor fetches it.
    fs.pipe(f"{newest.uri}/actor/model.safetensors", os.urandom(2048))
    assert s3.latest_valid_checkpoint(s3.stage_uri("round_1", "k"), skip=WEIGHT_FILES)[0] == 8
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "actor-node"))
    with pytest.raises(StorageError, match="actor/model.safetensors"):
        local_dir(newest.child("actor"))
    # Truncated: the task skips that checkpoint for the one before it.
    fs.pipe(f"{newest.uri}/critic/model.safetensors", b"short")
    assert s3.latest_valid_checkpoint(s3.stage_uri("round_1", "k"), skip=WEIGHT_FILES)[:2] == (4, older.uri)
    assert "critic/model.safetensors" in caplog.text


def test_processes_of_one_node_download_a_shared_artifact_once(s3, tmp_path, monkeypatch):
    """Trainer ranks, scorers and engines of one node start at once: one downloads, the others wait and reuse
    its copy (a lock per copy), instead of each downloading a model-sized temporary copy."""
    import threading

    src = tmp_path / "src"
    _write(src, FILES)
    uri = s3.stage_uri("sft", "k4")
    s3.commit(src, uri)
    gets: list[str] = []
    real = s3._fs

    def counting_fs():
        fs = real()
        get_file = fs.get_file

        def counted(rpath, lpath, **kw):
            gets.append(rpath)
            return get_file(rpath, lpath, **kw)

        fs.get_file = counted
        return fs

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "node"))
    object.__setattr__(s3, "_fs", counting_fs)  # a spy on the real S3 filesystem, per Storage instance
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(local_dir(ArtifactRef(uri, s3)))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and len(results) == 4
    assert sorted(gets) == sorted(f"{uri}/{rel}" for rel in FILES), gets


def test_a_checkpoint_that_lost_a_file_on_s3_is_skipped_for_the_one_before(s3, tmp_path, monkeypatch, caplog):
    """A committed checkpoint's small file deleted from the bucket (a lifecycle rule, a cleanup): the task's
    download found no object and raised FileNotFoundError at every retry; it is a checkpoint that fails
    verification, skipped with a warning for the one before it, as on a local root."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "node"))
    older, newest = _checkpoint(s3, 4, tmp_path), _checkpoint(s3, 8, tmp_path)
    s3._fs().rm(f"{newest.uri}/round.json")
    assert s3.unstored(newest.uri) == ["round.json"] and s3.unstored(older.uri) == []
    with caplog.at_level("WARNING", logger="alignflow"):
        assert s3.latest_valid_checkpoint(s3.stage_uri("round_1", "k"), skip=WEIGHT_FILES)[:2] == (4, older.uri)
    assert "round.json (not stored)" in caplog.text
    s3._fs().rm(f"{older.uri}/critic/model.safetensors")  # a weight, checked by its stored size
    assert s3.unstored(older.uri) == ["critic/model.safetensors"]
    assert s3.latest_valid_checkpoint(s3.stage_uri("round_1", "k"), skip=WEIGHT_FILES) is None


def test_a_stage_artifact_that_lost_a_file_is_set_aside_and_run_again(s3, tmp_path):
    """Prefect's cache would answer for a committed stage whose files were lost since, and every stage that
    reads it would fail at each retry: the plan's submission sets it aside (its files kept) and runs it."""
    from flows.stage_tasks import lost_artifact

    uri = s3.stage_uri("sft", "k")
    _write(tmp_path / "sft", {"model.safetensors": os.urandom(64), "config.json": b"{}"})
    s3.commit(tmp_path / "sft", uri)
    assert not lost_artifact(s3, uri) and s3.is_committed(uri)
    s3._fs().rm(f"{uri}/config.json")
    assert lost_artifact(s3, uri) and not s3.is_committed(uri)
    assert s3._fs().exists(f"{uri}/manifest.corrupt.json") and s3._fs().exists(f"{uri}/model.safetensors")
    assert lost_artifact(s3, s3.stage_uri("sft", "never"))
