"""Preflight (alignflow/preflight/): data, model, lengths, rewards, storage and Ray slots checked
before anything starts, each problem naming its field and where its value came from.

Nothing is mocked: data files, model directories and unwritable roots are real files, the
reward service is a real local HTTP server, the S3 root a real moto server over HTTP.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from alignflow.config import default_config_path, load_config, resolve_paths
from alignflow.errors import ConfigError
from alignflow.net import free_port
from alignflow.preflight import check, preflight

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
# The embedded default config as errors name it: relative to the working directory when under it.
_DEFAULT_PATH = default_config_path().absolute()
DEFAULT = str(_DEFAULT_PATH.relative_to(Path.cwd()) if _DEFAULT_PATH.is_relative_to(Path.cwd()) else _DEFAULT_PATH)


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def files(tmp_path):
    """A config file using three good data files, with a writable storage root under tmp_path."""
    sft = _jsonl(tmp_path / "sft.jsonl", [{"prompt": "1 2", "response": "2"}] * 3)
    pref = _jsonl(tmp_path / "pref.jsonl", [{"prompt": "1 2", "chosen": "2", "rejected": "1"}] * 3)
    ev = _jsonl(tmp_path / "eval.jsonl", [{"prompt": "1 2", "answer": "2"}] * 3)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"data:\n  source: files\n  sft: {{path: {sft}}}\n  preference: {{path: {pref}}}\n"
                   f"  eval: {{path: {ev}}}\nsft: {{batch_size: 2}}\nreward_model: {{batch_size: 2}}\n"
                   f"infra:\n  storage: {{root: {tmp_path / 'artifacts'}}}\n")
    return cfg


def _write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text + f"\ninfra:\n  storage: {{root: {tmp_path / 'artifacts'}}}\n")
    return path


def problems(path: Path | None, *overrides: str) -> list[str]:
    return preflight(load_config(path, list(overrides)), list(overrides), path).problems


# ---- data ---------------------------------------------------------------------------------------


def test_good_data_files_pass(files):
    assert problems(files) == []


def test_a_batch_larger_than_the_rows_a_stage_can_have_names_both(files, tmp_path):
    """A reward model's batch beyond the synthetic task's pairs, an SFT batch beyond a local file's rows: each
    raised only when its stage started (the reward model's after SFT), and was retried."""
    root = f"infra.storage.root={tmp_path / 'a'}"
    assert problems(None, root, "data.synthetic.num_preference=20") == [
        "reward_model.batch_size: 32 is more than the 20 pairs it can train on (from alignflow/configs/tiny.yaml; "
        "data.synthetic.num_preference: from the command line: "
        "data.synthetic.num_preference=20)"]
    # KTO trains on each pair's two replies as rows; the boxes task writes two SFT rows of some traces.
    assert problems(None, root, "preference={loss: kto, batch_size: 4000}") == []
    assert problems(Path(__file__).resolve().parents[2] / "configs" / "agent.yaml", root, "data.synthetic.num_sft=20",
                    "sft.batch_size=24") == []
    assert problems(files, "sft.batch_size=4") == [
        f"sft.batch_size: 4 is more than the 3 rows it can train on (from the command line: sft.batch_size=4; "
        f"data.sft.path: from {files})"]
    # A local preference file's rows bound the reward model's batch, and KTO's and a judge's at two per pair.
    assert problems(files, "reward_model.batch_size=4") == [
        f"reward_model.batch_size: 4 is more than the 3 pairs of data.preference it can train on (from the command "
        f"line: reward_model.batch_size=4; data.preference.path: from {files})"]
    assert problems(files, "preference={loss: kto, batch_size: 6}") == []
    [kto] = problems(files, "preference={loss: kto, batch_size: 8}")
    assert kto.startswith("preference.batch_size: 8 is more than the 6 rows (each pair's two replies, and the "
                          "unpaired rows) it can train on"), kto
    # Unpaired (KTO) rows are no pairs: a DPO-family or reward-model batch is bounded by the pairs alone.
    mixed = _jsonl(tmp_path / "mixed.jsonl", [{"prompt": "1 2", "chosen": "2", "rejected": "1"}] * 2 +
                   [{"prompt": "1 2", "response": "2", "ok": True}] * 5)
    src = f'data.preference={{path: {mixed}, label_key: ok}}'
    assert problems(files, src, "preference={loss: kto, batch_size: 9}") == []  # 2 x 2 + 5
    [dpo] = problems(files, src, "preference={loss: simpo, batch_size: 3}")
    assert dpo.startswith("preference.batch_size: 3 is more than the 2 pairs of data.preference"), dpo


def test_eval_rows_without_answers_fail_where_the_bundled_checker_reads_them(files, tmp_path):
    ev = _jsonl(tmp_path / "eval2.jsonl", [{"prompt": "1 2", "answer": "2"}, {"prompt": "3 4", "solution": "4"},
                                           {"prompt": "5 6", "solution": "6"}])
    [problem] = problems(files, f"data.eval.path={ev}")
    assert problem.startswith(f"data.eval.answer_key: {ev}: 2 of 3 rows have no 'answer' (rows 2, 3); "
                              "evaluation.checker (alignflow.data.synthetic:check_answer) scores every response "
                              "against its row's answer, so each of them would score as wrong: give every row an "
                              "answer (")
    assert problems(files, f"data.eval.path={ev}", "data.eval.answer_key=solution") == [
        f"data.eval.answer_key: {ev}: 1 of 3 rows have no 'solution' (rows 1); evaluation.checker "
        "(alignflow.data.synthetic:check_answer) scores every response against its row's answer, so each of them "
        "would score as wrong: give every row an answer (from the command line: data.eval.answer_key=solution; "
        f"evaluation.checker: the default, not set in {files})"]


def test_rule_rewards_need_answers_on_the_rl_prompts(files, tmp_path, monkeypatch):
    (tmp_path / "my_rules.py").write_text("def score(prompt, response, answer):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rule = 'rounds=[{"algorithm": "grpo", "reward": {"source": "rule"}}]'
    [problem] = problems(files, rule)  # no data.prompts: the SFT prompts, without answers
    assert problem.startswith("data.prompts: no data.prompts is given, so the RL prompts are the SFT prompts, "
                              "without answers; rounds.0.reward.rule (alignflow.data.synthetic:rule_reward) scores "
                              "every response against its row's answer")
    prompts = _jsonl(tmp_path / "prompts.jsonl", [{"prompt": "1 2", "answer": "2"}])
    assert problems(files, rule, f"data.prompts.path={prompts}") == []
    found = preflight(load_config(files, [rule.replace('"rule"}', '"rule", "rule": "my_rules:score"}')]),
                      [rule], files)
    assert found.problems == [] and _besides_checker(found.notes) == [
        "data.prompts: no data.prompts is given, so the RL prompts are the SFT prompts, without answers; "
        "rounds.0.reward.rule (my_rules:score) gets answer=None for them"]


def test_answers_the_math_rule_cannot_read_fail_naming_their_rows(files, tmp_path):
    """GSM8K's answer column is the worked solution ending in '#### 72': math_equal reads no number in it, and
    every response to such a row would score 0. All of them: a problem; some (an interval): a note."""
    gsm = [{"prompt": "p1", "answer": "She sells 16 - 3 - 4 = 9 eggs. #### 9"}, {"prompt": "p2", "answer": "#### 72"}]
    prompts = _jsonl(tmp_path / "gsm.jsonl", gsm)
    rule = 'rounds=[{"algorithm": "grpo", "reward": {"source": "rule", "rule": "alignflow.rewards:math_equal"}}]'
    [problem] = problems(files, rule, f"data.prompts.path={prompts}")
    assert problem.startswith(
        f"data.prompts.answer_key: {prompts}: 2 of the first 2 rows have an answer that rounds.0.reward.rule "
        "(alignflow.rewards:math_equal) cannot read as a number or expression (row 1: 'She sells 16 - 3 - 4 = 9 "
        "eggs. #### 9'; row 2: '#### 72'), so every response to them would score 0"), problem
    mixed = _jsonl(tmp_path / "mixed.jsonl", [{"prompt": "p0", "answer": "3/4"}, *gsm,
                                              {"prompt": "p3", "answer": "\\frac{1}{2}"}])
    found = preflight(load_config(files, [rule, f"data.prompts.path={mixed}"]), [rule], files)
    assert found.problems == [] and [n for n in _besides_checker(found.notes) if "math" in n] == [
        f"data.prompts.answer_key: {mixed}: 2 of the first 4 rows have an answer that rounds.0.reward.rule "
        "(alignflow.rewards:math_equal) cannot read as a number or expression (row 2: 'She sells 16 - 3 - 4 = 9 "
        "eggs. #### 9'; row 3: '#### 72'), so every response to them would score 0: give the final answer alone "
        "(GSM8K's is what follows '####')"]
    # The synthetic task's own rule reads any answer: not checked.
    assert problems(files, rule.replace(', "rule": "alignflow.rewards:math_equal"', ""),
                    f"data.prompts.path={prompts}") == []


def test_missing_data_path_names_the_field_and_the_command_line(files, tmp_path):
    missing = tmp_path / "nope" / "sft.jsonl"
    assert problems(files, f"data.sft.path={missing}") == [
        f"data.sft.path: {missing} does not exist (from the command line: data.sft.path={missing})"]


def test_a_data_path_of_no_file_format_is_a_datasets_name_unless_it_is_plainly_a_file(files, tmp_path):
    """A path not ending .jsonl/.json/.parquet was taken for a `datasets` name and never checked: a typo or a CSV
    failed in the data stage, after Prefect and Ray started. An existing file, or an absolute, relative or
    remote path, fails now; a name is a note. The ending is read in any case (a .JSONL file is JSONL)."""
    csv = tmp_path / "sft.csv"
    csv.write_text("prompt,response\n1 2,2\n")
    assert problems(files, f"data.sft.path={csv}") == [
        f"data.sft.path: {csv} is a file of none of the formats alignflow reads (.jsonl, .json, .parquet, any "
        f"case) (from the command line: data.sft.path={csv})"]
    for path in (f"{tmp_path}/nope.csv", "./data/sft.txt", "s3://bucket/sft.csv"):
        [problem] = problems(files, f"data.sft.path={path}")
        assert problem.startswith(f"data.sft.path: {path}: alignflow reads .jsonl, .json, .parquet files (any "
                                  "case) and datasets names, and this path is neither"), problem
    found = preflight(load_config(files, ["data.sft.path=org/sft-set"]), ["data.sft.path=org/sft-set"], files)
    assert found.problems == [] and "data.sft.path: 'org/sft-set' is no .jsonl, .json, .parquet file, so the data " \
        "stage loads it with datasets.load_dataset" in " ".join(found.notes)
    (tmp_path / "parts").mkdir()  # a directory of data files is datasets' to load: a note, not a problem
    found = preflight(load_config(files, [f"data.sft.path={tmp_path / 'parts'}"]), [], files)
    assert found.problems == [] and f"data.sft.path: {tmp_path / 'parts'} is a directory" in " ".join(found.notes)
    upper = _jsonl(tmp_path / "SFT.JSONL", [{"prompt": "1 2", "response": "2"}, "{not json"])
    assert problems(files, f"data.sft.path={upper}")[0].startswith(f"data.sft: {upper}, row 2: not valid JSON")


def test_missing_data_path_from_the_file_names_the_file(tmp_path):
    missing = tmp_path / "gone.jsonl"
    cfg = _write_config(tmp_path, f"data:\n  source: files\n  sft: {{path: {missing}}}\n"
                                  f"  preference: {{path: {missing}}}\n  eval: {{path: {missing}}}")
    assert problems(cfg) == [f"data.{name}.path: {missing} does not exist (from {cfg})"
                             for name in ("sft", "preference", "eval")]


def test_a_malformed_first_row_names_file_and_row(files, tmp_path):
    bad = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "1 2", "response": "2"}, "{not json"])
    assert problems(files, f"data.sft.path={bad}") == [
        f"data.sft: {bad}, row 2: not valid JSON (Expecting property name enclosed in double quotes) "
        f"(from {files} and the command line: data.sft.path={bad})"]
    keyless = _jsonl(tmp_path / "keyless.jsonl", [{"prompt": "1 2", "output": "2"}])
    assert problems(files, f"data.sft.path={keyless}") == [
        f"data.sft: {keyless}, row 1: missing key 'response' (or set response_key under data.sft); "
        f"this row has keys: ['output', 'prompt'] (from {files} and the command line: data.sft.path={keyless})"]


