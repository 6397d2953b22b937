"""Keys follow what external inputs hold, not just their names.

A data file edited in place, a model directory whose weights change and a
rule reward whose code changes each give the stages that read them (and
everything downstream) new keys; nothing else changes. Remote objects are
keyed by what the store reports (an S3 server over HTTP here).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from alignflow.config import cache_relevant, load_config
from alignflow.store.fingerprint import Fingerprints
from alignflow.store.storage import Storage
from flows.planview import plan_states
from tasks.plan import plan_pipeline


def _rows(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    d = tmp_path / "data"
    d.mkdir()
    paths = {k: d / f"{k}.jsonl" for k in ("sft", "preference", "eval")}
    _rows(paths["sft"], [{"prompt": "1 2 3", "response": "3"}])
    _rows(paths["preference"], [{"prompt": "1 2", "chosen": "2", "rejected": "1"}])
    _rows(paths["eval"], [{"prompt": "4 5", "answer": "5"}])
    return paths


def _plan(files: dict[str, Path], tmp_path: Path, *extra: str):
    overrides = ["data.source=files", *(f"data.{k}.path={p}" for k, p in files.items()),
                 f"infra.storage.cache_dir={tmp_path / 'cache'}", *extra]
    return plan_pipeline(load_config(None, overrides))


def _keys(plan) -> dict[str, str]:
    return {n: s.key for n, s in plan.stages.items()}


def test_editing_a_data_file_in_place_reruns_data_and_downstream_only(files, tmp_path):
    before = _keys(_plan(files, tmp_path))
    _rows(files["sft"], [{"prompt": "1 2 3", "response": "2"}])  # same size, new content
    after = _plan(files, tmp_path)
    changed = {n for n in before if before[n] != after.stages[n].key}
    assert changed == set(before) - {"base_model"}
    expected = "sha256:" + hashlib.sha256(files["sft"].read_bytes()).hexdigest()
    assert after.stages["data"].input_keys["data.sft.path"] == expected


def test_plan_says_which_file_changed(files, tmp_path):
    storage = Storage(root=str(tmp_path / "artifacts"))
    stage = _plan(files, tmp_path).stages["data"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("x")
    storage.commit(out, storage.stage_uri("data", stage.key), meta={  # as tasks/context.py records it
        "config": cache_relevant(stage.config), "input_keys": stage.input_keys, "code_version": stage.code_version})
    _rows(files["eval"], [{"prompt": "4 5", "answer": "4"}])
    state = plan_states(_plan(files, tmp_path), storage)["data"]
    assert not state.cached and state.why == "input changed: data.eval.path"


def test_a_model_directory_is_keyed_by_its_files(tmp_path, files):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"a": 1}')
    (model / "model.safetensors").write_bytes(b"\x00" * 64)
    before = _keys(_plan(files, tmp_path, f"model.base={model}"))
    (model / "model.safetensors").write_bytes(b"\x01" * 64)
    after = _keys(_plan(files, tmp_path, f"model.base={model}"))
    # the data stage measures lengths with the base model's tokenizer: it and all after it rerun
    assert {n for n in before if before[n] != after[n]} == set(before)


def test_a_hub_models_revision_is_in_every_key_and_not_passed_to_a_teacher(tmp_path, files):
    """A hub id is keyed by its name (nothing is fetched to plan): pinning model.revision changes the base model's
    key and every one after it. A teacher named by hub id is a base_model stage of its own, at its own default
    revision, not the base model's."""
    teacher = 'rounds=[{}, {"algorithm": "distill", "teacher": "org/teacher", "reward": {"source": "rule"}}]'
    pinned = _plan(files, tmp_path, "model.base=org/model", "model.revision=" + "c" * 40, teacher)
    unpinned = _plan(files, tmp_path, "model.base=org/model", teacher)
    assert pinned.stages["base_model"].config.model.revision == "c" * 40
    assert {n for n, s in pinned.stages.items() if s.key != unpinned.stages[n].key} == \
        set(pinned.stages) - {"teacher_2"}
    [teacher_stage] = [s for n, s in pinned.stages.items() if s.kind == "base_model" and n != "base_model"]
    assert teacher_stage.config.model.base == "org/teacher" and teacher_stage.config.model.revision is None
    # Its own revision pins it (teacher_revision), and reruns it and what reads it.
    own = teacher.replace('"teacher": "org/teacher"', '"teacher": "org/teacher", "teacher_revision": "v1"')
    teacher_pinned = _plan(files, tmp_path, "model.base=org/model", own)
    assert teacher_pinned.stages["teacher_2"].config.model.revision == "v1"
    assert {n for n, s in teacher_pinned.stages.items() if s.key != unpinned.stages[n].key} == \
        {"teacher_2", "round_2", "eval_round_2", "evaluation"} & set(unpinned.stages)
    judged = ('rounds=[{"algorithm": "grpo", "reward": {"source": "judge", "judge": {"model": "org/judge", '
              '"revision": "' + "d" * 40 + '"}}}]')
    assert _plan(files, tmp_path, judged).stages["judge_model_1"].config.model.revision == "d" * 40


