"""Data: the bundled synthetic task and user data in JSONL / JSON / Parquet / `datasets`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from alignflow.config import DatasetSource, SyntheticTaskConfig
from alignflow.data import formats, load, synthetic
from alignflow.data.formats import DataError
from alignflow.data.load import load_records

QUESTION = "Which digit is largest?"


# ---- the synthetic task ------------------------------------------------------------


def _digits(record: dict) -> list[int]:
    """The digits of a synthetic prompt, parsed from the rendered user message."""
    (message,) = record["prompt"]
    assert message["role"] == "user"
    text = message["content"]
    assert text.startswith(QUESTION + " ")
    return [int(tok) for tok in text[len(QUESTION) + 1 :].split(" ")]


def _habit(digits: list[int]) -> int:
    return [d for d in digits if d != max(digits)][0]


@pytest.fixture(scope="module")
def cfg() -> SyntheticTaskConfig:
    return SyntheticTaskConfig(num_digits=5, num_sft=2000, num_preference=2000, num_rl_prompts=300,
                               num_eval=200, sft_correct_fraction=0.35)


@pytest.fixture(scope="module")
def splits(cfg) -> dict[str, list[dict]]:
    return synthetic.generate(cfg, seed=3)


def test_split_sizes(cfg, splits):
    assert set(splits) == {"sft", "preference", "prompts", "eval", "eval_preference"}
    assert len(splits["sft"]) == cfg.num_sft
    assert len(splits["preference"]) == cfg.num_preference
    assert len(splits["prompts"]) == cfg.num_rl_prompts
    assert len(splits["eval"]) == cfg.num_eval
    assert len(splits["eval_preference"]) == cfg.num_eval


def test_deterministic_for_a_seed(cfg, splits):
    assert synthetic.generate(cfg, seed=3) == splits
    other = synthetic.generate(cfg, seed=4)
    assert other["eval"] != splits["eval"]
    assert other["sft"] != splits["sft"]


def test_eval_set_does_not_depend_on_training_sizes(cfg, splits):
    smaller = synthetic.generate(cfg.model_copy(update={"num_sft": 10, "num_preference": 7, "num_rl_prompts": 3}),
                                 seed=3)
    assert smaller["eval"] == splits["eval"]
    assert smaller["eval_preference"] == splits["eval_preference"]


def test_prompts_have_distinct_digits(cfg, splits):
    for name, records in splits.items():
        for r in records:
            d = _digits(r)
            assert len(d) == cfg.num_digits, name
            assert len(set(d)) == cfg.num_digits, name
            assert all(0 <= x <= 9 for x in d), name


def test_eval_prompts_never_occur_in_training(splits):
    def prompts(name):
        return {tuple(_digits(r)) for r in splits[name]}

    eval_prompts = prompts("eval")
    assert len(eval_prompts) == len(splits["eval"])
    assert prompts("eval_preference") == eval_prompts
    for name in ("sft", "preference", "prompts"):
        assert not eval_prompts & prompts(name), name
    # Training splits do not repeat prompts among themselves either.
    train = [tuple(_digits(r)) for name in ("sft", "preference", "prompts") for r in splits[name]]
    assert len(train) == len(set(train))


def test_answers_are_the_largest_digit(splits):
    for name in ("eval", "prompts"):
        for r in splits[name]:
            assert r["answer"] == str(max(_digits(r)))


def test_preference_pairs(splits):
    for name in ("preference", "eval_preference"):
        for r in splits[name]:
            d = _digits(r)
            assert r["chosen"] == str(max(d))
            assert r["rejected"] != r["chosen"]
            assert r["rejected"] in [str(x) for x in range(10)]


def test_rejected_answers_are_mixed(cfg, splits):
    # A third each: the habit, another digit of the prompt (the habit again with
    # probability 1/(k-1)), a digit absent from the prompt, larger than the
    # maximum where one exists. Binomial std at n=2000 is ~0.011.
    pairs = splits["preference"]
    k = cfg.num_digits
    habit = sum(r["rejected"] == str(_habit(_digits(r))) for r in pairs) / len(pairs)
    absent = [r for r in pairs if int(r["rejected"]) not in _digits(r)]
    assert abs(habit - (1 / 3 + 1 / 3 / (k - 1))) < 0.05
    assert abs(len(absent) / len(pairs) - 1 / 3) < 0.05
    for r in absent:
        d = _digits(r)
        if any(x > max(d) for x in range(10) if x not in d):
            assert int(r["rejected"]) > max(d)


def test_sft_correct_fraction(cfg, splits):
    correct = wrong_is_habit = 0
    for r in splits["sft"]:
        d = _digits(r)
        if r["response"] == str(max(d)):
            correct += 1
        else:
            wrong_is_habit += r["response"] == str(_habit(d))
    n = len(splits["sft"])
    # Binomial std at n=2000, p=0.35 is ~0.011.
    assert abs(correct / n - cfg.sft_correct_fraction) < 0.05
    assert wrong_is_habit == n - correct  # every wrong demonstration shows the habit


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_sft_correct_fraction_extremes(fraction):
    out = synthetic.generate(SyntheticTaskConfig(num_sft=200, num_preference=1, num_rl_prompts=1, num_eval=1,
                                                 sft_correct_fraction=fraction), seed=0)
    correct = [r["response"] == str(max(_digits(r))) for r in out["sft"]]
    assert all(correct) if fraction == 1.0 else not any(correct)


def test_asking_for_more_prompts_than_exist_is_a_config_error():
    # 2 distinct digits: only 90 ordered prompts exist. Refused when the config is read, not in the data stage.
    with pytest.raises(ValueError, match=r"= 103 distinct prompts, but only 90 orderings of 2 distinct digits exist"):
        SyntheticTaskConfig(num_digits=2, num_sft=100, num_preference=1, num_rl_prompts=1, num_eval=1)
    splits = synthetic.generate(SyntheticTaskConfig(num_digits=2, num_sft=87, num_preference=1, num_rl_prompts=1,
                                                    num_eval=1), seed=0)  # all 90: every one drawn once
    prompts = [str(r["prompt"]) for name in ("sft", "preference", "prompts", "eval") for r in splits[name]]
    assert len(prompts) == len(set(prompts)) == 90


@pytest.mark.parametrize(
    "response, answer, ok",
    [("7", "7", True), (" 7\n", "7", True), ("7", " 7 ", True), ("7 ", "8", False), ("77", "7", False),
     ("", "7", False), ("The answer is 7", "7", False),
     ("", None, False)],  # a row without an answer: evaluation passes None, and an empty response is not right
)
def test_check_answer(response, answer, ok):
    assert synthetic.check_answer(response, answer) is ok


def test_render_question():
    assert synthetic.render_question([3, 1, 4]) == "Which digit is largest? 3 1 4"


def test_tokenizer_corpus_is_deterministic():
    a = list(synthetic.tokenizer_corpus(seed=1, n=5))
    assert a == list(synthetic.tokenizer_corpus(seed=1, n=5))
    assert len(a) == 10
    assert a[0].startswith(QUESTION)


# ---- user data: formats ----------------------------------------------------------------


def _jsonl(path: Path, rows: list, blank_lines: bool = False) -> str:
    lines = [json.dumps(r) for r in rows]
    sep = "\n\n" if blank_lines else "\n"
    path.write_text(sep.join(lines) + "\n")
    return str(path)


def _parquet(path: Path, rows: list[dict]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


SFT_ROWS = [{"prompt": "What is 2+2?", "response": "4", "extra": 1}, {"prompt": "Capital of France?", "response": "Paris"}]


def test_jsonl_prompt_response(tmp_path):
    path = _jsonl(tmp_path / "sft.jsonl", SFT_ROWS, blank_lines=True)
    out = load_records(DatasetSource(path=path), "sft")
    assert out == [{"prompt": "What is 2+2?", "response": "4"}, {"prompt": "Capital of France?", "response": "Paris"}]


def test_custom_keys(tmp_path):
    rows = [{"question": "q1", "answer_text": "a1"}]
    path = _jsonl(tmp_path / "sft.jsonl", rows)
    out = load_records(DatasetSource(path=path, prompt_key="question", response_key="answer_text"), "sft")
    assert out == [{"prompt": "q1", "response": "a1"}]


def test_parquet(tmp_path):
    path = _parquet(tmp_path / "sft.parquet", [{"prompt": "p1", "response": "r1"}, {"prompt": "p2", "response": "r2"}])
    assert load_records(DatasetSource(path=path), "sft") == [
        {"prompt": "p1", "response": "r1"}, {"prompt": "p2", "response": "r2"}
    ]


def test_parquet_prompts_with_integer_answers(tmp_path):
    path = _parquet(tmp_path / "p.parquet", [{"prompt": "p1", "answer": 7}, {"prompt": "p2", "answer": 3}])
    assert load_records(DatasetSource(path=path), "prompts") == [
        {"prompt": "p1", "answer": "7"}, {"prompt": "p2", "answer": "3"}
    ]


def test_prompt_rows_keep_their_other_columns_for_environments_and_agents(tmp_path, caplog):
    """An environment's reset(sample) gets the prompt's whole row (README: `self.sample["table"]`), an agent its
    `tools`; an SFT row keeps `tools` (rendered by the chat template) and nothing else. A value JSON cannot
    hold is left out, and said."""
    import datetime

    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    path = _parquet(tmp_path / "p.parquet", [
        {"question": "p1", "answer": 7, "table": {"a": "1"}, "tools": tools, "prompt": "not the prompt",
         "when": datetime.datetime(2026, 1, 1)},
        {"question": "p2", "answer": 3, "table": {"a": "2"}, "tools": tools, "prompt": "no",
         "when": datetime.datetime(2026, 1, 2)}])
    with caplog.at_level("WARNING", logger="alignflow"):
        out = load_records(DatasetSource(path=path, prompt_key="question"), "prompts")
    assert out == [{"prompt": "p1", "answer": "7", "table": {"a": "1"}, "tools": tools},
                   {"prompt": "p2", "answer": "3", "table": {"a": "2"}, "tools": tools}]
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: columns ['when'] are not JSON values (first in rows [1]) and are not kept with the records"]
    sft = _jsonl(tmp_path / "sft.jsonl", [{"prompt": "p", "response": "r", "tools": tools, "extra": 1},
                                          {"prompt": "p", "response": "r", "tools": json.dumps(tools)}])
    assert load_records(DatasetSource(path=sft), "sft") == [{"prompt": "p", "response": "r", "tools": tools}] * 2
    pref = _jsonl(tmp_path / "pref.jsonl", [{"prompt": [{"role": "user", "content": "p"}], "chosen": "c", "rejected": "r",
                                             "tools": tools, "extra": 1}])  # rendered as the policy's prompt is
    assert load_records(DatasetSource(path=pref), "preference") == [
        {"prompt": [{"role": "user", "content": "p"}], "chosen": "c", "rejected": "r", "tools": tools}]
    # tools the chat template could not render: the row and the key, before anything trains
    for bad, says in (("lookup(key)", "'tools' is text that is not JSON"),
                      ({"name": "lookup"}, "'tools' must be a list of tool schemas (objects), got dict")):
        path = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "response": "r"}, {"prompt": "p", "response": "r",
                                                                                 "tools": bad}])
        with pytest.raises(DataError, match=re.escape(f"{path}, row 2: {says}")):
            load_records(DatasetSource(path=path), "sft")


def test_json_list(tmp_path):
    path = tmp_path / "pref.json"
    path.write_text(json.dumps([{"prompt": "p", "chosen": "good", "rejected": "bad"}]))
    assert load_records(DatasetSource(path=str(path)), "preference") == [
        {"prompt": "p", "chosen": "good", "rejected": "bad"}
    ]


def test_json_must_hold_a_list(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"prompt": "p", "response": "r"}))
    with pytest.raises(DataError, match="must hold a list of rows") as err:
        load_records(DatasetSource(path=str(path)), "sft")
    assert str(path) in str(err.value)


CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi?"},
    {"role": "assistant", "content": "Hello."},
]


def test_chat_messages_sft(tmp_path):
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    out = load_records(DatasetSource(path=path, messages_key="messages"), "sft")
    assert out == [{"prompt": CHAT[:2], "response": "Hello."}]


def test_chat_messages_in_parquet(tmp_path):
    path = _parquet(tmp_path / "chat.parquet", [{"messages": CHAT}])
    out = load_records(DatasetSource(path=path, messages_key="messages"), "sft")
    assert out == [{"prompt": CHAT[:2], "response": "Hello."}]


def test_chat_messages_prompts(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"messages": CHAT[:2], "answer": "x"}])
    out = load_records(DatasetSource(path=path, messages_key="messages"), "prompts")
    assert out == [{"prompt": CHAT[:2], "answer": "x"}]


def test_chat_must_end_with_an_assistant_reply(tmp_path):
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}, {"messages": CHAT[:2]}])
    with pytest.raises(DataError) as err:
        load_records(DatasetSource(path=path, messages_key="messages"), "sft")
    assert f"{path}, row 2" in str(err.value)
    assert "'messages'" in str(err.value)


def test_chat_message_without_content(tmp_path):
    bad = [{"role": "user", "content": "q"}, {"role": "assistant"}]
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": bad}])
    with pytest.raises(DataError, match="message 1 needs string 'role' and 'content'"):
        load_records(DatasetSource(path=path, messages_key="messages"), "sft")


def test_a_chat_role_no_template_knows_is_an_error_naming_the_row(tmp_path):
    sharegpt = [{"role": "human", "content": "q"}, {"role": "gpt", "content": "a"}]
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}, {"messages": sharegpt}])
    with pytest.raises(DataError) as err:
        load_records(DatasetSource(path=path, messages_key="messages"), "sft")
    assert str(err.value) == (f"{path}, row 2: key 'messages', message 0 has role 'human', not one of system, user, "
                              "assistant, tool, developer, ipython")


def test_preference_chosen_rejected(tmp_path):
    rows = [
        {"prompt": "p1", "chosen": "c1", "rejected": "r1"},
        # Conversations as chosen/rejected: their last (assistant) turn is the text.
        {"prompt": CHAT[:2], "chosen": [*CHAT[:2], {"role": "assistant", "content": "c2"}],
         "rejected": [*CHAT[:2], {"role": "assistant", "content": "r2"}]},
    ]
    path = _jsonl(tmp_path / "pref.jsonl", rows)
    assert load_records(DatasetSource(path=path), "preference") == [
        {"prompt": "p1", "chosen": "c1", "rejected": "r1"},
        {"prompt": CHAT[:2], "chosen": "c2", "rejected": "r2"},
    ]


def test_prompts_without_answers(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "p"}])
    assert load_records(DatasetSource(path=path), "prompts") == [{"prompt": "p", "answer": None}]
    assert load_records(DatasetSource(path=path, answer_key=None), "prompts") == [{"prompt": "p", "answer": None}]


def test_openrlhf_input_output_keys(tmp_path):
    # OpenRLHF's input_key/output_key columns: named with prompt_key/response_key, never guessed.
    path = _jsonl(tmp_path / "sft.jsonl", [{"input": "q1", "output": "a1"}, {"input": CHAT[:2], "output": "a2"}])
    out = load_records(DatasetSource(path=path, prompt_key="input", response_key="output"), "sft")
    assert out == [{"prompt": "q1", "response": "a1"}, {"prompt": CHAT[:2], "response": "a2"}]
    with pytest.raises(DataError, match=r"row 1: missing key 'prompt'"):
        load_records(DatasetSource(path=path), "sft")


# ---- preference pairs as two whole dialogues (no prompt key) ------------------------------------

HH_CHOSEN = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: how are you?\n\nAssistant: fine, thanks"
HH_REJECTED = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: how are you?\n\nAssistant: go away"


def test_hh_dialogues_split_at_the_last_assistant_marker(tmp_path):
    rows = [
        {"chosen": HH_CHOSEN, "rejected": HH_REJECTED},
        {"chosen": "\n\nHuman: 2+2?\n\nAssistant: 4", "rejected": "\n\nHuman: 2+2?\n\nAssistant:"},
        # A row with the prompt key is prompt/chosen/rejected columns, taken as they are.
        {"prompt": "p", "chosen": "\n\nAssistant: c", "rejected": "r"},
    ]
    path = _jsonl(tmp_path / "hh.jsonl", rows)
    assert load_records(DatasetSource(path=path), "preference") == [
        {"prompt": "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: how are you?\n\nAssistant:",
         "chosen": " fine, thanks", "rejected": " go away"},
        {"prompt": "\n\nHuman: 2+2?\n\nAssistant:", "chosen": " 4", "rejected": ""},
        {"prompt": "p", "chosen": "\n\nAssistant: c", "rejected": "r"},
    ]


def test_hh_dialogues_in_parquet(tmp_path):
    path = _parquet(tmp_path / "hh.parquet", [{"chosen": HH_CHOSEN, "rejected": HH_REJECTED}])
    (record,) = load_records(DatasetSource(path=path), "preference")
    assert record["chosen"] == " fine, thanks"
    assert record["rejected"] == " go away"


def test_hh_custom_marker_and_keys(tmp_path):
    rows = [{"good": "USER: hi ASSISTANT: hey USER: bye ASSISTANT: bye!",
             "bad": "USER: hi ASSISTANT: hey USER: bye ASSISTANT: no"}]
    path = _jsonl(tmp_path / "hh.jsonl", rows)
    src = DatasetSource(path=path, chosen_key="good", rejected_key="bad", assistant_marker=" ASSISTANT:")
    assert load_records(src, "preference") == [
        {"prompt": "USER: hi ASSISTANT: hey USER: bye ASSISTANT:", "chosen": " bye!", "rejected": " no"}
    ]


def test_hh_dialogues_that_differ_before_the_last_reply(tmp_path):
    other = HH_REJECTED.replace("how are you?", "who are you?")
    path = _jsonl(tmp_path / "hh.jsonl", [{"chosen": HH_CHOSEN, "rejected": HH_REJECTED},
                                          {"chosen": HH_CHOSEN, "rejected": other}])
    with pytest.raises(DataError) as err:
        load_records(DatasetSource(path=path), "preference")
    assert str(err.value) == (f"{path}, row 2: keys 'chosen' and 'rejected' differ before their last "
                              "'\\n\\nAssistant:', so they share no prompt")


def test_hh_dialogue_without_the_marker(tmp_path):
    path = _jsonl(tmp_path / "hh.jsonl", [{"chosen": HH_CHOSEN, "rejected": "Human: hi Assistant: no", "id": 7}])
    with pytest.raises(DataError) as err:
        load_records(DatasetSource(path=path), "preference")
    assert str(err.value) == (
        f"{path}, row 1: missing key 'prompt', and key 'rejected' has no '\\n\\nAssistant:' to split its "
        "dialogue at (set prompt_key, or assistant_marker, under data.preference); "
        "this row has keys: ['chosen', 'id', 'rejected']"
    )


def test_assistant_marker_must_not_be_empty():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"assistant_marker\n  String should have at least 1 character"):
        DatasetSource(path="x.jsonl", assistant_marker="")


def _turn(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def test_message_list_pairs_without_a_prompt(tmp_path):
    shared = [_turn("system", "Be brief."), _turn("user", "Hi?"), _turn("assistant", "Hello."), _turn("user", "Name?")]
    rows = [{"chosen": [*shared, _turn("assistant", "Ada.")], "rejected": [*shared, _turn("assistant", "No.")]}]
    path = _jsonl(tmp_path / "pref.jsonl", rows)
    assert load_records(DatasetSource(path=path), "preference") == [
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
                    {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name?"}],
         "chosen": "Ada.", "rejected": "No."}
    ]


@pytest.mark.parametrize(
    "chosen, rejected, text",
    [
        ([_turn("user", "a"), _turn("assistant", "c")], [_turn("user", "b"), _turn("assistant", "r")],
         "row 1: keys 'chosen' and 'rejected' differ before their last message, so they share no prompt"),
        ([_turn("user", "a"), _turn("assistant", "c")], [_turn("user", "a")],
         "row 1: key 'rejected' must end with an assistant message (the reply)"),
        ([_turn("assistant", "c")], [_turn("assistant", "r")],
         "row 1: missing key 'prompt', and keys 'chosen' and 'rejected' hold no message before the reply"),
        ([_turn("user", "a"), {"role": "assistant"}], [_turn("user", "a"), _turn("assistant", "r")],
         "row 1: key 'chosen', message 1 needs string 'role' and 'content'"),
    ],
)
def test_message_list_pairs_that_share_no_prompt(tmp_path, chosen, rejected, text):
    path = _jsonl(tmp_path / "pref.jsonl", [{"chosen": chosen, "rejected": rejected}])
    with pytest.raises(DataError) as err:
        load_records(DatasetSource(path=path), "preference")
    assert str(err.value) == f"{path}, {text}"


def test_conversation_reply_must_come_from_the_assistant(tmp_path):
    # With a prompt key, a conversation's last message is the reply: it must be the assistant's.
    rows = [{"prompt": "p", "chosen": [_turn("user", "p"), _turn("assistant", "c")], "rejected": [_turn("user", "p")]}]
    path = _jsonl(tmp_path / "pref.jsonl", rows)
    with pytest.raises(DataError, match=r"row 1: key 'rejected' must end with an assistant message"):
        load_records(DatasetSource(path=path), "preference")


# ---- user data: errors name file, row and key ---------------------------------------------


@pytest.mark.parametrize("suffix", ["jsonl", "json", "parquet"])
@pytest.mark.parametrize("kind, missing", [("sft", "response"), ("sft", "prompt"), ("preference", "rejected")])
def test_missing_key_names_file_row_and_key(tmp_path, suffix, kind, missing):
    good = {"prompt": "p", "response": "r", "chosen": "c", "rejected": "x"}
    bad = {k: v for k, v in good.items() if k != missing}
    rows = [good, good, bad, good]  # the bad row is row 3
    path = tmp_path / f"data.{suffix}"
    if suffix == "jsonl":
        _jsonl(path, rows)
    elif suffix == "json":
        path.write_text(json.dumps(rows))
    else:
        bad_pq = {**good, missing: None}  # parquet has one schema: a null cell
        _parquet(path, [good, good, bad_pq, good])
    with pytest.raises(DataError) as err:
        load_records(DatasetSource(path=str(path)), kind)
    message = str(err.value)
    assert str(path) in message
    assert "row 3" in message
    assert f"'{missing}'" in message


@pytest.mark.parametrize(
    "row, kind, src, text",
    [
        ({"instruction": "i", "output": "o"}, "sft", {},
         "missing key 'prompt' (or set prompt_key, or messages_key for a chat column, under data.sft); "
         "this row has keys: ['instruction', 'output']"),
        ({"prompt": "p", "completion": "c"}, "sft", {},
         "missing key 'response' (or set response_key under data.sft); this row has keys: ['completion', 'prompt']"),
        ({"prompt": None, "response": "5"}, "sft", {},  # null was said to be missing, beside its own key
         "key 'prompt' is null (or set prompt_key, or messages_key for a chat column, under data.sft); "
         "this row has keys: ['prompt', 'response']"),
        ({"conversation": []}, "sft", {"messages_key": "messages"},
         "missing key 'messages' (or set messages_key under data.sft, or unset it for prompt/response columns); "
         "this row has keys: ['conversation']"),
        ({"question": "q", "good": "g", "bad": "b"}, "preference", {},
         "missing key 'prompt' (set prompt_key under data.preference, or give 'chosen' and 'rejected' as whole "
         "dialogues: both strings containing '\\n\\nAssistant:', or both message lists); "
         "this row has keys: ['bad', 'good', 'question']"),
        ({"prompt": "p", "chosen": "c", "bad": "b"}, "preference", {},
         "missing key 'rejected' (or set rejected_key under data.preference); "
         "this row has keys: ['bad', 'chosen', 'prompt']"),
        ({"text": "t"}, "prompts", {},
         "missing key 'prompt' (or set prompt_key, or messages_key for a chat column, under data.prompts / "
         "data.eval); this row has keys: ['text']"),
        ({"prompt": "p"}, "prompts", {"messages_key": "messages"},
         "missing key 'messages' (or set messages_key under data.prompts / data.eval, or unset it for a prompt "
         "column); this row has keys: ['prompt']"),
    ],
)
def test_row_that_fits_no_shape_lists_its_keys(tmp_path, row, kind, src, text):
    good = {"sft": {"prompt": "p", "response": "r", "messages": CHAT}, "prompts": {"prompt": "p", "messages": CHAT[:2]},
            "preference": {"prompt": "p", "chosen": "c", "rejected": "r"}}[kind]
    path = _jsonl(tmp_path / "data.jsonl", [good, good, row])
    with pytest.raises(DataError) as err:
        load_records(DatasetSource(path=path, **src), kind)
    assert str(err.value) == f"{path}, row 3: {text}"


def test_row_numbers_skip_blank_lines_consistently(tmp_path):
    # Blank lines are not rows: a missing key and a broken line in the same
    # file are numbered the same way.
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "p", "response": "r"}\n\n{"prompt": "p"}\n')
    with pytest.raises(DataError, match=r"row 2: missing key 'response'"):
        load_records(DatasetSource(path=str(path)), "sft")
    path.write_text('{"prompt": "p", "response": "r"}\n\n{"prompt": "p", \n')
    with pytest.raises(DataError, match=r"row 2: not valid JSON"):
        load_records(DatasetSource(path=str(path)), "sft")


def test_a_key_given_twice_in_a_row_is_an_error_naming_the_row(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "p", "response": "r"}\n{"prompt": "a", "prompt": "b", "response": "r"}\n')
    with pytest.raises(DataError) as err:
        load_records(DatasetSource(path=str(path)), "sft")
    assert str(err.value) == (f"{path}, row 2: the key 'prompt' is given twice (JSON keeps the last silently): "
                              "give it once")
    listed = tmp_path / "data.json"
    listed.write_text('[{"prompt": "p", "response": "r", "response": "s"}]')
    with pytest.raises(DataError, match=r"data.json: a row gives the key 'response' twice"):
        load_records(DatasetSource(path=str(listed)), "sft")


def test_non_json_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "p", "response": "r"}\nnot json at all\n')
    with pytest.raises(DataError) as err:
        load_records(DatasetSource(path=str(path)), "sft")
    assert f"{path}, row 2" in str(err.value)
    assert "not valid JSON" in str(err.value)


def test_a_file_that_cannot_be_decoded_is_named_with_its_row(tmp_path):
    """Bytes that are not UTF-8 name the file and the row they are in (each line is decoded alone, not in the
    chunks a text reader decodes ahead); a byte-order mark before the first row is not one of them; a file
    that is not Parquet, or not JSON at all, is named too."""
    rows = [json.dumps({"prompt": f"p{i}", "response": "r"}).encode() for i in range(300)]
    rows[0] = b"\xef\xbb\xbf" + rows[0]  # a BOM
    rows[201] = rows[201].replace(b'"r"', b'"caf\xe9"')  # Latin-1
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\n".join(rows) + b"\n")
    with pytest.raises(DataError) as err:
        load_records(DatasetSource(path=str(path)), "sft")
    assert str(err.value).startswith(f"{path}, row 202: not UTF-8 text (byte 0xe9 at offset ")
    path.write_bytes(b"\n".join(rows[:200]) + b"\n")
    assert len(load_records(DatasetSource(path=str(path)), "sft")) == 200

    path.write_bytes(rows[0].replace(b'"r"', b'"caf\xe9"') + b"\n")  # the BOM and the bad byte in one row
    bad = rows[0].replace(b'"r"', b'"caf\xe9"').index(b"\xe9")
    with pytest.raises(DataError, match=rf"row 1: not UTF-8 text \(byte 0xe9 at offset {bad}\)$"):
        load_records(DatasetSource(path=str(path)), "sft")

    listed = tmp_path / "data.json"
    listed.write_bytes(b'\xef\xbb\xbf[{"prompt": "p", "response": "caf\xe9"}]')
    with pytest.raises(DataError, match=rf"^{re.escape(str(listed))}: not UTF-8 text \(byte 0xe9 at offset 36\)$"):
        load_records(DatasetSource(path=str(listed)), "sft")
    listed.write_text('[{"prompt": "p", "response": "r"},\n oops]')
    with pytest.raises(DataError, match=rf"^{re.escape(str(listed))}: not valid JSON \(.*, line 2\)"):
        load_records(DatasetSource(path=str(listed)), "sft")

    table = tmp_path / "data.parquet"
    table.write_bytes(path.read_bytes())  # JSONL under a Parquet name
    with pytest.raises(DataError, match=rf"^{re.escape(str(table))}: not a Parquet file it can read \(Arrow"):
        load_records(DatasetSource(path=str(table)), "sft")


def test_a_remote_file_is_read_line_by_line_and_its_bad_row_named(moto_s3, monkeypatch):
    """Over S3 (moto over HTTP) as from a local file: every row, in order, and a line that is not UTF-8 named by
    its row."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3.endpoint_url)
    rows = [json.dumps({"prompt": f"p{i}", "response": "r" * (1 + i % 50)}).encode() for i in range(3000)]
    uri = f"s3://{moto_s3.bucket}/data-{id(rows)}.jsonl"
    with moto_s3.fs().open(uri, "wb") as f:
        f.write(b"\n".join(rows) + b"\n")
    assert [r["prompt"] for r in load_records(DatasetSource(path=uri), "sft")] == [f"p{i}" for i in range(3000)]
    rows[2500] = rows[2500].replace(b'"p2500"', b'"p\xff"')
    with moto_s3.fs().open(uri, "wb") as f:
        f.write(b"\n".join(rows) + b"\n")
    with pytest.raises(DataError, match=rf"^{re.escape(uri)}, row 2501: not UTF-8 text \(byte 0xff"):
        load_records(DatasetSource(path=uri), "sft")