def test_bad_rows_deep_in_local_files_are_all_found_before_anything_starts(files, tmp_path):
    """Every row of a local file is parsed: a preference row 9 without `chosen` and an SFT row 17 without
    `prompt` are both named, with file, row and key."""
    pairs = [{"prompt": f"{i} 2", "chosen": "2", "rejected": "1"} for i in range(20)]
    del pairs[8]["chosen"]
    sft = [{"prompt": f"{i} 2", "response": "2"} for i in range(30)]
    del sft[16]["prompt"]
    pref_path, sft_path = _jsonl(tmp_path / "pairs.jsonl", pairs), _jsonl(tmp_path / "demos.jsonl", sft)
    found = problems(files, f"data.preference.path={pref_path}", f"data.sft.path={sft_path}")
    assert len(found) == 2, found
    assert found[0].startswith(f"data.sft: {sft_path}, row 17: missing key 'prompt'"), found
    assert found[1].startswith(f"data.preference: {pref_path}, row 9: missing key 'chosen'"), found


def test_many_bad_rows_are_listed_up_to_ten_and_the_rest_counted(files, tmp_path):
    from alignflow.data.checks import MAX_BAD_ROWS

    rows = [{"prompt": f"{i} 2"} for i in range(MAX_BAD_ROWS + 7)] + [{"prompt": "x", "response": "y"}]
    bad = _jsonl(tmp_path / "bad.jsonl", rows)
    found = problems(files, f"data.sft.path={bad}")
    assert [f.split(":")[1].strip() for f in found[:MAX_BAD_ROWS]] == [f"{bad}, row {i}" for i in range(1, 11)]
    assert found[MAX_BAD_ROWS].startswith(f"data.sft: {bad}: 7 more bad rows (of {len(rows)} read)"), found
    assert len(found) == MAX_BAD_ROWS + 1


