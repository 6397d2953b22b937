"""Storage on a local root: atomic commit, verified fetch, content keys, mid-stage checkpoints."""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from pathlib import Path

import pytest

from alignflow.config import SFTConfig
from alignflow.store.storage import MANIFEST, Storage, StorageError
from tasks.plan import content_key

FILES = {
    "config.json": b'{"model_type": "qwen2"}',
    "model.safetensors": bytes(range(256)) * 40,
    "tokenizer/tokenizer.json": b"{}",
    "empty.txt": b"",
}


def _make_dir(path: Path, files: dict[str, bytes] = FILES) -> Path:
    for rel, data in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    return path


@pytest.fixture
def storage(tmp_path) -> Storage:
    return Storage(root=str(tmp_path / "root"))


@pytest.fixture
def src(tmp_path) -> Path:
    return _make_dir(tmp_path / "src")


class _RecordingStorage(Storage):
    """Storage whose filesystem records the order of uploads (a spy, not a fake)."""

    def _fs(self):
        fs = super()._fs()
        log = self.__dict__.setdefault("_puts", [])

        class Spy:
            def __getattr__(self, name):
                return getattr(fs, name)

            def put_file(self, lpath, rpath, **kw):
                log.append(rpath)
                return fs.put_file(lpath, rpath, **kw)

        return Spy()


# ---- commit and fetch --------------------------------------------------------------------


def test_commit_writes_files_and_manifest(storage, src):
    uri = storage.stage_uri("sft", "abc123")
    assert not storage.is_committed(uri)
    manifest = storage.commit(src, uri, meta={"stage": "sft", "step": 3})
    for rel, data in FILES.items():
        assert (Path(uri) / rel).read_bytes() == data
    on_disk = json.loads((Path(uri) / MANIFEST).read_text())
    assert on_disk == manifest
    assert on_disk["meta"] == {"stage": "sft", "step": 3}
    expected = {rel: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()} for rel, data in FILES.items()}
    assert on_disk["files"] == expected
    assert storage.is_committed(uri)
    assert storage.read_manifest(uri) == manifest


def test_manifest_is_written_last(tmp_path, src):
    storage = _RecordingStorage(root=str(tmp_path / "root"))
    uri = storage.stage_uri("sft", "k")
    storage.commit(src, uri)
    puts = storage.__dict__["_puts"]
    assert len(puts) == len(FILES) + 1
    # Locally the manifest is copied beside its final name and renamed into place.
    assert puts[-1] == f"{uri}/{MANIFEST}.partial"
    assert all(MANIFEST not in p for p in puts[:-1])
    assert (Path(uri) / MANIFEST).is_file() and not (Path(uri) / f"{MANIFEST}.partial").exists()


def test_a_truncated_partial_manifest_is_not_committed(storage, src):
    """A crash while the manifest is being written leaves only the .partial file."""
    uri = storage.stage_uri("sft", "k")
    storage.commit(src, uri)
    (Path(uri) / MANIFEST).rename(Path(uri) / f"{MANIFEST}.partial")
    (Path(uri) / f"{MANIFEST}.partial").write_text('{"files": {"a"')
    assert not storage.is_committed(uri)
    with pytest.raises(StorageError, match="not a committed artifact"):
        storage.fetch(uri)


def test_an_existing_manifest_in_the_source_is_not_uploaded_as_a_file(storage, src):
    (src / MANIFEST).write_text('{"stale": true}')
    manifest = storage.commit(src, storage.stage_uri("s", "k"))
    assert MANIFEST not in manifest["files"]
    assert "stale" not in storage.read_manifest(storage.stage_uri("s", "k"))


def test_uri_layout(storage, tmp_path):
    assert storage.stage_uri("reward_model", "k1") == str((tmp_path / "root").resolve() / "reward_model" / "k1")
    file_root = Storage(root=f"file://{tmp_path}/r2")
    assert file_root.is_local
    assert file_root.uri("a", "b") == str(tmp_path.resolve() / "r2" / "a" / "b")
    assert not Storage(root="s3://bucket/prefix").is_local
    assert Storage(root="s3://bucket/prefix/").uri("sft", "k") == "s3://bucket/prefix/sft/k"