@pytest.mark.parametrize(
    "row, kind, key, text",
    [
        ({"prompt": 5, "response": "r"}, "sft", "prompt", "must be a string or a list of chat messages, got int"),
        ({"prompt": "p", "response": 5}, "sft", "response", "must be a string, got int"),
        ({"prompt": "p", "response": ["a", "b"]}, "sft", "response", "must be a string, got list"),
        ({"prompt": "  ", "response": "r"}, "sft", "prompt", "is an empty string"),
        ({"prompt": [], "response": "r"}, "sft", "prompt", "got list"),
        ({"prompt": "p", "chosen": "c", "rejected": {"x": 1}}, "preference", "rejected", "must be a string, got dict"),
        ({"prompt": "p", "answer": ["6", "six"]}, "prompts", "answer", "must be a string or a number (the checker "
                                                                        "and a rule reward get it as text), got list"),
    ],
)
def test_wrong_type(tmp_path, row, kind, key, text):
    path = _jsonl(tmp_path / "data.jsonl", [row])
    with pytest.raises(DataError) as err:
        load_records(DatasetSource(path=path), kind)
    message = str(err.value)
    assert f"{path}, row 1" in message
    assert f"'{key}'" in message
    assert text in message


def test_row_that_is_not_an_object(tmp_path):
    path = _jsonl(tmp_path / "data.jsonl", [{"prompt": "p", "response": "r"}, ["p", "r"]])
    with pytest.raises(DataError, match=r"row 2: a row must be an object, got list"):
        load_records(DatasetSource(path=path), "sft")