def test_a_remote_file_is_checked_up_to_the_budget_and_says_so(files, tmp_path, moto_s3, monkeypatch):
    """Rows past `data.preflight_rows` of a remote file are left to the data stage, and the notes say so."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3.endpoint_url)  # data files are read as fsspec reads URLs
    rows = [{"prompt": f"{i} 2", "response": "2"} for i in range(12)]
    del rows[10]["response"]  # row 11
    uri = f"s3://{moto_s3.bucket}/preflight-data/sft.jsonl"
    with moto_s3.fs().open(uri, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    args = [f"data.sft.path={uri}"]
    within = preflight(load_config(files, [*args, "data.preflight_rows=10"]), args, files)
    assert within.problems == []
    assert _besides_checker(within.notes) == [f"data.sft: {uri} is remote, so its first 10 rows were checked (data.preflight_rows); "
                            "the data stage checks the rest"]
    whole = preflight(load_config(files, [*args, "data.preflight_rows=100"]), args, files)
    assert [p.split(": missing")[0] for p in whole.problems] == [f"data.sft: {uri}, row 11"]
    assert _besides_checker(whole.notes) == []


# ---- the base model and lengths -------------------------------------------------------------------


def test_a_missing_model_directory_says_so_not_a_hub_error(tmp_path):
    missing = tmp_path / "my-model"
    assert problems(None, f"model.base={missing}", f"infra.storage.root={tmp_path}") == [
        f"model.base: {missing} does not exist (a local model directory, or a hub id where a hub is reachable) "
        f"(from the command line: model.base={missing})"]


def test_dft_on_a_freshly_built_tiny_model_is_refused_before_anything_starts(tmp_path):
    """Measured: the default pipeline's SFT with objective dft stayed at accuracy 0 (its weights are p, about
    1 / vocabulary at the start)."""
    [problem] = problems(None, "sft.objective=dft", f"infra.storage.root={tmp_path}")
    assert problem.startswith("sft.objective: dft weighs each token's loss by its probability, about 1 / vocabulary "
                              "on the freshly built model of model.base tiny")
    assert problem.endswith("(from the command line: sft.objective=dft; model.base: from alignflow/configs/tiny.yaml)")
    assert problems(None, "sft.objective=nll", f"infra.storage.root={tmp_path}") == []


def test_a_missing_teacher_is_named_with_its_round(tmp_path):
    missing = tmp_path / "teacher"
    rounds = f'rounds=[{{}}, {{"algorithm": "distill", "teacher": "{missing}", "reward": {{"source": "rule"}}}}]'
    [problem] = problems(None, rounds, f"infra.storage.root={tmp_path}")
    assert problem.startswith(f"rounds.1.teacher: {missing} does not exist (a local model directory, or a hub id "
                              f"where a hub is reachable) (from the command line: rounds=[")


def test_a_missing_offline_distillation_teacher_is_named(tmp_path):
    missing = tmp_path / "teacher"
    [problem] = problems(None, f'distill={{"teacher": "{missing}"}}', f"infra.storage.root={tmp_path}")
    assert problem.startswith(f"distill.teacher: {missing} does not exist (a local model directory")


def test_a_missing_judge_is_named_with_its_round(tmp_path):
    missing = tmp_path / "judge"
    rounds = f'rounds=[{{"algorithm": "grpo", "reward": {{"source": "judge", "judge": {{"model": "{missing}"}}}}}}]'
    [problem] = problems(None, rounds, f"infra.storage.root={tmp_path}")
    assert problem.startswith(f"rounds.0.reward.judge.model: {missing} does not exist (a local model directory")


def test_a_judge_engine_longer_than_its_model_is_named_before_anything_starts(tmp_path):
    """reward.judge.generation.max_model_len against the judge's positions: the pipeline's judge (trained from
    the tiny base model: 128) and a judge directory of the user's (64 positions), each named by its round."""
    from alignflow.config import TinyModelConfig
    from engines.models import build_tiny_model

    judge_dir = build_tiny_model(TinyModelConfig(max_position_embeddings=64), seed=0, out_dir=tmp_path / "judge")
    rounds = [{"algorithm": "grpo", "reward": {"source": "judge", "judge": {"generation": {"max_model_len": 129}}}},
              {"algorithm": "grpo", "reward": {"source": "judge", "judge": {
                  "model": str(judge_dir), "generation": {"max_model_len": 65}}}},
              {"algorithm": "grpo", "reward": {"source": "judge", "judge": {"generation": {"max_model_len": 128}}}}]
    found = problems(None, "judge={}", f"rounds={json.dumps(rounds)}", f"infra.storage.root={tmp_path}")
    assert [p.split(" (from the command line: rounds=[")[0] for p in found] == [
        "rounds.0.reward.judge.generation.max_model_len: 129 positions, more than the judge model's 128",
        "rounds.1.reward.judge.generation.max_model_len: 65 positions, more than the judge model's 64"], found


def test_agent_config_problems_are_each_named_with_their_field_before_anything_starts(tmp_path):
    """A wrong environment path (a round's and the evaluation's), an environment whose tool has no schema, a
    wrong agent path, and max_turns < 1 (refused when the config loads)."""
    env_file = tmp_path / "user_envs.py"
    env_file.write_text("from alignflow.agents import ToolEnvironment\n\n\ndef f(x):\n    return x\n\n\n"
                        "class NoSchema(ToolEnvironment):\n    tools = [f]\n")
    sys.path.insert(0, str(tmp_path))
    try:
        rounds = ('rounds=[{"algorithm": "grpo", "reward": {"source": "environment"}, "environment": {"name": '
                  '"no_such_module:Env"}}, {"algorithm": "grpo", "reward": {"source": "environment"}, '
                  '"environment": {"name": "user_envs:NoSchema"}}, {"algorithm": "grpo", "reward": {"source": '
                  '"environment"}, "environment": {"agent": "user_envs:no_agent"}}]')
        found = problems(_write_config(tmp_path, "name: agent"), rounds, "evaluation.environment.name=boxes_typo",
                         "model.tiny.max_position_embeddings=512")  # episodes of the default 256 tokens fit
    finally:
        sys.path.remove(str(tmp_path))
    assert found[0].startswith("rounds.0.environment.name: cannot import 'no_such_module:Env'")
    assert found[1].startswith("rounds.1.environment.name: user_envs:NoSchema's tools hold <function f")
    assert "not a Tool with a schema" in found[1]
    assert found[2].startswith("rounds.2.environment.agent: 'user_envs:no_agent' cannot be imported: AttributeError")
    assert found[3].startswith("evaluation.environment.name: 'boxes_typo' is neither a bundled environment (boxes) "
                               "nor module:Class (from the command line: evaluation.environment.name=boxes_typo)")
    assert len(found) == 4, found
    with pytest.raises(ConfigError, match="give name .* or agent .*, one of them"):
        load_config(None, ['rounds=[{"environment": {"name": "boxes", "agent": "m:f"}}]'])
    with pytest.raises(ConfigError, match=r"rounds\.0\.environment: .*kwargs are the environment class's"):
        load_config(None, ['rounds=[{"environment": {"agent": "m:f", "kwargs": {"k": 1}}}]'])
    with pytest.raises(ConfigError, match=r"rounds\.0\.environment\.max_turns[\s\S]*must be at least 1"):
        load_config(None, ['rounds=[{"environment": {"name": "boxes", "max_turns": 0}}]'])
    with pytest.raises(ConfigError, match="reward.source environment rewards episodes' returns: give the round"):
        load_config(None, ['rounds=[{"reward": {"source": "environment"}}]'])


