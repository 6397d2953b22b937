"""End to end: configs/judge.yaml, small: the judge stage (SFT on verdicts), its held-out evaluation, and a
GRPO round rewarded by the judge alone, through the CLI, as `alignflow run configs/judge.yaml` runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from e2e_cli import stage_runs

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


def test_a_judge_trained_evaluated_and_rewarding_a_round(small_pipeline_args, cli_env, alignflow_cli, tmp_path):
    round_ = {"algorithm": "grpo", "steps": 2, "prompts_per_step": 8, "ppo": {"epochs": 1, "minibatch_size": 16},
              "generation": {"num_samples": 2, "max_new_tokens": 8},
              "reward": {"source": "judge", "judge": {"generation": {"max_model_len": 100}}}}
    config = [str(REPO / "configs" / "judge.yaml"), *small_pipeline_args(tmp_path, rounds=0),
              "judge.max_steps=8", "judge.batch_size=16", f"rounds={json.dumps([round_])}"]
    res = alignflow_cli(["stage", "rl", *config], env=cli_env(), cwd=tmp_path)
    assert res.returncode == 0, res.describe()
    evaluated = alignflow_cli(["stage", "eval_judge", *config], env=cli_env(), cwd=tmp_path)
    assert evaluated.returncode == 0, evaluated.describe()

    runs = stage_runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert {"sft", "judge", "round_1", "eval_judge"} <= set(runs) and "reward_model" not in runs, sorted(runs)
    assert all(r.info.status == "FINISHED" for r in runs.values()), {n: r.info.status for n, r in runs.items()}
    m = runs["round_1"].data.metrics
    assert m["rl/steps"] == 2 and m["rl/reward/task_mean"] == pytest.approx(m["rl/reward/judge"], abs=1e-6)
    # Every sample's verdict was asked in the 100 positions given (none too long), and each verdict is counted.
    assert m["rl/judge/positions"] == 100 and m["rl/judge/overlong"] == 0 and m["rl/judge/verdicts_per_s"] > 0
    assert 0 <= m["rl/judge/unscored"] <= m["rl/judge/unparsed"] <= 16

    e = runs["eval_judge"].data.metrics
    pairs = len([line for line in (tmp_path / "artifacts").glob("data/*/eval_preference.jsonl")
                 for line in line.read_text().splitlines() if line.strip()])
    assert pairs > 0 and e["eval/judge_verdicts"] == 2 * pairs  # both responses of every held-out pair
    assert 0 <= e["eval/judge_verdict_accuracy"] <= 1 and 0 <= e["eval/judge_unparsed"] <= e["eval/judge_verdicts"]
    # Its engine holds its longest prompt and a verdict, no more: fewer than the model's 128 positions, and
    # not one prompt over them.
    assert e["eval/judge_overlong"] == 0 and 4 < e["eval/judge_positions"] < 128, e