@pytest.mark.parametrize("content", ["", "\n\n", "[]"])
def test_empty_dataset(tmp_path, content):
    suffix = "json" if content == "[]" else "jsonl"
    path = tmp_path / f"empty.{suffix}"
    path.write_text(content)
    with pytest.raises(DataError, match="empty") as err:
        load_records(DatasetSource(path=str(path)), "sft")
    assert str(path) in str(err.value)


def test_empty_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "response": pa.array([], pa.string())}), path)
    with pytest.raises(DataError, match="empty"):
        load_records(DatasetSource(path=str(path)), "sft")


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_records(DatasetSource(path=str(tmp_path / "nope.jsonl")), "sft")


# ---- a `datasets` source (a local directory: the json/parquet builders, offline) -------------


@pytest.fixture
def offline_datasets(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    return tmp_path


def test_datasets_source_from_a_local_directory(offline_datasets):
    data_dir = offline_datasets / "my_dataset"
    data_dir.mkdir()
    _jsonl(data_dir / "train.jsonl", [{"prompt": "p1", "chosen": "c1", "rejected": "r1"},
                                      {"prompt": "p2", "chosen": "c2", "rejected": "r2"}])
    _jsonl(data_dir / "test.jsonl", [{"prompt": "t1", "chosen": "c", "rejected": "r"}])
    src = DatasetSource(path=str(data_dir))
    assert load_records(src, "preference") == [
        {"prompt": "p1", "chosen": "c1", "rejected": "r1"}, {"prompt": "p2", "chosen": "c2", "rejected": "r2"}
    ]
    test_split = DatasetSource(path=str(data_dir), split="test")
    assert load_records(test_split, "preference") == [{"prompt": "t1", "chosen": "c", "rejected": "r"}]


def test_datasets_source_bad_row_names_the_source(offline_datasets):
    data_dir = offline_datasets / "chat_dataset"
    data_dir.mkdir()
    _parquet(data_dir / "train.parquet", [{"messages": CHAT}, {"messages": CHAT[:1]}])
    src = DatasetSource(path=str(data_dir), messages_key="messages")
    with pytest.raises(DataError) as err:
        load_records(src, "sft")
    assert f"{data_dir}, row 2" in str(err.value)
    assert "'messages'" in str(err.value)


# ---- canonical JSONL round trip ------------------------------------------------------------


def test_write_and_read_jsonl(tmp_path):
    records = [{"prompt": CHAT[:2], "response": "é"}, {"prompt": "p", "answer": None}]
    path = tmp_path / "out.jsonl"
    load.write_jsonl(records, str(path))
    assert load.read_jsonl(str(path)) == records
    assert len(path.read_text().splitlines()) == 2


def test_synthetic_splits_are_valid_canonical_records(tmp_path, splits):
    # What prepare_data writes for the synthetic task must load as user data.
    kinds = {"sft": "sft", "preference": "preference", "prompts": "prompts", "eval": "prompts",
             "eval_preference": "preference"}
    for name, kind in kinds.items():
        path = tmp_path / f"{name}.jsonl"
        load.write_jsonl(splits[name][:20], str(path))
        assert load_records(DatasetSource(path=str(path)), kind) == splits[name][:20]


def test_unpaired_kto_rows_beside_pairs_go_to_their_own_split(tmp_path):
    from alignflow.config import DataConfig
    from tasks.stages.data import build_splits

    pairs = [{"prompt": f"p{i}", "chosen": f"c{i}", "rejected": f"r{i}"} for i in range(10)]
    unpaired = [{"prompt": "u1", "completion": "good", "thumbs_up": True},
                {"prompt": "u2", "completion": "bad", "thumbs_up": 0}]
    path = _jsonl(tmp_path / "pref.jsonl", pairs[:5] + unpaired + pairs[5:])
    src = DatasetSource(path=path, label_key="thumbs_up", response_key="completion")
    sft = _jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    cfg = DataConfig(source="files", sft=DatasetSource(path=sft), preference=src, eval=DatasetSource(path=sft))
    splits, _ = build_splits(cfg, seed=0)
    assert splits["preference_unpaired"] == [{"prompt": "u1", "response": "good", "label": True},
                                             {"prompt": "u2", "response": "bad", "label": False}]
    assert sorted(splits["preference"] + splits["eval_preference"], key=pairs.index) == pairs
    assert len(splits["eval_preference"]) == 1  # 10 % of the pairs, by prompt

    bad = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "u", "completion": "x", "thumbs_up": "yes"}])
    with pytest.raises(DataError, match=r"bad.jsonl, row 1: key 'thumbs_up' must be true/false"):
        load_records(DatasetSource(path=bad, label_key="thumbs_up", response_key="completion"), "preference")