def test_commit_refuses_an_empty_directory(storage, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(StorageError, match="no files"):
        storage.commit(tmp_path / "empty", storage.stage_uri("s", "k"))


def test_uncommitted_directory_after_a_crash(storage, src):
    # A crash mid-upload: every file is there, the manifest never was.
    uri = storage.stage_uri("sft", "crashed")
    _make_dir(Path(uri))
    assert not storage.is_committed(uri)
    with pytest.raises(StorageError, match="not a committed artifact"):
        storage.fetch(uri)
    with pytest.raises(StorageError, match="not a committed artifact"):
        storage.read_manifest(uri)


def test_fetch_verifies_a_committed_directory(storage, src):
    uri = storage.stage_uri("sft", "k")
    storage.commit(src, uri)
    local = storage.fetch(uri)
    assert local == Path(uri)
    assert (local / "model.safetensors").read_bytes() == FILES["model.safetensors"]


def test_fetch_rejects_a_tampered_file(storage, src):
    uri = storage.stage_uri("sft", "k")
    storage.commit(src, uri)
    target = Path(uri) / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[1234] ^= 0x01  # one byte, same size
    target.write_bytes(bytes(data))
    with pytest.raises(StorageError) as err:
        storage.fetch(uri)
    assert "model.safetensors (sha256 mismatch)" in str(err.value)
    assert uri in str(err.value)
    # Without verification the caller gets the directory as it is.
    assert storage.fetch(uri, verify=False) == Path(uri)


def test_fetch_rejects_a_missing_or_truncated_file(storage, src):
    uri = storage.stage_uri("sft", "k")
    storage.commit(src, uri)
    (Path(uri) / "tokenizer" / "tokenizer.json").unlink()
    with open(Path(uri) / "config.json", "ab") as f:
        f.write(b" ")
    with pytest.raises(StorageError) as err:
        storage.fetch(uri)
    assert "tokenizer/tokenizer.json (missing or wrong size)" in str(err.value)
    assert "config.json (missing or wrong size)" in str(err.value)


# ---- content keys --------------------------------------------------------------------------


def test_content_key_is_stable():
    key = content_key("sft", {"lr": 0.1, "steps": 3}, {"data": "abc"}, "1")
    assert key == content_key("sft", {"lr": 0.1, "steps": 3}, {"data": "abc"}, "1")
    assert len(key) == 20 and all(c in "0123456789abcdef" for c in key)


def test_content_key_is_this_digest():
    # Pinned: a change here silently invalidates every cache.
    blob = json.dumps({"code": "1", "config": {"a": 1}, "inputs": {"x": "k"}, "stage": "s"}, separators=(",", ":"))
    assert content_key("s", {"a": 1}, {"x": "k"}, "1") == hashlib.sha256(blob.encode()).hexdigest()[:20]


def test_content_key_ignores_dict_order():
    a = content_key("sft", {"lr": 0.1, "opt": {"b": 1, "a": 2}}, {"data": "d", "base": "b"}, "1")
    b = content_key("sft", {"opt": {"a": 2, "b": 1}, "lr": 0.1}, {"base": "b", "data": "d"}, "1")
    assert a == b


@pytest.mark.parametrize(
    "change",
    [
        {"stage": "reward_model"},
        {"config": {"lr": 0.2, "steps": 3}},
        {"config": {"lr": 0.1, "steps": 3, "extra": None}},
        {"inputs": {"data": "abd"}},
        {"inputs": {"data": "abc", "base": "x"}},
        {"code_version": "2"},
    ],
)
def test_content_key_changes_with_what_determines_the_output(change):
    base = {"stage": "sft", "config": {"lr": 0.1, "steps": 3}, "inputs": {"data": "abc"}, "code_version": "1"}
    assert content_key(**base) != content_key(**{**base, **change})


def test_content_key_of_a_pydantic_config():
    cfg = SFTConfig(learning_rate=0.01)
    assert content_key("sft", cfg, {}, "1") == content_key("sft", cfg.model_dump(mode="json"), {}, "1")
    assert content_key("sft", cfg, {}, "1") != content_key("sft", SFTConfig(learning_rate=0.02), {}, "1")


# ---- mid-stage checkpoints -----------------------------------------------------------------


def test_checkpoint_uri(storage):
    stage = storage.stage_uri("sft", "k")
    assert storage.checkpoint_uri(stage, 20) == f"{stage}/checkpoints/step-00000020"


def test_latest_checkpoint_ignores_uncommitted(storage, src):
    stage = storage.stage_uri("sft", "k")
    assert storage.committed_checkpoints(stage) == []
    for step in (5, 20, 100):
        storage.commit(src, storage.checkpoint_uri(stage, step), meta={"step": step})
    # A crash while uploading step 200: files but no manifest.
    _make_dir(Path(storage.checkpoint_uri(stage, 200)))
    # Something else in the checkpoints directory.
    (Path(stage) / "checkpoints" / "notes").mkdir()
    step, uri = storage.committed_checkpoints(stage)[0]
    assert step == 100  # the highest committed step; step 200 is not committed
    assert uri == storage.checkpoint_uri(stage, 100)
    assert storage.read_manifest(uri)["meta"] == {"step": 100}


def test_latest_checkpoint_compares_steps_as_numbers(storage, src):
    stage = storage.stage_uri("sft", "k")
    # Unpadded names (written by hand or by an older version) still order by number.
    for name in ("step-9", "step-10"):
        storage.commit(src, f"{stage}/checkpoints/{name}")
    assert storage.committed_checkpoints(stage)[0][0] == 10


def test_prune_checkpoints(storage, src):
    stage = storage.stage_uri("sft", "k")
    storage.prune_checkpoints(stage)  # nothing there: no error
    for step in (10, 20, 30, 40):
        storage.commit(src, storage.checkpoint_uri(stage, step))
    (Path(storage.checkpoint_uri(stage, 25)) / "half-written.bin").parent.mkdir()  # a save cut off: no manifest
    storage.commit(src, stage)  # the stage's own output must survive pruning
    storage.prune_checkpoints(stage, keep_step=30)
    remaining = sorted(p.name for p in (Path(stage) / "checkpoints").iterdir())
    assert remaining == ["step-00000020", "step-00000030"]  # and the committed one before, to fall back to
    assert [s for s, _ in storage.committed_checkpoints(stage)] == [30, 20]
    (Path(storage.checkpoint_uri(stage, 30)) / "manifest.json").unlink()  # 30 set aside: 20 is all there is
    storage.prune_checkpoints(stage, keep_step=50)
    assert [s for s, _ in storage.committed_checkpoints(stage)] == [20]
    storage.prune_checkpoints(stage)
    assert list((Path(stage) / "checkpoints").iterdir()) == []
    assert storage.committed_checkpoints(stage) == []
    assert storage.is_committed(stage)
    storage.fetch(stage)


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("corrupt, reason", [
    (lambda d: _flip_a_byte(d / "model.safetensors"), "model.safetensors (sha256 mismatch)"),
    (lambda d: (d / "tokenizer" / "tokenizer.json").unlink(), "tokenizer/tokenizer.json (missing or wrong size)"),
    (lambda d: (d / MANIFEST).write_text('{"files": {"config.json"'), "Expecting"),
])
def test_a_corrupted_newest_checkpoint_is_skipped_for_the_one_before(storage, src, caplog, corrupt, reason):
    stage = storage.stage_uri("sft", "k")
    for step in (10, 20):
        storage.commit(src, storage.checkpoint_uri(stage, step), meta={"step": step})
    newest = storage.checkpoint_uri(stage, 20)
    corrupt(Path(newest))
    assert storage.committed_checkpoints(stage)[0] == (20, newest)  # still committed: only fetching finds out
    with caplog.at_level(logging.WARNING, logger="alignflow"):
        found = storage.latest_valid_checkpoint(stage)
    assert found == (10, storage.checkpoint_uri(stage, 10), Path(storage.checkpoint_uri(stage, 10)))
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith(f"skipping checkpoint {newest} (step 20), it fails verification: ")
    assert reason in warning


def test_no_valid_checkpoint_when_every_one_is_corrupted(storage, src, caplog):
    stage = storage.stage_uri("sft", "k")
    assert storage.latest_valid_checkpoint(stage) is None
    for step in (10, 20):
        storage.commit(src, storage.checkpoint_uri(stage, step))
        _flip_a_byte(Path(storage.checkpoint_uri(stage, step)) / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="alignflow"):
        assert storage.latest_valid_checkpoint(stage) is None
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2


def test_commit_leaves_no_scratch_file_when_the_manifest_cannot_be_written(storage, src, tmp_path, monkeypatch):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    with pytest.raises(TypeError, match="not JSON serializable"):
        storage.commit(src, storage.stage_uri("sft", "k"), meta={"when": object()})
    assert list(scratch.iterdir()) == []
    assert not storage.is_committed(storage.stage_uri("sft", "k"))