def test_a_rule_reward_is_keyed_by_its_module_source(tmp_path, files, monkeypatch):
    pkg = tmp_path / "rules"
    pkg.mkdir()
    (pkg / "my_rule.py").write_text("def score(prompt, response, answer):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(pkg))
    rounds = 'rounds=[{"algorithm": "grpo", "reward": {"source": "rule", "rule": "my_rule:score"}}]'
    before = _keys(_plan(files, tmp_path, rounds))
    (pkg / "my_rule.py").write_text("def score(prompt, response, answer):\n    return 2.0\n")
    after = _keys(_plan(files, tmp_path, rounds))
    assert {n for n in before if before[n] != after[n]} == {"round_1", "eval_round_1"}


def test_each_rule_of_a_mixed_reward_is_keyed_by_its_own_source(tmp_path, files, monkeypatch):
    pkg = tmp_path / "rules"
    pkg.mkdir()
    for name in ("rule_a", "rule_b"):
        (pkg / f"{name}.py").write_text("def score(prompt, response, answer):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(pkg))
    mix = ('[{"source": "rule", "rule": "rule_a:score", "name": "a"}, '
           '{"source": "rule", "rule": "rule_b:score", "name": "b", "weight": 0.5}]')
    rounds = f'rounds=[{{"algorithm": "grpo", "reward": {{"sources": {mix}}}}}]'
    plan = _plan(files, tmp_path, rounds)
    assert {"rounds.0.reward.sources.0.rule", "rounds.0.reward.sources.1.rule"} <= set(plan.stages["round_1"].input_keys)
    before = _keys(plan)
    (pkg / "rule_b.py").write_text("def score(prompt, response, answer):\n    return 2.0\n")  # the second rule only
    after = _keys(_plan(files, tmp_path, rounds))
    assert {n for n in before if before[n] != after[n]} == {"round_1", "eval_round_1"}


def test_unchanged_files_are_not_read_again(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text("abc")
    prints = Fingerprints(tmp_path / "cache")
    first = prints.of(str(f))
    prints.save()
    table = json.loads((tmp_path / "cache" / "fingerprints.json").read_text())
    st = f.stat()
    assert table[str(f)] == [3, st.st_mtime_ns, st.st_ino, hashlib.sha256(b"abc").hexdigest()]
    # The remembered digest answers while size, mtime and inode agree: plant a
    # different one and a fresh table returns it, without reading the file.
    table[str(f)][3] = "0" * 64
    (tmp_path / "cache" / "fingerprints.json").write_text(json.dumps(table))
    assert Fingerprints(tmp_path / "cache").of(str(f)) == "sha256:" + "0" * 64 != first
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert Fingerprints(tmp_path / "cache").of(str(f)) == first


def test_s3_objects_are_keyed_by_what_the_store_reports(moto_s3, tmp_path, monkeypatch):
    import s3fs

    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3.endpoint_url)
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": moto_s3.endpoint_url}, skip_instance_cache=True)
    uri = f"{moto_s3.bucket}/fp/sft.jsonl"
    fs.pipe(uri, b'{"prompt": "a", "response": "b"}\n')
    first = Fingerprints(tmp_path).of(f"s3://{uri}")
    assert first.startswith("remote:") and first == Fingerprints(tmp_path).of(f"s3://{uri}")
    fs.pipe(uri, b'{"prompt": "a", "response": "c"}\n')
    etag = hashlib.md5(b'{"prompt": "a", "response": "c"}\n').hexdigest()  # S3's ETag of a one-part upload
    assert Fingerprints(tmp_path).of(f"s3://{uri}") == f"remote:ETag={etag}" != first


ENV = '''
class Env:
    def __init__(self, **kwargs):
        pass

    def reset(self, sample):
        return [{"role": "user", "content": sample["prompt"]}]

    def step(self, message):
        return None, REWARD, True, {}
'''


def test_a_user_environment_and_agent_are_keyed_by_their_module_source(tmp_path, files, monkeypatch):
    pkg = tmp_path / "envs"
    pkg.mkdir()
    (pkg / "my_env.py").write_text(ENV.replace("REWARD", "1.0"))
    (pkg / "my_agent.py").write_text("def run(client, sample):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(pkg))
    env_round = ('{"algorithm": "grpo", "reward": {"source": "environment"}, '
                 '"environment": {"name": "my_env:Env"}}')
    agent_round = ('{"algorithm": "grpo", "reward": {"source": "environment"}, '
                   '"environment": {"agent": "my_agent:run"}}')
    overrides = (f"rounds=[{env_round}, {agent_round}]", 'evaluation.environment={"name": "my_env:Env"}')
    plan = _plan(files, tmp_path, *overrides)
    assert "rounds.0.environment.name" in plan.stages["round_1"].input_keys
    assert "rounds.1.environment.agent" in plan.stages["round_2"].input_keys
    before = _keys(plan)
    (pkg / "my_agent.py").write_text("def run(client, sample):\n    return 0.5\n")
    after = _keys(_plan(files, tmp_path, *overrides))
    assert {n for n in before if before[n] != after[n]} == {"round_2", "eval_round_2"}
    (pkg / "my_env.py").write_text(ENV.replace("REWARD", "2.0"))  # round 1's and every evaluation's
    last = _keys(_plan(files, tmp_path, *overrides))
    assert {n for n in after if after[n] != last[n]} == {"round_1", "round_2"} | {
        n for n in after if n.startswith("eval_") and n != "eval_reward_model"}


def test_the_eval_checker_is_keyed_by_its_module_source(tmp_path, files, monkeypatch):
    pkg = tmp_path / "checkers"
    pkg.mkdir()
    (pkg / "my_checker.py").write_text("def check(response, answer):\n    return response == answer\n")
    monkeypatch.syspath_prepend(str(pkg))
    before = _keys(_plan(files, tmp_path, "evaluation.checker=my_checker:check"))
    (pkg / "my_checker.py").write_text("def check(response, answer):\n    return answer in response\n")
    after = _keys(_plan(files, tmp_path, "evaluation.checker=my_checker:check"))
    assert {n for n in before if before[n] != after[n]} == {n for n in before if n.startswith("eval_")} - {
        "eval_reward_model"}