def test_a_single_preference_pair_trained_on_and_held_out_is_said(tmp_path, caplog):
    from alignflow.config import DataConfig
    from tasks.stages.data import build_splits

    sft = _jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    one = _jsonl(tmp_path / "pref.jsonl", [{"prompt": "p", "chosen": "c", "rejected": "r"}])
    two = _jsonl(tmp_path / "pref2.jsonl", [{"prompt": f"p{i}", "chosen": "c", "rejected": "r"} for i in range(2)])
    for path, warned in ((one, True), (two, False)):
        caplog.clear()
        cfg = DataConfig(source="files", sft=DatasetSource(path=sft), preference=DatasetSource(path=path),
                         eval=DatasetSource(path=sft))
        with caplog.at_level("WARNING", logger="alignflow"):
            splits, _ = build_splits(cfg, seed=0)
        assert len(splits["eval_preference"]) == 1
        assert any("holds one pair: it is both trained on and held out" in r.getMessage()
                   for r in caplog.records) == warned


def test_identical_preference_pairs_are_left_out_counted_and_said(tmp_path, caplog):
    from alignflow.config import DataConfig
    from tasks.stages.data import build_splits

    sft = _jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    pairs = [{"prompt": f"p{i}", "chosen": f"c{i}", "rejected": f"c{i}" if i in (2, 5) else f"r{i}"}
             for i in range(8)]
    path = _jsonl(tmp_path / "pref.jsonl", pairs)
    cfg = DataConfig(source="files", sft=DatasetSource(path=sft), preference=DatasetSource(path=path),
                     eval=DatasetSource(path=sft))
    with caplog.at_level("WARNING", logger="alignflow"):
        splits, left_out = build_splits(cfg, seed=0)
    kept = [p for i, p in enumerate(pairs) if i not in (2, 5)]
    assert sorted(splits["preference"] + splits["eval_preference"], key=pairs.index) == kept
    assert left_out["preference_ties_left_out"] == 2
    assert any(f"{path}: 2 of 8 preference pairs have the same chosen and rejected reply" in r.getMessage()
               for r in caplog.records)

    same = _jsonl(tmp_path / "same.jsonl", [{"prompt": "p", "chosen": "c", "rejected": "c"}])
    cfg = DataConfig(source="files", sft=DatasetSource(path=sft), preference=DatasetSource(path=same),
                     eval=DatasetSource(path=sft))
    with pytest.raises(DataError, match=r"same.jsonl: every preference pair \(1\) has the same chosen"):
        build_splits(cfg, seed=0)


