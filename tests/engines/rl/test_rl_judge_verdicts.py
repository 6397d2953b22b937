"""A generative judge's pure parts: its prompt, the verdict records the judge stage trains on, verdicts
parsed into scores (malformed ones counted, never a silent zero), and its config's checks."""

from __future__ import annotations

import pytest

from alignflow.config import ConfigError, load_config
from alignflow.config.round.judge import JUDGE_TEMPLATE, JudgeRewardConfig
from alignflow.config.round.verdicts import parse_verdict
from engines.rl.judge import judge_messages, judge_positions
from engines.rl.rewards import prompt_text
from engines.rl.rewards import ScoredText
from tasks.stages.judge import judged_pairs, verdict_records


@pytest.mark.parametrize("text, score", [
    ("yes", 1.0), (" Yes.", 1.0), ("no", 0.0), ("NO!", 0.0), ("0.25", None), ("maybe", None), ("", None),
    ("yesterday", None), ("the answer: yes", None),  # the default pattern reads the verdict's first word
])
def test_regex_verdicts_with_the_default_words(text, score):
    assert parse_verdict(text, JudgeRewardConfig()) == score


def test_regex_verdicts_read_as_numbers_where_no_word_matches():
    cfg = JudgeRewardConfig(pattern=r"score:\s*([-\w.]+)", scores={"high": 1.0})
    assert [parse_verdict(t, cfg) for t in ("score: 7", "Score: -0.5 of 10", "score: HIGH", "score: nan",
                                            "score: inf", "score: x1", "no score")] == [7.0, -0.5, 1.0, None, None,
                                                                                       None, None]


def test_json_verdicts():
    cfg = JudgeRewardConfig(parse="json", json_key="grade")
    assert [parse_verdict(t, cfg) for t in ('{"grade": 3}', 'I think {"grade": "0.5", "why": "ok"} here',
                                            '{"score": 1}', '{"grade": [1]}', '{"grade": 1', "")] == [
        3.0, 0.5, None, None, None, None]
    # The first object holding the key at its top level: not one nested in another, not a bool, past a brace
    # that opens no JSON.
    assert [parse_verdict(t, cfg) for t in ('{"detail": {"grade": 2}}', '{"grade": true}', 'e.g. {x} then {"grade": 4}',
                                            '{"why": {"grade": 9}} {"grade": 5}', '{"grade": 7} {"grade": 1}',
                                            '{"grade": NaN}', "{" * 3000)] == [None, None, 4.0, 5.0, 7.0, None, None]


def test_the_judge_prompt_and_the_verdicts_the_stage_trains_on():
    record = {"prompt": [{"role": "user", "content": "Which digit is largest? 1 9 2"}], "chosen": "9", "rejected": "2",
              "answer": "9"}
    assert prompt_text(record["prompt"]) == "Which digit is largest? 1 9 2" and prompt_text("plain") == "plain"
    [(chosen, right), (rejected, wrong)] = judged_pairs([record])
    assert (chosen.response, right, rejected.response, wrong) == ("9", True, "2", False)
    assert judge_messages(JUDGE_TEMPLATE, chosen) == [
        {"role": "user", "content": "Which digit is largest? 1 9 2 Answer: 9. Right?"}]
    assert judge_messages("{prompt}|{response}|{answer}", ScoredText("q", "r", None)) == [
        {"role": "user", "content": "q|r|"}]
    records = verdict_records([record], JUDGE_TEMPLATE)
    assert [r["response"] for r in records] == ["yes", "no"]
    assert records[1]["prompt"][0]["content"] == "Which digit is largest? 1 9 2 Answer: 2. Right?"


@pytest.mark.parametrize("judge, message", [
    ({"template": "{prompt} {verdict}"}, "names \\['verdict'\\]"),
    ({"template": "{prompt} only"}, "has no \\{response\\}"),
    ({"pattern": "yes|no"}, "has no group"),
    ({"pattern": "(yes"}, "is no regular expression"),
    ({"generation": {"num_samples": 3}}, "3 greedy votes are one vote repeated"),
    ({"generation": {"max_model_len": 4}}, "max_model_len 4 leaves no position for a prompt before a verdict of "
                                          "max_new_tokens 4"),
])
def test_a_wrong_judge_config_is_named(judge, message):
    rounds = f'rounds=[{{"algorithm": "grpo", "reward": {{"source": "judge", "judge": {judge!r}}}}}]'.replace("'", '"')
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["judge={}", rounds])


def test_a_round_asking_the_pipelines_judge_needs_one_trained_with_its_template():
    rounds = 'rounds=[{"algorithm": "grpo", "reward": {"source": "judge"}}]'
    with pytest.raises(ConfigError, match="rounds.0 asks the pipeline's judge .* has no judge section"):
        load_config(None, [rounds])
    with pytest.raises(ConfigError, match="rounds.0.reward.judge.template differs from judge.template"):
        load_config(None, ['judge={"template": "{prompt} = {response}?"}', rounds])
    own = 'rounds=[{"algorithm": "grpo", "reward": {"source": "judge", "judge": {"model": "/some/judge"}}}]'
    assert load_config(None, [own]).judge is None  # a judge of the user's needs no judge stage
    # The judge stage trains on preference pairs, which have no answer; a judge of the user's may read one.
    with pytest.raises(ConfigError, match=r"judge\.template: .*\{answer\} would be empty in every prompt it trains on"):
        load_config(None, ['judge={"template": "{prompt} = {response}? ({answer})"}'])
    load_config(None, [own.replace('"/some/judge"', '"/some/judge", "template": "{prompt} {response} {answer}"')])
    # The pipeline's judge answers "yes" / "no" (what it trains on): a parser that reads them alike, or not at
    # all, would give every response one score.
    for judge, read in (('{"parse": "json"}', "None and None"), ('{"scores": {"correct": 1.0, "incorrect": 0.0}}',
                                                                  "None and None"),
                        ('{"scores": {"yes": 0.0, "no": 1.0}}', "0.0 and 1.0")):
        asked = f'rounds=[{{"algorithm": "grpo", "reward": {{"source": "judge", "judge": {judge}}}}}]'
        with pytest.raises(ConfigError, match=f"trained to answer 'yes' or 'no', which its parse / pattern / scores "
                                              f"read as {read}"):
            load_config(None, ["judge={}", asked])
    load_config(None, ["judge={}", 'rounds=[{"algorithm": "grpo", "reward": {"source": "judge", "judge": '
                                   '{"scores": {"yes": 2.0, "no": -1.0}}}}]'])  # other scores, in order


def test_the_judge_engine_holds_the_positions_asked_for_and_no_more_than_the_model_has():
    """vLLM reserves KV cache for one sequence of max_model_len to start: a long-context judge on a shared
    GPU is given fewer positions than its model's, and more than the model's are refused, by name."""
    from alignflow.config.round.judge import JudgeGeneration

    field = "rounds.1.reward.judge.generation.max_model_len"
    assert judge_positions(131072, JudgeGeneration(), field) == 131072  # None: the model's own
    assert judge_positions(131072, JudgeGeneration(max_model_len=4096), field) == 4096
    with pytest.raises(ConfigError, match=f"{field}: 4096 positions, more than the judge model's 2048"):
        judge_positions(2048, JudgeGeneration(max_model_len=4096), field)
