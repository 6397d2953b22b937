"""The data stage measures every split in tokens and settles the limits, before any training.

A chat preference set whose answers differ only after the 16th token: with
an explicit `data.max_response_tokens=16` the data stage fails (the pairs
would become identical); with the default `auto` every pair is kept whole
and the limits are in the stage's metrics. Real base_model and data stages
on a local root; nothing else starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alignflow.config import load_config
from alignflow.errors import ConfigError, DataError
from engines.models import load_tokenizer
from tasks.context import RunContext
from tasks.plan import plan_pipeline
from tasks.runner import run_stage

SHARED = "the largest digit is " + "very clearly and without any doubt at all " * 2


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def files(tmp_path: Path) -> list[str]:
    chat = [{"role": "user", "content": f"{i} {i + 1}: which is largest?"} for i in range(6)]
    pairs = [{"prompt": [m], "chosen": SHARED + "nine", "rejected": SHARED + "one"} for m in chat]
    return [
        "data.source=files",
        f"data.sft.path={_write(tmp_path / 'sft.jsonl', [{'prompt': m['content'], 'response': '9'} for m in chat])}",
        f"data.preference.path={_write(tmp_path / 'pref.jsonl', pairs)}",
        f"data.eval.path={_write(tmp_path / 'eval.jsonl', [{'prompt': 'a b', 'answer': 'b'}])}",
        f"infra.storage.root={tmp_path / 'artifacts'}", f"infra.storage.cache_dir={tmp_path / 'cache'}",
        f"infra.mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
    ]


def _data_stage(overrides: list[str]):
    cfg = load_config(None, overrides)
    plan = plan_pipeline(cfg)
    ctx = RunContext(infra=cfg.infra)
    model = run_stage(plan.stages["base_model"], {}, ctx)
    return model, lambda: run_stage(plan.stages["data"], {"model": model}, ctx)


def test_an_explicit_length_that_would_merge_pairs_fails_in_the_data_stage(files, tmp_path):
    model, run = _data_stage([*files, "data.max_response_tokens=16"])
    tok = load_tokenizer(model.uri)
    longest = len(tok(SHARED + "nine", add_special_tokens=False)["input_ids"]) + 1
    assert longest > 16
    with pytest.raises(DataError) as err:
        run()
    assert str(err.value).startswith("preference: 5 of 5 responses are longer than data.max_response_tokens=16")
    assert f"set data.max_response_tokens={longest}" in str(err.value)
    assert not (tmp_path / "artifacts" / "data").exists() or not list((tmp_path / "artifacts" / "data").glob("*/manifest.json"))


def test_auto_keeps_every_pair_whole_and_reports_the_lengths(files):
    model, run = _data_stage(files)
    result = run()
    tok = load_tokenizer(model.uri)
    longest = len(tok(SHARED + "nine", add_special_tokens=False)["input_ids"]) + 1
    m = result.metrics
    assert m["data/max_response_tokens"] == longest == m["data/preference_response_tokens_max"]
    assert m["data/preference_responses_cut"] == 0 and m["data/sft_responses_cut"] == 0
    prompts = [len(tok.apply_chat_template([{"role": "user", "content": f"{i} {i + 1}: which is largest?"}],
                                           add_generation_prompt=True, tokenize=True)["input_ids"]) for i in range(6)]
    assert m["data/max_prompt_tokens"] == max(prompts)


def test_generation_leaves_out_prompts_with_no_room_for_the_new_tokens(files, caplog):
    from tasks.stages.data import TokenLimits

    model, _ = _data_stage(files)
    limits = TokenLimits(prompt=100, response=4)  # the tiny model has 128 positions
    assert limits.for_generation(8, model.uri, "round_1: ") == (100, 108)
    assert limits.for_generation(40, model.uri, "round_1: ") == (88, 128)
    assert "round_1: generation.max_new_tokens=40: prompts over 88 tokens (of up to 100) are left out" in caplog.text
    with pytest.raises(ConfigError, match=r"^evaluation.generation.max_new_tokens=128 leaves no room for a prompt"):
        limits.for_generation(128, model.uri, "evaluation.")


def test_without_preference_data_the_data_stage_writes_no_pairs(files, tmp_path):
    """SFT then GRPO on a rule: nothing reads preference pairs, so data.preference may be left out (it was
    required with source: files); where a stage does read them, the config says which and how to go on."""
    rounds = 'rounds=[{"algorithm": "grpo", "reward": {"source": "rule"}}]'
    without = [o for o in files if not o.startswith("data.preference")] + ["data.preference=null"]
    with pytest.raises(ConfigError, match=r"data.preference: not given, but reward_model trains on preference pairs: "
                                          r"give data.preference, or set reward_model: null with every round"):
        load_config(None, without)
    _, run = _data_stage([*without, "reward_model=null", rounds])
    result = run()
    stored = next((tmp_path / "artifacts" / "data").glob("*/manifest.json")).parent
    assert result.metrics["data/preference_rows"] == result.metrics["data/eval_preference_rows"] == 0
    assert (stored / "preference.jsonl").read_text() == "" and result.metrics["data/sft_rows"] == 6