@pytest.mark.parametrize("kind, key, rows", [
    ("prompts", "messages", [{"messages": CHAT[:2]}, {"messages": CHAT}]),
    ("sft", "prompt", [{"prompt": "q", "response": "a"}, {"prompt": CHAT, "response": "again"}]),
    ("preference", "prompt", [{"prompt": "q", "chosen": "a", "rejected": "b"},
                              {"prompt": CHAT, "chosen": "a", "rejected": "b"}]),
])
def test_a_prompt_ending_with_the_reply_is_an_error_naming_the_row(tmp_path, kind, key, rows):
    # A dialogue column given as RL prompts would show the policy the reply it is to write.
    path = _jsonl(tmp_path / "rows.jsonl", rows)
    src = DatasetSource(path=path, messages_key="messages" if key == "messages" else None)
    with pytest.raises(DataError) as err:
        load_records(src, kind)
    assert str(err.value).startswith(f"{path}, row 2: key {key!r} ends with an assistant message: a prompt ends "
                                     "before the reply it asks for")


@pytest.mark.parametrize("kind, row, key", [
    ("sft", {"prompt": "q", "response": "  "}, "response"),
    ("preference", {"prompt": "q", "chosen": "", "rejected": "b"}, "chosen"),
    ("preference", {"prompt": "q", "chosen": "a", "rejected": [{"role": "user", "content": "q"},
                                                               {"role": "assistant", "content": ""}]}, "rejected"),
])
def test_an_empty_reply_is_an_error_naming_the_row(tmp_path, kind, row, key):
    path = _jsonl(tmp_path / "rows.jsonl", [row])
    with pytest.raises(DataError, match=rf"rows.jsonl, row 1: key '{key}' (is an|ends with an) empty"):
        load_records(DatasetSource(path=path), kind)