def test_a_model_directory_without_config_json(tmp_path):
    (tmp_path / "m").mkdir()
    assert problems(None, f"model.base={tmp_path / 'm'}", f"infra.storage.root={tmp_path}") == [
        f"model.base: {tmp_path / 'm'} holds no config.json (not a transformers model directory) "
        f"(from the command line: model.base={tmp_path / 'm'})"]


def test_lengths_beyond_the_tiny_models_positions_name_the_round(tmp_path):
    cfg = _write_config(tmp_path, "rounds:\n  - {generation: {max_new_tokens: 40}}\n  - {}")
    assert problems(cfg, "data.max_prompt_tokens=100") == [
        f"rounds.0.generation.max_new_tokens: 40 new tokens after prompts of up to data.max_prompt_tokens=100 "
        f"need 140 positions; the model has 128 (model.tiny.max_position_embeddings) (from {cfg}; "
        f"data.max_prompt_tokens: from the command line: data.max_prompt_tokens=100)"]
    assert problems(cfg, "data.max_prompt_tokens=64", "data.max_response_tokens=65") == [
        "data.max_response_tokens: data.max_prompt_tokens=64 + data.max_response_tokens=65 = 129 exceed the "
        "positions: the model has 128 (model.tiny.max_position_embeddings) (from the command line: "
        "data.max_response_tokens=65; data.max_prompt_tokens: from the command line: data.max_prompt_tokens=64)"]


def test_an_episode_longer_than_the_models_positions_names_its_environment(tmp_path):
    """In an environment, what follows the prompt is an episode (its turns and observations), up to
    environment.max_episode_tokens: that, not a turn's max_new_tokens, must leave the prompt a position."""
    env = "{name: boxes, max_turns: 3, max_episode_tokens: %d}"
    cfg = _write_config(tmp_path, f"rounds:\n  - {{algorithm: grpo, reward: {{source: environment}}, "
                                  f"environment: {env % 200}}}\nevaluation: {{environment: {env % 96}}}")
    assert problems(cfg) == [
        "rounds.0.environment.max_episode_tokens: 200 new tokens leave no position for a prompt: the model has 128 "
        f"(model.tiny.max_position_embeddings) (from {cfg})"]
    assert problems(cfg, "rounds.0.environment.max_episode_tokens=96") == []


def test_lora_targets_are_matched_against_the_models_layers_before_anything_runs(tmp_path):
    """A typo in a round's actor targets, the score head named for a critic (it trains in full), and the tied
    output layer for SFT: each named with its field, from the base model built on the meta device; round 1's
    critic is unchecked (GRPO has none), and all-linear needs no check."""
    cfg = _write_config(tmp_path, "model: {tiny: {tie_word_embeddings: true}}\nsft: {lora: {target_modules: "
                                  "[lm_head]}}\nrounds:\n  - {algorithm: ppo, actor: {lora: {target_modules: [q_projj]}},"
                                  " critic: {lora: {target_modules: [score]}}}\n  - {algorithm: grpo, critic: {lora: "
                                  "{target_modules: [nothing]}}, actor: {lora: {rank: 4}}}")
    layers = "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj (or all-linear)"
    assert problems(cfg) == [
        "sft.lora.target_modules: 'lm_head' matches the output layer lm_head, whose weight is the input embeddings' "
        f"(tie_word_embeddings): merged, it would no longer be theirs; the model's linear layers: {layers} "
        f"(from {cfg})",
        f"rounds.0.actor.lora.target_modules: 'q_projj' matches no module of the model; the model's linear layers: "
        f"{layers} (from {cfg})",
        f"rounds.0.critic.lora.target_modules: 'score' is the score head, which trains in full; the model's linear "
        f"layers: {layers} (from {cfg})"]
    assert problems(cfg, "model.tiny.tie_word_embeddings=false", "sft.lora.target_modules=[q_proj, lm_head]",
                    "rounds.0.actor.lora.target_modules=[q_proj]", "rounds.0.critic.lora.target_modules=[v_proj]") == []


def test_lengths_from_a_local_models_config_json(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 64}))
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]"))).save_pretrained(model)
    args = (f"model.base={model}", f"infra.storage.root={tmp_path / 'a'}", "evaluation.generation.max_new_tokens=70")
    assert problems(None, *args) == [
        "evaluation.generation.max_new_tokens: 70 new tokens leave no position for a prompt: the model has 64 "
        "(model.base config.json) (from the command line: evaluation.generation.max_new_tokens=70)"]


# ---- rewards ---------------------------------------------------------------------------------------


def test_a_rule_that_does_not_import_names_the_round(tmp_path):
    cfg = _write_config(tmp_path, "rounds:\n  - {algorithm: grpo, reward: {source: rule, rule: 'no_such_mod_xq:score'}}")
    assert problems(cfg, "evaluation.checker=json:decoder") == [
        f"rounds.0.reward.rule: 'no_such_mod_xq:score' cannot be imported: ModuleNotFoundError: No module named "
        f"'no_such_mod_xq' (from {cfg})",
        "evaluation.checker: 'json:decoder' is not callable (from the command line: evaluation.checker=json:decoder)"]


def test_a_rule_or_checker_of_other_arguments_is_named_with_its_signature(tmp_path):
    """The math rule (prompt, response, answer) named as the checker (called with response, answer), and the
    exact-match checker named as a rule: each would raise its TypeError only after generation."""
    cfg = _write_config(tmp_path, "rounds:\n  - {algorithm: grpo, reward: {source: rule, "
                                  "rule: 'alignflow.data.synthetic:check_answer'}}")
    assert problems(cfg, "evaluation.checker=alignflow.rewards:math_equal") == [
        "rounds.0.reward.rule: 'alignflow.data.synthetic:check_answer' is called as f(prompt, response, answer), "
        "but takes (response, answer): too many positional arguments "
        f"(from {cfg})",
        "evaluation.checker: 'alignflow.rewards:math_equal' is called as f(response, answer), but takes "
        "(prompt, response, answer): missing a required argument: 'answer' (from the command line: evaluation.checker=alignflow.rewards:math_equal)"]
    assert problems(cfg, "rounds.0.reward.rule=alignflow.rewards:math_equal") == []


def test_a_rule_of_a_mix_that_does_not_import_names_its_component(tmp_path):
    cfg = _write_config(tmp_path, "rounds:\n  - {algorithm: grpo, reward: {sources: [{source: rule}, "
                                  "{source: rule, name: extra, rule: 'no_such_mod_xq:score'}]}}")
    assert problems(cfg) == [
        f"rounds.0.reward.sources.1.rule: 'no_such_mod_xq:score' cannot be imported: ModuleNotFoundError: No module "
        f"named 'no_such_mod_xq' (from {cfg})"]


