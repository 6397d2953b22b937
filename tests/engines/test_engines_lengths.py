"""Token lengths per split, and the limits they settle: nothing cut unless allowed, and then counted.

Expected lengths come from the tokenizer called directly in the test (plus
one EOS per response); percentiles and limits are written out by hand.
"""

from __future__ import annotations

import pytest

from alignflow.config import DataConfig
from alignflow.errors import DataError
from engines.lengths import Limits, SplitLengths, describe, measure, percentile, resolve


def _n(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_percentiles_are_nearest_rank():
    values = [5, 1, 4, 2, 3, 10, 7, 6, 9, 8]
    assert (percentile(values, 50), percentile(values, 95), percentile(values, 100)) == (5, 10, 10)
    assert percentile([3], 50) == 3


def test_measure_counts_prompt_and_the_longer_response_with_eos(tokenizer):
    splits = {
        "preference": [{"prompt": "which is larger", "chosen": "the first one, clearly", "rejected": "no"}],
        "eval": [{"prompt": "a b c", "answer": "c"}, {"prompt": "a", "answer": None}],
    }
    m = measure(tokenizer, splits)
    assert m["preference"] == SplitLengths(prompt=[_n(tokenizer, "which is larger")],
                                           response=[_n(tokenizer, "the first one, clearly") + 1])
    assert m["eval"] == SplitLengths(prompt=[_n(tokenizer, "a b c"), _n(tokenizer, "a")], response=[0, 0])
    assert "response_tokens_max" not in m["eval"].stats()


PREF = SplitLengths(prompt=[4, 6, 5], response=[3, 30, 12])
SFT = SplitLengths(prompt=[8, 2], response=[2, 5])


def test_auto_keeps_every_row():
    limits = resolve(DataConfig(), {"sft": SFT, "preference": PREF}, positions=128)
    assert limits == Limits(8, 30, left_out={"sft": 0, "preference": 0}, cut={"sft": 0, "preference": 0})
    assert limits.metrics()["data/max_response_tokens"] == 30.0


def test_an_explicit_length_that_cuts_pairs_fails_naming_the_field_and_the_length_needed():
    cfg = DataConfig(max_response_tokens=16)
    with pytest.raises(DataError) as err:
        resolve(cfg, {"sft": SFT, "preference": PREF}, positions=128)
    assert str(err.value) == (
        "preference: 1 of 3 responses are longer than data.max_response_tokens=16 and would be cut "
        "(allowed: data.max_cut_fraction.preference=0); the longest needs 30 tokens: "
        "set data.max_response_tokens=30, or allow the cut")


def test_an_allowed_cut_is_counted_per_split():
    # Rows left out for their prompts (sft's first, preference's second) are not trained on: not cut either.
    cfg = DataConfig(max_response_tokens=4, max_prompt_tokens=5, max_cut_fraction={"sft": 1.0, "preference": 0.5})
    limits = resolve(cfg, {"sft": SFT, "preference": PREF}, positions=128)
    assert limits == Limits(5, 4, left_out={"sft": 1, "preference": 1}, cut={"sft": 1, "preference": 1})
    lines = describe({"sft": SFT, "preference": PREF}, limits)
    assert lines[0] == "token limits: prompt 5, response 4"
    assert lines[1] == "  sft: 2 rows, prompt p50/p95/max 2/8/8, response 2/5/5; 1 prompts over the limit left out; " \
                       "1 responses cut"


def test_a_row_left_out_for_its_prompt_does_not_count_as_cut():
    # The second row's prompt is over the limit: it is left out, and its 30-token response with it.
    lengths = {"sft": SplitLengths(prompt=[4, 60], response=[5, 30])}
    limits = resolve(DataConfig(max_prompt_tokens=50, max_response_tokens=20), lengths, positions=128)
    assert (limits.left_out, limits.cut) == ({"sft": 1}, {"sft": 0})
    assert resolve(DataConfig(max_prompt_tokens=50), lengths, positions=128).max_response_tokens == 5  # auto: kept rows
    with pytest.raises(DataError, match=r"^sft: 1 of 1 responses are longer than data.max_response_tokens=4 .* the "
                                        r"longest needs 5 tokens"):
        resolve(DataConfig(max_prompt_tokens=50, max_response_tokens=4), lengths, positions=128)


def test_auto_is_bounded_by_the_model_positions():
    with pytest.raises(DataError, match=r"the longest needs 30 tokens: the model's 20 positions cannot hold them "
                                        r"after 8-token prompts"):
        resolve(DataConfig(), {"sft": SFT, "preference": PREF}, positions=20)
    cfg = DataConfig(max_cut_fraction={"preference": 1.0})
    assert resolve(cfg, {"sft": SFT, "preference": PREF}, positions=20).max_response_tokens == 12


def test_explicit_lengths_beyond_the_positions_fail():
    with pytest.raises(DataError, match=r"^data.max_prompt_tokens=8 \+ data.max_response_tokens=64 exceed the "
                                        r"model's 32 positions$"):
        resolve(DataConfig(max_prompt_tokens=8, max_response_tokens=64), {"sft": SFT}, positions=32)
    with pytest.raises(DataError, match="data.max_prompt_tokens=32 leaves no room"):
        resolve(DataConfig(max_prompt_tokens=32), {"sft": SFT}, positions=32)


def test_the_config_takes_auto_or_a_positive_count():
    assert DataConfig().max_prompt_tokens == "auto"
    assert DataConfig(max_prompt_tokens=7).max_prompt_tokens == 7
    with pytest.raises(ValueError):
        DataConfig(max_response_tokens=0)
    with pytest.raises(ValueError):
        DataConfig(max_response_tokens="longest")


def test_a_chat_template_refusing_a_record_names_it(tokenizer):
    """Templates refuse some conversations (Gemma's a system role, Llama-2's turns out of order) with a bare
    jinja TemplateError: the data stage, the first to render prompts, names the split and record instead."""
    import copy

    strict = copy.deepcopy(tokenizer)
    strict.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                            "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}{% endfor %}")
    ok = {"prompt": [{"role": "user", "content": "2+2?"}], "response": "4"}
    bad = {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
           "response": "4"}
    assert measure(strict, {"sft": [ok]})["sft"].prompt == [len(strict.apply_chat_template(
        ok["prompt"], add_generation_prompt=True, tokenize=True)["input_ids"])]
    with pytest.raises(DataError) as err:
        measure(strict, {"sft": [ok, bad]})
    assert str(err.value) == ("data split 'sft', record 2 (starting system: 'Be brief.'): the tokenizer's chat "
                              "template refuses its messages: System role not supported")