def test_an_empty_reply_in_a_dialogue_is_an_error(tmp_path):
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": [*CHAT[:2], {"role": "assistant", "content": " "}]}])
    with pytest.raises(DataError, match=r"chat.jsonl, row 1: key 'messages' ends with an empty assistant message"):
        load_records(DatasetSource(path=path, messages_key="messages"), "sft")


# ---- replies given as conversations must continue their prompt ----------------------------


def test_ultrafeedback_pairs_take_the_conversation_as_their_prompt(tmp_path):
    """UltraFeedback-binarized: a prompt string beside [user, assistant] replies. The prompt becomes the
    messages, so the chat template renders it as it renders SFT and RL prompts (it was the raw string)."""
    ask = [_turn("system", "Be brief."), _turn("user", "What is 2+2?")]
    rows = [{"prompt": "What is 2+2?", "chosen": [*ask, _turn("assistant", "4")],
             "rejected": [*ask, _turn("assistant", "5")]},
            {"prompt": [_turn("user", "Hi?")], "chosen": [_turn("user", "Hi?"), _turn("assistant", "Hello.")],
             "rejected": [_turn("assistant", "Go away.")]}]
    path = _jsonl(tmp_path / "pref.jsonl", rows)
    assert load_records(DatasetSource(path=path), "preference") == [
        {"prompt": ask, "chosen": "4", "rejected": "5"},
        {"prompt": [_turn("user", "Hi?")], "chosen": "Hello.", "rejected": "Go away."},
    ]