class RewardService:
    """A real HTTP reward service on 127.0.0.1 answering {"rewards": [...]}, or hanging."""

    def __init__(self, hang_s: float = 0.0):
        self.requests: list[dict] = []
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                service.requests.append(body)
                time.sleep(hang_s)
                payload = json.dumps({"rewards": [0.5] * len(body["responses"])}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/score"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _remote_round(tmp_path: Path, url: str, timeout_s: float = 30) -> Path:
    return _write_config(tmp_path, f"rounds:\n  - {{algorithm: grpo, reward: {{source: remote, url: '{url}', "
                                   f"timeout_s: {timeout_s}}}}}")


def test_a_reward_url_where_nothing_listens_fails_fast_naming_the_url_field(tmp_path):
    url = f"http://127.0.0.1:{free_port()}/score"
    cfg = _remote_round(tmp_path, url)
    t0 = time.monotonic()
    found = problems(cfg)
    assert time.monotonic() - t0 < 5
    assert found == [f"rounds.0.reward.url: {url} did not answer a test request (timeout 10 s): "
                     f"[Errno 111] Connection refused (from {cfg})"]


def test_a_reward_url_that_fails_is_named_without_its_credentials(tmp_path, monkeypatch):
    """A reward URL's `${NAME}`s are filled in for the test request, and the finding shows neither them nor their
    values; a name the environment does not set is a finding of its own, before any request."""
    url = f"http://127.0.0.1:{free_port()}/score"
    monkeypatch.setenv("RM_API_KEY", "s3cr3t")
    found = problems(_remote_round(tmp_path, url + "?api_key=${RM_API_KEY}"))
    assert len(found) == 1 and "s3cr3t" not in found[0]
    assert found[0].startswith(f"rounds.0.reward.url: {url}?api_key=*** did not answer a test request")
    monkeypatch.delenv("RM_API_KEY")
    found = problems(_remote_round(tmp_path, url + "?api_key=${RM_API_KEY}"))
    assert found[0].startswith(f"rounds.0.reward.url: {url}?api_key=*** names RM_API_KEY, which the environment "
                               "of this process does not set")


def test_a_reward_service_that_answers_passes(tmp_path):
    service = RewardService()
    try:
        assert problems(_remote_round(tmp_path, service.url)) == []
    finally:
        service.close()
    assert service.requests == [{"prompts": ["preflight"], "responses": ["preflight"], "answers": [None]}]


def test_a_reward_service_that_hangs_times_out_at_the_rounds_timeout(tmp_path):
    service = RewardService(hang_s=3.0)
    try:
        cfg = _remote_round(tmp_path, service.url, timeout_s=0.5)
        t0 = time.monotonic()
        found = problems(cfg)
        assert time.monotonic() - t0 < 2.5
    finally:
        service.close()
    assert found == [f"rounds.0.reward.url: {service.url} did not answer a test request (timeout 0.5 s): timed out "
                     f"(from {cfg})"]


# ---- storage ------------------------------------------------------------------------------------------


def test_an_unwritable_storage_root_names_the_field(tmp_path):
    # A path under a regular file: unwritable even for root (where chmod stops nothing).
    (tmp_path / "file").write_text("x")
    root = tmp_path / "file" / "artifacts"
    assert problems(None, f"infra.storage.root={root}") == [
        f"infra.storage.root: {root} is not writable: Not a directory (from the command line: "
        f"infra.storage.root={root})"]


def test_a_writable_storage_root_is_left_as_it_was(tmp_path):
    assert problems(None, f"infra.storage.root={tmp_path / 'new' / 'deeper'}") == []
    assert list(tmp_path.iterdir()) == []  # the probe, and the directories it made, are gone


def test_a_sqlite_tracking_file_that_cannot_be_made_names_the_field(tmp_path):
    (tmp_path / "file").write_text("x")
    uri = f"sqlite:///{tmp_path / 'file' / 'runs' / 'mlflow.db'}"  # its directory under a regular file
    root = f"infra.storage.root={tmp_path / 'artifacts'}"
    assert problems(None, root, f"infra.mlflow_tracking_uri={uri}") == [
        f"infra.mlflow_tracking_uri: {uri}: its directory {tmp_path / 'file' / 'runs'} is not writable: Not a "
        f"directory (from the command line: infra.mlflow_tracking_uri={uri})"]
    (tmp_path / "dir.db").mkdir()
    uri = f"sqlite:///{tmp_path / 'dir.db'}"
    assert problems(None, root, f"infra.mlflow_tracking_uri={uri}") == [
        f"infra.mlflow_tracking_uri: {uri}: {tmp_path / 'dir.db'} is not a writable file (from the command line: "
        f"infra.mlflow_tracking_uri={uri})"]
    # A new file's directory, made for the probe, is gone again; a server is not probed here.
    uri = f"sqlite:///{tmp_path / 'new' / 'mlflow.db'}"
    assert problems(None, root, f"infra.mlflow_tracking_uri={uri}") == []
    assert problems(None, root, "infra.mlflow_tracking_uri=http://127.0.0.1:9") == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.db", "file"]


def test_s3_storage_root_takes_a_probe_object(moto_s3):
    root = f"s3://{moto_s3.bucket}/preflight-probe"
    assert problems(None, f"infra.storage.root={root}", f"infra.storage.endpoint_url={moto_s3.endpoint_url}") == []
    assert moto_s3.fs().find(root) == []  # the probe object is deleted
    missing = "s3://no-such-bucket-preflight/x"
    (found,) = problems(None, f"infra.storage.root={missing}", f"infra.storage.endpoint_url={moto_s3.endpoint_url}")
    assert found.startswith(f"infra.storage.root: {missing} does not take a probe object: ")
    assert found.endswith(f"(from the command line: infra.storage.root={missing})")


# ---- Ray resources -------------------------------------------------------------------------------------


def test_too_many_cpus_asked_names_the_round(tmp_path):
    cfg = _write_config(tmp_path, "rounds:\n  - {actor: {num_workers: 16}}")
    assert problems(cfg) == [
        "rounds.0: its actors need 20 CPU slots at once (actors x CPUs: actor 16x1, scorer_placement 1x1, generation 1x1, "
        "critic 1x1; the run's evaluation engine host 1x1); the local Ray gets 16 (infra.ray_num_cpus): lower the "
        f"placements or counts, or raise infra.ray_num_cpus (from {cfg}; infra.ray_num_cpus: the default, not set in {cfg})"]
    assert problems(cfg, "infra.ray_num_cpus=20") == []
    # Without the host (each evaluation's engine in a process of its own) the round alone needs 19.
    assert problems(cfg, "infra.ray_num_cpus=19") != [] and problems(
        cfg, "infra.ray_num_cpus=19", "evaluation.engine_lifetime=stage") == []
    assert problems(cfg, "infra.ray_address=ray://cluster:10001") == []  # a cluster's own slots: checked there
    assert problems(None, f"infra.storage.root={tmp_path / 'a'}", "sft.num_workers=4", "sft.placement.num_cpus=5") == [
        "sft: its actors need 21 CPU slots at once (sft.num_workers=4 x sft.placement.num_cpus=5; the run's evaluation "
        "engine host 1x1); the local Ray gets 16 "
        f"(infra.ray_num_cpus): lower the placements or counts, or raise infra.ray_num_cpus (from {DEFAULT} and the "
        f"command line: sft.num_workers=4 sft.placement.num_cpus=5; infra.ray_num_cpus: the default, not set in "
        f"{DEFAULT})"]


def test_round_slots_equal_the_engines_count(tmp_path):
    """preflight sums a round's slots without importing engines/rl/round_placement.py (torch, Ray: ~10 s)."""
    from alignflow.preflight.slots import _round_needs
    from engines.rl.round_placement import round_resources

    rounds = [{}, {"algorithm": "grpo", "reward": {"source": "rule"}},
              {"colocate_reference_and_reward": False, "num_rollout_engines": 3, "scorer_placement": {"num_cpus": 2}},
              {"algorithm": "ppo", "colocate_all": True, "num_rollout_engines": 2,
               "actor": {"num_workers": 2, "placement": {"num_gpus": 1, "num_cpus": 2}}, "critic": {"num_workers": 2},
               "generation": {"vllm": {"gpu_memory_utilization": 0.3}}},
              {"algorithm": "rloo", "generation": {"vllm": {"tensor_parallel_size": 2}, "placement": {"num_gpus": 1}}},
              # online DPO reads its reference whatever the KL settings; GRPO without a KL term starts none
              {"algorithm": "online_dpo", "generation": {"num_samples": 2}},
              {"algorithm": "grpo", "kl": {"coef": 0.0}, "reward": {"source": "rule"}},
              # a distillation round's teacher takes the reference's scorer, with no KL term
              {"algorithm": "distill", "teacher": "round_1", "start_from": "sft", "reward": {"source": "rule"},
               "colocate_reference_and_reward": False},
              # a judge's engine, on a placement of its own and colocated
              {"algorithm": "grpo", "reward": {"source": "judge", "judge": {"model": "/j", "generation": {
                  "placement": {"num_cpus": 3}}}}},
              {"algorithm": "grpo", "colocate_all": True, "reward": {"sources": [
                  {"source": "rule"}, {"source": "judge"}], "judge": {"model": "/j"}}},
              # a process reward model: a scorer of its own, beside a shared reference and reward model
              {"algorithm": "grpo", "reward": {"sources": [{"source": "model"}, {"source": "process_model"}]}},
              {"algorithm": "grpo", "colocate_all": True, "reward": {"source": "process_model"}}]
    cfg = load_config(None, [f"rounds={json.dumps(rounds)}", "data.synthetic.num_process=100",
                             "process_reward_model={}"])
    for r in cfg.rounds:
        cpu, gpu, _ = _round_needs(r)
        assert {"CPU": cpu, "GPU": gpu} == round_resources(r), r.algorithm


def test_the_gpu_config_fits_one_gpu(tmp_path, monkeypatch):
    """configs/gpu-small.yaml is for one GPU. Its evaluations start an engine of their own (a GPU) and
    end it before their scorer (a GPU) starts: one GPU serves both. The machine's GPU count is the one
    thing this test sets (these machines have none)."""
    import alignflow.preflight.slots

    gpu_small, root = REPO / "configs" / "gpu-small.yaml", f"infra.storage.root={tmp_path / 'a'}"
    monkeypatch.setattr(alignflow.preflight.slots, "_gpus", lambda: 1)
    assert problems(gpu_small, root) == []
    # An engine kept for the run holds its GPU beside every stage's, the scorer's included.
    held = problems(gpu_small, root, "evaluation.engine_lifetime=run")
    assert [p.split(";")[0] for p in held if p.startswith("evaluation:")] == [
        "evaluation: its actors need 2 GPUs at once"]
    monkeypatch.setattr(alignflow.preflight.slots, "_gpus", lambda: 0)
    assert sorted(p.split(":")[0] for p in problems(gpu_small, root)) == [
        "evaluation", "reward_model", "rounds.0", "rounds.1", "sft"]


# ---- the default config, check() and the CLI ------------------------------------------------------------


def test_the_default_config_passes(tmp_path):
    cfg = resolve_paths(load_config(), tmp_path)
    found = preflight(cfg)
    assert found.problems == []
    # lengths: 2 rounds, evaluation, the limits; the checker; storage; the MLflow file's directory; slots: 2 rounds,
    # sft, reward model, eval
    assert found.checks == 12
    assert not (tmp_path / "artifacts").exists()


def test_check_raises_one_error_listing_every_problem(tmp_path):
    missing = tmp_path / "m"
    overrides = [f"model.base={missing}", f"infra.storage.root={tmp_path}", "evaluation.checker=os:sep"]
    with pytest.raises(ConfigError) as err:
        check(load_config(None, overrides), overrides)
    assert str(err.value) == (
        "preflight found 2 problems:\n"
        f"  model.base: {missing} does not exist (a local model directory, or a hub id where a hub is reachable) "
        f"(from the command line: model.base={missing})\n"
        "  evaluation.checker: 'os:sep' is not callable (from the command line: evaluation.checker=os:sep)")


@pytest.mark.parametrize("command", ["validate", "run"])
def test_cli_reports_preflight_problems_before_prefect_starts(command, tmp_path, cli_env):
    missing = tmp_path / "sft.jsonl"
    args = [f"data.sft.path={missing}", f"infra.storage.root={tmp_path / 'a'}",
            f"infra.mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    ok = _jsonl(tmp_path / "ok.jsonl", [{"prompt": "1 2", "chosen": "2", "rejected": "1", "answer": "2"}])
    args += ["data.source=files", f"data.preference.path={ok}", f"data.eval.path={ok}", "reward_model.batch_size=1"]
    proc = subprocess.run([str(VENV_BIN / "alignflow"), command, *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=cli_env())
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-2:] == [
        "error: preflight found 1 problem:",
        f"  data.sft.path: {missing} does not exist (from the command line: data.sft.path={missing})"]
    assert "Traceback" not in proc.stderr
    assert "Prefect API" not in proc.stdout + proc.stderr
    # validate prints no config; run prints its plan (the data stage will run: missing file), then stops
    assert proc.stdout == "" if command == "validate" else "data.sft.path" not in proc.stdout
    if command == "run":
        assert re.search(r"^  data +data +model=base_model +[0-9a-f]{20}  will run", proc.stdout, re.M), proc.stdout


def test_validate_prints_the_config_it_checked_with_its_reward_urls_names_unfilled(tmp_path, capsys, monkeypatch):
    """`alignflow validate` prints the config as it holds it: a reward URL's `${NAME}`, never its value."""
    from flows.cli import cmd_validate

    monkeypatch.setenv("RM_API_KEY", "s3cr3t")
    service = RewardService()  # preflight sends it a test request, the key filled in
    try:
        overrides = [f"infra.storage.root={tmp_path / 'a'}",
                     'rounds=[{"algorithm": "grpo", "reward": {"source": "remote", '
                     f'"url": "{service.url}?api_key=${{RM_API_KEY}}"}}}}]']
        assert cmd_validate(load_config(None, overrides), None, overrides) == 0
    finally:
        service.close()
    shown = capsys.readouterr().out
    assert json.loads(shown)["rounds"][0]["reward"]["url"] == f"{service.url}?api_key=***"
    assert "s3cr3t" not in shown and len(service.requests) == 1


def test_local_inputs_and_a_sqlite_tracking_file_are_said_on_a_cluster(files, tmp_path):
    """With infra.ray_address a stage may run on another node: the local data files and the SQLite tracking
    file are named (not refused: a filesystem every node mounts serves); a hub dataset's name and the local Ray
    say nothing."""
    cluster = ["infra.ray_address=ray://cluster:10001", f"infra.mlflow_tracking_uri=sqlite:///{tmp_path / 'm.db'}"]
    found = preflight(load_config(files, cluster), cluster, files)
    assert found.problems == [] and len(_besides_checker(found.notes)) == 1
    assert _besides_checker(found.notes)[0].startswith("infra.ray_address ray://cluster:10001: stages and actors run on any node")
    for field, name in (("data.sft.path", "sft.jsonl"), ("data.preference.path", "pref.jsonl"),
                        ("data.eval.path", "eval.jsonl")):
        assert f"{field} ({tmp_path / name})" in _besides_checker(found.notes)[0]
    assert f"infra.mlflow_tracking_uri ({tmp_path / 'm.db'}: one SQLite database per node)" in _besides_checker(found.notes)[0]
    assert not [n for n in preflight(load_config(files, cluster[1:]), cluster[1:], files).notes if "ray_address" in n]


def _hub_cache(cache: Path) -> dict[str, str]:
    """A hub cache as huggingface_hub lays it out, holding `alignflow/tiny` at two commits: main (the tiny
    model of seed 0, 128 positions) and the branch v2 (seed 1, 256 positions). Name -> commit."""
    from alignflow.config import TinyModelConfig
    from engines.models import build_tiny_model

    repo = cache / "models--alignflow--tiny"
    commits = {"main": "a" * 40, "v2": "b" * 40}
    for (branch, commit), (seed, positions) in zip(commits.items(), ((0, 128), (1, 256))):
        build_tiny_model(TinyModelConfig(max_position_embeddings=positions), seed, repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / branch).write_text(commit)
    return commits


def test_a_hub_models_revision_is_what_preflight_reads_and_the_loaders_load(tmp_path):
    """model.revision: a hub id's branch, tag or commit, read by preflight and loaded by the base model stage,
    from a hub cache here (HF_HUB_OFFLINE: huggingface_hub reads both at import, so in a process of its own)."""
    import os

    commits = _hub_cache(tmp_path / "hub")
    code = """
import json, sys, torch
from alignflow.config import load_config
from alignflow.preflight import preflight
from engines import models
out = {}
for rev in (None, "v2", "%s", "nope"):
    args = ["model.base=alignflow/tiny", "infra.storage.root=%s"] + ([f"model.revision={rev}"] if rev else [])
    found = preflight(load_config(None, args), args)
    out[str(rev)] = [p for p in found.problems if p.startswith("model.")]
    if not out[str(rev)]:
        out[str(rev) + "/positions"] = models.max_positions("alignflow/tiny", rev)
        policy = models.load_policy("alignflow/tiny", revision=rev)
        out[str(rev) + "/weights"] = policy.get_input_embeddings().weight.sum().item()
        out[str(rev) + "/vocab"] = len(models.load_tokenizer("alignflow/tiny", rev))
print(json.dumps(out))
""" % (commits["v2"], tmp_path / "store")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["None/positions"] == 128 and out["v2/positions"] == out[f"{commits['v2']}/positions"] == 256
    assert out["v2/weights"] == out[f"{commits['v2']}/weights"] != out["None/weights"]  # seed 1's, not main's
    assert out["None/vocab"] == out["v2/vocab"] > 256  # the tokenizer loads at the revision too
    assert out["None"] == out["v2"] == []
    [problem] = out["nope"]
    assert problem.startswith("model.base: alignflow/tiny is no local directory") and \
        "does not load as a hub id at revision 'nope': not in the local cache, and HF_HUB_OFFLINE is set" in problem


def test_a_revision_of_a_local_directory_or_the_tiny_model_is_refused(tmp_path):
    from pydantic import ValidationError

    from alignflow.config import ModelConfig

    with pytest.raises(ValidationError, match="revision names a hub model's branch, tag or commit"):
        ModelConfig(base="tiny", revision="main")
    (tmp_path / "m").mkdir()
    assert problems(None, f"model.base={tmp_path / 'm'}", "model.revision=v2", f"infra.storage.root={tmp_path}") == [
        f"model.revision: 'v2' names a hub model's branch, tag or commit, but model.base {tmp_path / 'm'} is a local "
        "directory (from the command line: model.revision=v2)"]
    from alignflow.config import TinyModelConfig
    from engines.models import build_tiny_model

    teacher = build_tiny_model(TinyModelConfig(), 0, tmp_path / "teacher")
    rounds = (f'rounds=[{{"algorithm": "distill", "teacher": "{teacher}", "teacher_revision": "v2", '
              '"reward": {"source": "rule"}}]')
    [found] = [p for p in problems(None, rounds, f"infra.storage.root={tmp_path}") if "revision" in p]
    assert found.startswith(f"rounds.0.teacher_revision: 'v2' names a hub model's branch, tag or commit, but "
                            f"rounds.0.teacher {teacher} is a local directory")


def test_preflight_of_the_default_config_imports_no_model_library(tmp_path):
    """The README's "under a second on the default config": the tiny model's checks read its config fields, so
    neither transformers (seconds of imports) nor torch is imported; a LoRA target check builds the model."""
    script = ("import sys\nfrom alignflow.config import load_config\nfrom alignflow.preflight import check\n"
              f"check(load_config(None, ['infra.storage.root={tmp_path / 'a'}']))\n"
              "print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "[]", out.stderr[-2000:]


def test_settings_no_part_of_the_run_reads_are_said_not_refused(tmp_path):
    """A switch of algorithm or backend by override, on a file written for another, leaves sections nothing
    reads: said, field by field and where each was set, and the run goes on. The default config says none."""
    path = _write_config(tmp_path, "rounds:\n  - {algorithm: ppo, critic: {learning_rate: 5.0e-6, micro_batch_size: 2},"
                                   " generation: {vllm: {enable_prefix_caching: true}}}")
    overrides = ["rounds.0.algorithm=grpo", "rounds.0.generation.backend=hf", "rounds.0.partial_tokens=8"]
    found = preflight(load_config(path, overrides), overrides, path)
    assert found.problems == []
    assert found.notes == [
        f"rounds.0.critic.learning_rate, rounds.0.critic.micro_batch_size: not used (grpo has no critic) (from {path})",
        "rounds.0.partial_tokens: not used (it sizes partial_rollouts' pieces, which are off) (from the command "
        "line: rounds.0.partial_tokens=8)",
        f"rounds.0.generation.vllm.enable_prefix_caching: not used (generation.backend is hf, not vllm) (from {path})"]
    stale = ['rounds=[{"algorithm": "grpo", "async_rollouts": true, "max_staleness": 2, "ppo": {"tis_cap": null}}]']
    assert preflight(load_config(None, stale), stale, None).notes == [
        "rounds.0.ppo.tis_cap: null: async_rollouts trains on samples up to max_staleness=2 update(s) old with no "
        f"importance-sampling correction for the policy that sampled them (from the command line: {stale[0][:57]}...)"]
    as_written = preflight(load_config(path), [], path)
    assert as_written.problems == [] and as_written.notes == []
    assert preflight(load_config(None), [], None).notes == []


def test_a_teachers_vocabulary_is_compared_with_the_students_before_the_run(tmp_path):
    """A distillation teacher given as a directory numbers tokens as model.base does, or the run is refused before
    SFT trains (it used to be found when the round started); a round's teacher, which scores the ids the student
    samples, also needs as many output rows. A tiny base's tokenizer is built by the run: said, compared later."""
    import json
    import shutil

    from alignflow.config import TinyModelConfig
    from engines.models import build_tiny_model, load_tokenizer

    student = build_tiny_model(TinyModelConfig(), 0, tmp_path / "student")
    same = build_tiny_model(TinyModelConfig(), 1, tmp_path / "same")  # another model, the same tokenizer
    other = shutil.copytree(same, tmp_path / "other")
    tok = load_tokenizer(other)
    tok.add_tokens(["<tool>"])
    tok.save_pretrained(other)
    fewer = shutil.copytree(same, tmp_path / "fewer")
    config = json.loads((fewer / "config.json").read_text())
    (fewer / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] - 8}))

    def found(teacher, base=student):
        rounds = f'rounds=[{{"algorithm": "distill", "teacher": "{teacher}", "reward": {{"source": "rule"}}}}]'
        overrides = [f"model.base={base}", rounds, f"infra.storage.root={tmp_path / 'a'}"]
        return preflight(load_config(None, overrides), overrides, None)

    assert found(same).problems == []
    [mismatch] = found(other).problems
    assert mismatch.startswith(f"rounds.0.teacher: its tokenizer is not model.base's ({len(tok)} against "
                               f"{len(tok) - 1} tokens")
    [rows] = found(fewer).problems
    assert rows.startswith(f"rounds.0.teacher: the teacher's output layer has {config['vocab_size'] - 8} rows, "
                           f"model.base's {config['vocab_size']}")
    tiny = found(other, base="tiny")
    assert tiny.problems == [] and "rounds.0.teacher: its tokenizer is compared with the student's when its stage " \
        "starts (the tiny model's tokenizer is built by the base_model stage)" in tiny.notes


