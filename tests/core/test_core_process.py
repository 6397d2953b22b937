"""A process reward model's data and config: step-labelled rows from files and from the bundled task, the checks
before anything starts, and the plan's keys (adding one leaves every other stage's key as it was)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from alignflow.config import DatasetSource, StepwiseSource, load_config
from alignflow.data.load import load_records
from alignflow.data.stepwise_task import solutions, stepwise_solution
from alignflow.data.synthetic import generate
from alignflow.errors import ConfigError, DataError
from alignflow.preflight import preflight
from tasks.plan import plan_pipeline
from tasks.stages.data import held_out_pairs

REPO = Path(__file__).resolve().parents[2]


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _row(i: int = 0, **over) -> dict:
    return {"prompt": f"add {i} and 2", "completions": [f"{i} + 2", f"= {i + 2}"], "labels": [True, i % 2 == 0]} | over


def test_step_rows_from_a_file_end_each_step_with_the_separator(tmp_path):
    path = _jsonl(tmp_path / "steps.jsonl", [_row(0), _row(1)])
    rows = load_records(StepwiseSource(path=str(path)), "process")
    assert rows == [{"prompt": "add 0 and 2", "steps": ["0 + 2\n", "= 2\n"], "labels": [True, True]},
                    {"prompt": "add 1 and 2", "steps": ["1 + 2\n", "= 3\n"], "labels": [True, False]}]
    soft = _jsonl(tmp_path / "soft.jsonl", [_row(0, labels=[1.0, 0.25]), _row(1, labels=[0, 1])])
    assert [r["labels"] for r in load_records(StepwiseSource(path=str(soft)), "process")] == [[1.0, 0.25], [0.0, 1.0]]
    with pytest.raises(ValueError, match="label_key is not read in data.process"):
        StepwiseSource(path=str(path), label_key="ok")
    chat = StepwiseSource(path=str(path), messages_key="q", steps_key="s", labels_key="y", step_separator=" ки")
    with pytest.raises(DataError, match="row 1: missing key 'q'"):
        load_records(chat, "process")
    _jsonl(path, [{"q": [{"role": "user", "content": "hi"}], "s": ["a", "b"], "y": [1, 0]}])
    assert load_records(chat, "process") == [{"prompt": [{"role": "user", "content": "hi"}],
                                              "steps": ["a ки", "b ки"], "labels": [True, False]}]


@pytest.mark.parametrize("row, said", [
    (_row(labels=[True]), "row 1: key 'completions' holds 2 steps and key 'labels' 1 labels: give one label per step"),
    (_row(labels=["+", "-"]), "row 1: key 'labels' must be a list of labels, one per step: true/false, 1/0 or a "
                              "probability in [0, 1] (Math-Shepherd's '+'/'-' tags: map them to true/false)"),
    (_row(labels=[True, 1.5]), "row 1: key 'labels' must be a list of labels, one per step"),
    (_row(completions="0 + 2"), "row 1: key 'completions' must be a non-empty list of strings (the solution's "
                                "steps), got str"),
    (_row(completions=[]), "row 1: key 'completions' must be a non-empty list of strings (the solution's steps), "
                           "got an empty list"),
    (_row(completions=["0 + 2", "  "]), "row 1: key 'completions', step 2 (of 2) is empty"),
    (_row(completions=["0 + 2", "= 2\n"]), "row 1: key 'completions', step 2 holds the step separator '\\n', "
                                            "which follows every step: a round splits responses at it"),
    ({"prompt": "p", "steps": ["a"], "labels": [True]},
     "row 1: missing key 'completions' (or set steps_key under data.process); this row has keys: ['labels', "),
    (_row(labels=None), "row 1: key 'labels' is null (or set labels_key under data.process)"),
])
def test_a_bad_step_row_names_its_file_row_and_key(tmp_path, row, said):
    path = _jsonl(tmp_path / "steps.jsonl", [row])
    with pytest.raises(DataError) as err:
        load_records(StepwiseSource(path=str(path)), "process")
    assert f"{path}, {said}" in str(err.value), str(err.value)


def test_the_bundled_tasks_solutions_label_each_step_by_the_running_largest_digit():
    rng, slipped = random.Random(3), 0
    for _ in range(400):
        digits = rng.sample(range(10), 5)
        row = stepwise_solution(digits, rng)
        values = [int(s.removesuffix("\n")) for s in row["steps"]]
        assert all(s.endswith("\n") for s in row["steps"]) and len(values) == 5
        truth = [max(digits[: k + 1]) for k in range(5)]
        assert row["labels"] == [v == t for v, t in zip(values, truth)]
        assert values[0] == digits[0]  # a slip comes after the first step
        wrong = [k for k, ok in enumerate(row["labels"]) if not ok]
        slipped += bool(wrong)
        if wrong:  # one slip: from it on, each step is the running largest digit of what it had
            k = wrong[0]
            assert all(values[j] == max(values[j - 1], digits[j]) for j in range(k + 1, 5))
    assert 150 < slipped < 250  # half slip


def test_the_bundled_tasks_solutions_never_reuse_a_prompt_of_its_other_splits():
    cfg = load_config(None, ["data.synthetic.num_process=300", "data.synthetic.num_sft=100",
                             "data.synthetic.num_preference=100", "process_reward_model={}"]).data.synthetic
    splits = generate(cfg, 5)
    rows = solutions(cfg, 5, splits)
    assert len(rows) == 300 and rows == solutions(cfg, 5, splits)  # the seed decides them
    seen = {json.dumps(r["prompt"]) for rs in splits.values() for r in rs}
    assert not seen & {json.dumps(r["prompt"]) for r in rows}
    assert len({json.dumps(r["prompt"]) for r in rows}) == 300
    trained, held = held_out_pairs(rows, 5, split="process")
    assert len(held) == 30 and not {json.dumps(r["prompt"]) for r in held} & {json.dumps(r["prompt"]) for r in trained}


def test_a_process_reward_model_without_step_labelled_data_is_refused_naming_what_to_set(tmp_path):
    with pytest.raises(ConfigError, match="data.synthetic.num_process is 0: set it"):
        load_config(None, ["process_reward_model={}"])
    sft = _jsonl(tmp_path / "sft.jsonl", [{"prompt": "1", "response": "1"}])
    files = [f"data={{source: files, sft: {{path: {sft}}}, eval: {{path: {sft}}}}}", "reward_model=null",
             "rounds=[]"]
    with pytest.raises(ConfigError, match="process_reward_model trains on step-labelled solutions: give data.process"):
        load_config(None, [*files, "process_reward_model={}"])
    with pytest.raises(ConfigError, match="packing: a process reward model trains on padded rows only"):
        load_config(None, ["data.synthetic.num_process=10", "process_reward_model={packing: true}"])
    with pytest.raises(ConfigError, match="the boxes task has no step-labelled solutions"):
        load_config(None, ["data.synthetic.task=boxes", "data.synthetic.num_process=10"])


def _keys(*overrides: str, cache: Path) -> dict[str, str]:
    cfg = load_config(None, [*overrides, f"infra.storage.cache_dir={cache}"])
    return {name: s.key for name, s in plan_pipeline(cfg).stages.items()}


def test_adding_a_process_reward_model_leaves_every_other_stages_key_as_it_was(tmp_path):
    before = _keys(cache=tmp_path)
    synthetic = _keys("data.synthetic.num_process=200", "process_reward_model={}", cache=tmp_path)
    added = {"process_data", "process_reward_model", "eval_process_reward_model"}
    assert set(synthetic) == set(before) | added
    assert {n: k for n, k in synthetic.items() if n not in added} == before
    # From a file: its content is in the process stages' keys, and only theirs.
    steps = _jsonl(tmp_path / "steps.jsonl", [_row(i) for i in range(40)])
    sft = _jsonl(tmp_path / "sft.jsonl", [{"prompt": "1", "response": "1"}] * 40)
    files = [f"data={{source: files, sft: {{path: {sft}}}, eval: {{path: {sft}}}}}", "reward_model=null", "rounds=[]"]
    plain = _keys(*files, cache=tmp_path)
    with_steps = _keys(*files[1:], f"data={{source: files, sft: {{path: {sft}}}, eval: {{path: {sft}}}, "
                                    f"process: {{path: {steps}}}}}", "process_reward_model={batch_size: 8}",
                       cache=tmp_path)
    assert {n: k for n, k in with_steps.items() if n not in added} == plain
    _jsonl(steps, [_row(i) for i in range(41)])
    edited = _keys(*files[1:], f"data={{source: files, sft: {{path: {sft}}}, eval: {{path: {sft}}}, "
                                f"process: {{path: {steps}}}}}", "process_reward_model={batch_size: 8}", cache=tmp_path)
    assert {n for n in edited if edited[n] != with_steps[n]} == added


def test_preflight_reads_a_step_file_row_by_row_and_bounds_the_batch_by_its_solutions(tmp_path):
    sft = _jsonl(tmp_path / "sft.jsonl", [{"prompt": "1", "response": "1"}] * 4)
    ev = _jsonl(tmp_path / "eval.jsonl", [{"prompt": "1", "answer": "1"}] * 4)
    steps = _jsonl(tmp_path / "steps.jsonl", [_row(i) for i in range(6)] + [_row(7, labels=[True])])
    over = [f"data={{source: files, sft: {{path: {sft}}}, eval: {{path: {ev}}}, process: {{path: {steps}}}}}",
            "reward_model=null", "rounds=[]", "sft.batch_size=2", "process_reward_model={batch_size: 8}",
            f"infra.storage.root={tmp_path / 'artifacts'}"]
    [found] = preflight(load_config(None, over), over).problems
    assert found.startswith(f"data.process: {steps}, row 7: key 'completions' holds 2 steps and key 'labels' 1 "
                            "labels: give one label per step"), found
    _jsonl(steps, [_row(i) for i in range(6)])
    [batch] = preflight(load_config(None, over), over).problems
    assert batch.startswith("process_reward_model.batch_size: 8 is more than the 5 solutions of data.process (less "
                            "about 10 % held out) it can train on"), batch
    assert preflight(load_config(None, over[:-2] + ["process_reward_model={batch_size: 5}", over[-1]]),
                     over).problems == []
    # The bundled task's solutions: 32 less the 3 held out.
    synthetic = ["data.synthetic.num_process=32", "process_reward_model={batch_size: 32}", over[-1]]
    [batch] = preflight(load_config(None, synthetic), synthetic).problems
    assert batch.startswith("process_reward_model.batch_size: 32 is more than the 29 solutions (less about 10 % held "
                            "out) it can train on"), batch
    assert isinstance(load_config(None, over).data.process, DatasetSource)


def test_step_labelled_data_without_a_process_reward_model_is_said_unused(tmp_path):
    over = ["data.synthetic.num_process=50", f"infra.storage.root={tmp_path / 'artifacts'}"]
    found = preflight(load_config(None, over), over)
    assert found.problems == []
    assert [n for n in found.notes if n.startswith("data.synthetic.num_process")] == [
        "data.synthetic.num_process: not used (no process_reward_model trains on step-labelled solutions) (from the "
        "command line: data.synthetic.num_process=50)"], found.notes


def test_a_round_rewarded_by_the_process_reward_model_is_checked_and_wired(tmp_path):
    prm = ["data.synthetic.num_process=200", "process_reward_model={}"]
    with pytest.raises(ConfigError, match=r"rounds.0 asks the process reward model .* but "
                                          "process_reward_model is null"):
        load_config(None, ["rounds=[{algorithm: grpo, reward: {source: process_model}}]"])
    with pytest.raises(ConfigError, match="step_aggregation is source process_model's setting, and this source is "
                                          "rule"):
        load_config(None, [*prm, "rounds=[{algorithm: grpo, reward: {source: rule, step_aggregation: last}}]"])
    with pytest.raises(ConfigError, match="no_step_reward is source process_model's setting"):
        load_config(None, [*prm, "rounds=[{algorithm: grpo, reward: {source: model, no_step_reward: -1}}]"])
    with pytest.raises(ConfigError, match="one process reward model per round"):
        load_config(None, [*prm, "rounds=[{algorithm: grpo, reward: {sources: [{source: process_model}, "
                                 "{source: process_model, name: again}]}}]"])
    with pytest.raises(ConfigError, match="an environment's episodes interleave observations"):
        load_config(None, [*prm, "rounds=[{algorithm: grpo, environment: {name: boxes}, "
                                 "reward: {source: process_model}}]"])

    mixed = ["rounds=[{algorithm: grpo, reward: {source: rule}}, {algorithm: grpo, reward: {sources: [{source: "
             "rule}, {source: process_model, weight: 0.5, step_aggregation: last}]}}]"]
    cfg = load_config(None, [*prm, *mixed, f"infra.storage.cache_dir={tmp_path}"])
    stages = plan_pipeline(cfg).stages
    assert "process_reward" not in stages["round_1"].inputs and stages["round_1"].config.step_separator is None
    assert stages["round_2"].inputs["process_reward"] == "process_reward_model"
    assert stages["round_2"].config.step_separator == "\n"
    # The first round's key is the one it has without a process reward model in the pipeline.
    alone = _keys("rounds=[{algorithm: grpo, reward: {source: rule}}]", cache=tmp_path)
    assert alone["round_1"] == stages["round_1"].key


def test_a_target_the_config_plans_no_stage_of_says_so(tmp_path):
    cfg = load_config(None, [f"infra.storage.cache_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="no stage 'process_reward_model' in this pipeline \\(the config has no "
                                          "section that plans it\\); valid: "):
        plan_pipeline(cfg).resolve("process_reward_model")


def test_a_name_added_to_the_config_is_left_out_of_keys_only_as_a_setting_not_in_an_environments_kwargs():
    from alignflow.config import RoundConfig, cache_relevant

    assert "step_aggregation" not in cache_relevant(RoundConfig())["reward"]  # at its default: as before it came
    assert cache_relevant(RoundConfig(reward={"source": "process_model", "step_aggregation": "last"}))["reward"][
        "step_aggregation"] == "last"
    env = {"name": "boxes", "kwargs": {"num_process": 0, "no_step_reward": -5.0}}
    kept = cache_relevant(RoundConfig(environment=env, reward={"source": "environment"}))["environment"]["kwargs"]
    assert kept == {"num_process": 0, "no_step_reward": -5.0}  # the user's own names, whatever they mean there


def test_a_dense_process_reward_is_refused_where_no_advantage_takes_it():
    from alignflow.config import RoundConfig, cache_relevant

    prm = ["data.synthetic.num_process=200", "process_reward_model={}"]
    dense = "reward: {source: process_model, dense: true}"
    for algorithm, what in (("rejection_sampling", "keeps each prompt's best response by its sequence reward"),
                            ("online_dpo", "pairs each prompt's best and worst responses"),
                            ("distill", "takes its advantage from its teacher")):
        teacher = ", teacher: base" if algorithm == "distill" else ""
        with pytest.raises(ConfigError, match=f"makes step rewards part of the advantages, and {algorithm} {what}"):
            load_config(None, [*prm, f"rounds=[{{algorithm: {algorithm}{teacher}, {dense}}}]"])
    with pytest.raises(ConfigError, match="every sequence reward is 0: every group would be dropped"):
        load_config(None, [*prm, f"rounds=[{{algorithm: grpo, ppo: {{dynamic_sampling: true}}, {dense}}}]"])
    with pytest.raises(ConfigError, match="reward.normalize and reward.clip shape the sequence reward"):
        load_config(None, [*prm, "rounds=[{algorithm: ppo, reward: {source: process_model, dense: true, "
                                 "clip: 2.0}}]"])
    with pytest.raises(ConfigError, match="dense is source process_model's setting, and this source is rule"):
        load_config(None, [*prm, "rounds=[{algorithm: grpo, reward: {source: rule, dense: true}}]"])
    # Beside an outcome source, the filters have a sequence reward to read.
    mixed = load_config(None, [*prm, "rounds=[{algorithm: grpo, ppo: {dynamic_sampling: true}, reward: {sources: "
                                     "[{source: rule}, {source: process_model, dense: true, weight: 0.5}]}}]"])
    assert [c.dense for c in mixed.rounds[0].reward.components] == [False, True]
    assert not mixed.rounds[0].reward.dense_only
    assert "dense" not in cache_relevant(RoundConfig())["reward"]  # at its default: earlier keys unchanged


def test_dense_refuses_an_aggregation_it_would_not_read_and_a_users_own_dense_key_stays_in_keys():
    from alignflow.config import cache_relevant
    from alignflow.config.round.judge import JudgeRewardConfig

    prm = ["data.synthetic.num_process=200", "process_reward_model={}"]
    with pytest.raises(ConfigError, match="step_aggregation makes one reward of a response's steps, and dense: true"):
        load_config(None, [*prm, "rounds=[{algorithm: grpo, reward: {source: process_model, dense: true, "
                                 "step_aggregation: mean}}]"])
    # A field added later is left out of keys at its default value and type only: a verdict named `dense` scored 0
    # is the user's, and two judges that score it differently differ.
    scores = cache_relevant(JudgeRewardConfig(scores={"dense": 0.0, "sparse": 1.0}))["scores"]
    assert scores == {"dense": 0.0, "sparse": 1.0}