@pytest.mark.parametrize(
    "row, text",
    [
        ({"prompt": "What is 2+2?", "chosen": [_turn("user", "Write a poem"), _turn("assistant", "4")],
          "rejected": [_turn("assistant", "5")]},
         "row 1: key 'chosen' continues a conversation that is not key 'prompt'"),
        ({"prompt": "What is 2+2?", "chosen": [_turn("user", "What is 2+2?"), _turn("assistant", "4")],
          "rejected": [_turn("user", "Say hi"), _turn("assistant", "5")]},
         "row 1: keys 'chosen' and 'rejected' differ before their last message, so they answer different prompts"),
        ({"prompt": [_turn("user", "a")], "chosen": [_turn("user", "b"), _turn("assistant", "c")],
          "rejected": "r"},
         "row 1: key 'chosen' continues a conversation that is not key 'prompt'"),
        ({"chosen": [_turn("user", "a"), _turn("assistant", "b"), _turn("assistant", "c")],
          "rejected": [_turn("user", "a"), _turn("assistant", "b"), _turn("assistant", "d")]},
         "row 1: key 'chosen' has another assistant message right before its reply"),
    ],
)
def test_pairs_whose_replies_answer_another_prompt_fail(tmp_path, row, text):
    path = _jsonl(tmp_path / "pref.jsonl", [row])
    with pytest.raises(DataError) as err:
        load_records(DatasetSource(path=path), "preference")
    assert str(err.value).startswith(f"{path}, {text}"), str(err.value)