def test_a_reference_free_losss_reference_settings_are_said_unused(tmp_path):
    over = ['preference={"loss": "orpo", "reference_micro_batch_size": 8}', f"infra.storage.root={tmp_path}"]
    notes = [n for n in preflight(load_config(None, over), over, None).notes if "reference" in n]
    assert notes == ['preference.reference_micro_batch_size: not used (preference.loss orpo has no reference) '
                     '(from the command line: preference={"loss": "orpo", "reference_micro_batch_size": 8})'], notes
    dpo = [over[0].replace("orpo", "dpo"), over[1]]
    assert not [n for n in preflight(load_config(None, dpo), dpo, None).notes if "reference_micro" in n]


def test_gradients_summed_in_half_precision_are_said(tmp_path):
    """ZeRO-0/1 in bf16 sum a step's micro-batch gradients in bf16 (DeepSpeed gives fp32 sums at ZeRO-2/3 only):
    said for each training engine that does, where its stage was set; a critic nothing trains is left out."""
    from alignflow.preflight.unused import engines

    half = ["model.dtype=bfloat16", "sft.zero_stage=2", "reward_model.zero_stage=3"]
    notes = preflight(load_config(None, half), half, None).notes
    [note] = [n for n in notes if "zero_stage" in n]
    assert note.startswith("rounds.0.actor.zero_stage, rounds.0.critic.zero_stage, rounds.1.actor.zero_stage, "
                           "rounds.1.critic.zero_stage: under 2 with model.dtype bfloat16, a step's micro-batch "
                           "gradients are summed in bfloat16"), note
    assert note.endswith("(the default, not set in alignflow/configs/tiny.yaml)")
    grpo = [*half, 'rounds=[{"algorithm": "grpo"}]']  # its critic trains nothing: not said
    [note] = [n for n in preflight(load_config(None, grpo), grpo, None).notes if "zero_stage" in n]
    assert note.startswith("rounds.0.actor.zero_stage: under 2")
    assert ("sft.zero_stage", 2) in [(f"{at}.zero_stage", e.zero_stage) for at, e in engines(load_config(None, half), "")]
    full = ["model.dtype=bfloat16", "sft.zero_stage=2", "reward_model.zero_stage=2", "rounds.0.actor.zero_stage=3",
            "rounds.1.actor.zero_stage=2", "rounds.0.critic.zero_stage=2", "rounds.1.critic.zero_stage=2"]
    assert not [n for n in preflight(load_config(None, full), full, None).notes if "zero_stage" in n]
    offloaded = [*full, "sft.offload=optimizer"]  # fp32 sums would sit on the GPU: summed in bf16, said
    notes = [n for n in preflight(load_config(None, offloaded), offloaded, None).notes if "offload" in n]
    assert [n.split(":")[0] for n in notes] == ["sft.offload"], notes
    assert "gradients are summed in bfloat16" in notes[0] and notes[0].endswith("(from the command line: "
                                                                               "sft.offload=optimizer)"), notes
    assert not [n for n in preflight(load_config(None), [], None).notes if "zero_stage" in n]  # float32