def test_a_tokenizer_without_a_chat_template_names_the_record(tokenizer):
    import copy

    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(DataError, match=r"data split 'sft', record 1 \(starting user: '2\+2\?'\): the tokenizer's "
                                        r"chat template refuses its messages: "):
        measure(bare, {"sft": [{"prompt": [{"role": "user", "content": "2+2?"}], "response": "4"}]})


def test_a_step_labelled_solution_is_measured_a_step_at_a_time_and_a_cut_is_said_not_refused(tokenizer, caplog):
    steps = ["first, 12 + 30\n", "= 42\n"]
    m = measure(tokenizer, {"process": [{"prompt": "add", "steps": steps, "labels": [True, True]}]})
    # No EOS: a solution is scored at its steps' ends. Each step on its own: the newline never merges onward.
    assert m["process"] == SplitLengths(prompt=[_n(tokenizer, "add")], response=[sum(_n(tokenizer, s) for s in steps)])
    lengths = {"process": SplitLengths(prompt=[2, 2], response=[9, 3]), "sft": SFT}
    with caplog.at_level("WARNING", logger="alignflow"):
        limits = resolve(DataConfig(max_response_tokens=5), lengths, positions=64)
    assert limits.cut == {"process": 1, "sft": 0}
    assert "process: 1 of 2 solutions are longer than data.max_response_tokens=5" in caplog.text
    assert resolve(DataConfig(), lengths, positions=64).max_response_tokens == 9  # auto covers the solutions