def test_a_conversations_prompt_ends_before_a_reply(tmp_path):
    rows = [{"messages": [_turn("user", "a"), _turn("assistant", "b"), _turn("assistant", "c")]}]
    path = _jsonl(tmp_path / "sft.jsonl", rows)
    with pytest.raises(DataError, match=r"sft.jsonl, row 1: key 'messages' has another assistant message right "
                                        r"before its reply"):
        load_records(DatasetSource(path=path, messages_key="messages"), "sft")


def test_held_out_pairs_are_whole_prompts_drawn_by_the_seed(tmp_path, caplog):
    """HH and SHP keep a prompt's pairs side by side: a cut by row trained on held-out prompts, and a file
    sorted by source held out its last source only."""
    from tasks.stages.data import held_out_pairs

    pairs = [{"prompt": f"p{i // 2}", "chosen": f"c{i}", "rejected": f"r{i}"} for i in range(40)]  # 2 per prompt
    pairs.append({"prompt": [_turn("user", "p0")], "chosen": "c", "rejected": "r"})  # messages: another prompt
    draws = []
    for seed in range(8):
        trained, held = held_out_pairs(pairs, seed)
        assert sorted(trained + held, key=pairs.index) == pairs and trained == sorted(trained, key=pairs.index)
        assert not {json.dumps(r["prompt"]) for r in held} & {json.dumps(r["prompt"]) for r in trained}
        assert 4 <= len(held) <= 5  # 10 % of the pairs, in whole prompts
        assert held_out_pairs(pairs, seed) == (trained, held)  # the seed decides
        draws.append({json.dumps(r["prompt"]) for r in held})
    assert len({frozenset(d) for d in draws}) > 4 and set().union(*draws) - {'"p19"', '"p20"'}  # not the file's end

    caplog.clear()
    same = [{"prompt": "p", "chosen": f"c{i}", "rejected": "r"} for i in range(10)]
    with caplog.at_level("WARNING", logger="alignflow"):
        assert held_out_pairs(same, 0) == (same[:9], same[9:])
    assert any("10 pairs have 1 prompt(s), none of whose pairs fit a 10 % hold-out" in r.getMessage()
               for r in caplog.records)
    # Two prompts of 50 pairs: holding one out took half the data; no prompt fits, the last 10 % are held out.
    two = [{"prompt": f"p{i // 50}", "chosen": f"c{i}", "rejected": "r"} for i in range(100)]
    assert [len(s) for s in held_out_pairs(two, 0)] == [90, 10]
    # A prompt of 90 pairs among ten of one: passed over, whatever the draw; the small ones make the 10 %.
    big = [{"prompt": "big", "chosen": f"c{i}", "rejected": "r"} for i in range(90)] + [
        {"prompt": f"s{i}", "chosen": "c", "rejected": "r"} for i in range(10)]
    for seed in range(5):
        trained, held = held_out_pairs(big, seed)
        assert 9 <= len(held) <= 10 and all(r["prompt"] != "big" for r in held)  # one prompt always trains


def test_a_null_float_answer_is_no_answer(tmp_path):
    """A missing value in a float column reads as NaN (Parquet through pandas, JSON's NaN): no answer, not "nan",
    which the checks for unanswered rows would miss and every checker would score as wrong."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "p", "answer": NaN}\n{"prompt": "q", "answer": 72.0}\n')
    assert load_records(DatasetSource(path=str(path)), "prompts") == [{"prompt": "p", "answer": None},
                                                                      {"prompt": "q", "answer": "72.0"}]


def test_eval_prompts_also_trained_on_are_counted_and_said(tmp_path, caplog):
    """Held-out prompts found in a training split: their accuracy is partly recall. Counted and said, not removed.
    A prompt is its row but its answer and replies: another environment state is another prompt."""
    from alignflow.config import DataConfig
    from tasks.stages.data import build_splits, seen_in_training

    sft = _jsonl(tmp_path / "sft.jsonl", [{"prompt": "2+2?", "response": "4"}, {"prompt": "3+3?", "response": "6"}])
    ev = _jsonl(tmp_path / "eval.jsonl", [{"prompt": "5+5?", "answer": "10"}, {"prompt": "3+3?", "answer": "6"},
                                          {"prompt": "2+2?", "answer": "4", "id": 17}])
    pref = _jsonl(tmp_path / "pref.jsonl", [{"prompt": "7+7?", "chosen": "14", "rejected": "15"}])
    cfg = DataConfig(source="files", sft=DatasetSource(path=sft), eval=DatasetSource(path=ev),
                     preference=DatasetSource(path=pref))
    with caplog.at_level("WARNING", logger="alignflow"):
        splits, counted = build_splits(cfg, seed=0)
    assert counted == {"preference_ties_left_out": 0, "eval_prompts_in_training": 2}  # an id column aside
    assert [r["prompt"] for r in splits["eval"]] == ["5+5?", "3+3?", "2+2?"]  # kept
    assert any("data.eval: 2 of 3 prompts are in a training split too (the first: eval rows [2, 3])" in r.getMessage()
               for r in caplog.records)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    other = {"sft": [{"prompt": "q", "response": "r", "tools": tools}], "prompts": [], "preference": [],
             "preference_unpaired": [], "eval": [{"prompt": "q", "answer": "a"}, {"prompt": "q", "tools": tools}]}
    assert seen_in_training(other) == 1  # shown other tools, the same text is another prompt


def test_an_unpaired_reply_given_as_a_conversation_continues_its_prompt(tmp_path):
    """KTO's unpaired rows as pairs are: a conversation reply's context becomes the prompt, or fails the row."""
    rows = [{"prompt": "Q?", "completion": [_turn("user", "Q?"), _turn("assistant", "A")], "ok": True},
            {"prompt": "Q?", "completion": [_turn("user", "OTHER question"), _turn("assistant", "A")], "ok": False}]
    path = _jsonl(tmp_path / "kto.jsonl", rows[:1])
    src = DatasetSource(path=path, label_key="ok", response_key="completion")
    assert load_records(src, "preference") == [{"prompt": [_turn("user", "Q?")], "response": "A", "label": True}]
    bad = _jsonl(tmp_path / "bad.jsonl", rows[1:])
    with pytest.raises(DataError, match=r"bad.jsonl, row 1: key 'completion' continues a conversation that is not "
                                        r"key 'prompt'"):
        load_records(DatasetSource(path=bad, label_key="ok", response_key="completion"), "preference")
