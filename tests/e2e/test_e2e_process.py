"""End to end: configs/prm.yaml, small: the bundled task's step-labelled solutions, a process reward model trained
on them and its held-out evaluation, through the CLI, as `alignflow stage eval_process_reward_model
configs/prm.yaml` runs them; then a GRPO round rewarded by the model, which comes from cache, and one of its
dense step rewards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from e2e_cli import stage_json, stage_runs

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


def test_a_process_reward_model_trained_on_step_labels_finds_wrong_steps_on_held_out_solutions(
        small_pipeline_args, cli_env, alignflow_cli, tmp_path):
    # From the base model (no SFT: the stage needs only its own data), 900 solutions, 3 epochs of 32: 84 steps.
    config = [str(REPO / "configs" / "prm.yaml"), *small_pipeline_args(tmp_path, rounds=0), "sft=null",
              "reward_model=null", "data.synthetic.num_process=1000", "process_reward_model.log_every=10"]
    res = alignflow_cli(["stage", "eval_process_reward_model", *config], env=cli_env(), cwd=tmp_path)
    assert res.returncode == 0, res.describe()
    m = stage_json(res.stdout)["eval_process_reward_model"]["metrics"]

    held = [json.loads(line) for path in (tmp_path / "artifacts").glob("process_data/*/eval_process.jsonl")
            for line in path.read_text().splitlines()]
    labels = [y for row in held for y in row["labels"]]
    assert len(held) == 100 and m["data/eval_process_rows"] == 100 and m["eval/prm_steps"] == len(labels) == 500
    assert m["eval/prm_positive_fraction"] == pytest.approx(sum(labels) / len(labels))
    # Better than saying "right" at every step, and than chance on whole solutions (about half slip once).
    assert m["eval/prm_step_accuracy"] > m["eval/prm_positive_fraction"] + 0.03, m
    assert m["eval/prm_solution_accuracy"] > 0.6 and 0.0 < m["eval/prm_first_error_accuracy"] <= 1.0, m

    runs = stage_runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert set(runs) == {"base_model", "process_data", "process_reward_model", "eval_process_reward_model"}, runs
    trained = runs["process_reward_model"].data.metrics
    assert trained["train/steps"] == 84 and trained["data/process_rows"] == 900
    assert trained["data/process_steps_cut"] == 0
    assert trained["train/final_step_accuracy"] > 0.8, trained

    # A round rewarded by it, the model from cache (nothing of it runs again), in a scorer of its own: each
    # response's weakest step. One step, no KL term: the fewest actors that show the wiring.
    round_ = {"algorithm": "grpo", "steps": 1, "prompts_per_step": 8, "ppo": {"epochs": 1, "minibatch_size": 16},
              "kl": {"coef": 0.0}, "generation": {"num_samples": 2, "max_new_tokens": 8},
              "reward": {"source": "process_model"}}
    # Then a round of dense step rewards: each step's score at its last token, DeepSeekMath's process advantage.
    dense = {**round_, "generation": {"num_samples": 2, "max_new_tokens": 48},
             "reward": {"source": "process_model", "dense": True}}
    rl = alignflow_cli(["stage", "rl", *config, f"rounds={json.dumps([round_, dense])}"], env=cli_env(), cwd=tmp_path)
    assert rl.returncode == 0, rl.describe()
    planned = {line.split()[0]: line for line in rl.stdout.splitlines()  # the plan's rows
               if line.startswith("  ") and ("Cached" in line or "will run" in line)}
    assert all(planned[n].endswith("Cached") for n in ("base_model", "process_data", "process_reward_model")), rl.stdout
    runs = stage_runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert set(runs) == {"base_model", "process_data", "process_reward_model", "eval_process_reward_model", "data",
                         "round_1", "round_2"}, sorted(runs)
    r = runs["round_1"].data.metrics
    assert r["rl/steps"] == 1 and r["rl/reward/task_mean"] == pytest.approx(r["rl/reward/process_model"], abs=1e-6)
    assert r["rl/reward/process_model"] != 0.0, r  # scored
    assert 0 <= r["rl/process/responses_without_steps"] <= 16, r  # counted: each of them scores no_step_reward
    # Dense: no sequence reward at all (the task reward is 0 for every response), so GRPO's outcome advantage is 0
    # and only the step rewards can move it; a response without a step is one step of no_step_reward.
    d = runs["round_2"].data.metrics
    assert d["rl/reward/task_mean"] == 0.0 and d["rl/reward/std"] == 0.0, d
    assert d["rl/process/responses_without_steps"] < 16 and d["rl/process/steps_per_response"] > 0, d  # some steps
    assert d["rl/advantage/mean"] != 0.0, d