def test_the_vote_and_checker_of_user_data_are_checked_and_said(files):
    """evaluation.vote_on is called with a response: named with its signature where it takes other arguments.
    The bundled exact-match checker on user data is said (a reasoning policy's accuracy would read near 0)."""
    assert problems(files, "evaluation.vote_on=alignflow.rewards:math_equal") == [
        "evaluation.vote_on: 'alignflow.rewards:math_equal' is called as f(response), but takes (prompt, response, "
        "answer): missing a required argument: 'response' (from the command line: "
        "evaluation.vote_on=alignflow.rewards:math_equal)"]
    notes = preflight(load_config(files), [], files).notes
    assert [n for n in notes if n.startswith("evaluation.checker: alignflow.data.synthetic:check_answer (the bundled "
                                             "tasks' check: the whole response equal to the answer) scores your data")]
    mine = ["evaluation.checker=alignflow.rewards:math_correct", "evaluation.vote_on=alignflow.rewards:final_answer"]
    found = preflight(load_config(files, mine), mine, files)
    assert found.problems == [] and not [n for n in found.notes if n.startswith("evaluation.checker")]
    assert not [n for n in preflight(load_config(None), [], None).notes if n.startswith("evaluation.checker")]


def _besides_checker(notes: list[str]) -> list[str]:
    """Preflight's notes but the one on the exact-match checker scoring user data (its own test above)."""
    return [n for n in notes if not n.startswith("evaluation.checker: alignflow.data.synthetic:check_answer")]

