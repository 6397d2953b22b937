"""End to end: configs/agent.yaml, small: SFT on tool-use traces, a GRPO round of episodes in a user's
`module:Class` environment, a second driven by a user's `module:function` agent through the engines'
OpenAI-compatible endpoint, and every policy evaluated in episodes of the bundled environment."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
from e2e_cli import mlflow_client, parse_table, stage_runs

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]

USER_ENV = '''
import json

from alignflow.agents.boxes import OPEN_BOX, BoxesEnvironment


class Paid(BoxesEnvironment):
    """The bundled task, with 0.1 of reward for each tool call, at the end of the turn that made it."""

    def step(self, message):
        obs, reward, done, info = super().step(message)
        return obs, reward + 0.1 * info.get("tool_calls", 0), done, info


def agent(client, sample):
    """The same task as an agent's own loop against the OpenAI-compatible endpoint."""
    messages = list(sample["prompt"])
    for _ in range(3):
        choice = client.chat.completions.create(model="policy", messages=messages, tools=[OPEN_BOX],
                                                max_tokens=40).choices[0]
        messages.append({"role": "assistant", "content": choice.message.content})
        if not choice.message.tool_calls:
            break
        box = json.loads(choice.message.tool_calls[0].function.arguments).get("box")
        messages.append({"role": "tool", "content": str(sample["boxes"].get(str(box), "no such box"))})
    return float(messages[-1]["role"] == "assistant" and messages[-1]["content"].strip() == sample["answer"])
'''


def test_an_agent_pipeline_with_a_user_environment_learns_from_episodes(cli_env, alignflow_cli, tmp_path):
    src = tmp_path / "env_src"
    src.mkdir()
    (src / "e2e_user_env.py").write_text(textwrap.dedent(USER_ENV))
    env = cli_env(PYTHONPATH=os.pathsep.join(p for p in (str(src), os.environ.get("PYTHONPATH")) if p))
    round_ = {"algorithm": "grpo", "steps": 2, "prompts_per_step": 8, "reward": {"source": "environment"},
              "generation": {"num_samples": 4, "max_new_tokens": 40}, "ppo": {"epochs": 1, "minibatch_size": 32},
              "environment": {"name": "e2e_user_env:Paid", "max_turns": 3, "max_episode_tokens": 96}}
    agent_round = {**round_, "environment": {"agent": "e2e_user_env:agent", "max_episode_tokens": 96}}
    args = ["run", str(REPO / "configs" / "agent.yaml"), "data.synthetic.num_sft=600", "data.synthetic.num_eval=24",
            "data.synthetic.num_rl_prompts=32", "sft.max_steps=60", "sft.train_on=assistant_turns", "evaluation.generation.num_samples=2",
            f"rounds={json.dumps([round_, agent_round])}", f"infra.storage.root={tmp_path / 'artifacts'}",
            f"infra.mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    res = alignflow_cli(args, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.describe()
    table = parse_table(res.stdout)
    assert set(table) == {"base", "sft", "round_1", "round_2"}, res.stdout

    runs = stage_runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    # A trace's second row holds its tool call as an earlier turn, trained on as well (sft.train_on).
    assert runs["sft"].data.metrics["data/sft_assistant_turns"] > 0
    m = runs["round_1"].data.metrics
    assert m["rl/steps"] == 2
    assert m["rl/agent/tool_calls_per_episode"] > 0, m  # SFT's traces taught the call; the round made some
    # The user's environment ran: its per-call bonus is in every return (the last step's episodes).
    paid = m["rl/agent/success_rate"] + 0.1 * m["rl/agent/tool_calls_per_episode"]
    assert m["rl/agent/return"] == pytest.approx(paid, abs=1e-5)
    assert m["rl/reward/environment"] == pytest.approx(m["rl/agent/return"], abs=1e-5)
    # The trainer scores the very tokens vLLM sampled, in their context: its log-probs agree with vLLM's.
    assert abs(m["rl/tis_weight_mean"] - 1.0) < 0.02, m["rl/tis_weight_mean"]
    a = runs["round_2"].data.metrics  # the user's agent, through the endpoint
    assert a["rl/steps"] == 2 and a["rl/agent/failed_fraction"] == 0 and a["rl/agent/restarts_per_episode"] == 0
    # Call, result, answer: episodes of more than one request, on some step (the tiny policy, 60 SFT steps in,
    # calls right in some steps and in none of others).
    history = {k: [x.value for x in mlflow_client(f"sqlite:///{tmp_path / 'mlflow.db'}").get_metric_history(
        runs["round_2"].info.run_id, f"rl/agent/{k}_per_episode")] for k in ("turns", "tool_calls")}
    assert len(history["turns"]) == 2 and max(history["turns"]) > 1 and max(history["tool_calls"]) > 0, history
    assert a["rl/reward/environment"] == pytest.approx(a["rl/agent/success_rate"], abs=1e-5)  # its 0/1 rewards
    assert abs(a["rl/tis_weight_mean"] - 1.0) < 0.02, a["rl/tis_weight_mean"]
    for name in ("sft", "round_1", "round_2"):  # evaluated as agents in the bundled environment
        e = runs[f"eval_{name}"].data.metrics
        assert e["eval/accuracy"] == e["eval/success_rate"]
        assert {"eval/turns_per_episode", "eval/tool_calls_per_episode", "eval/invalid_calls_per_episode",
                "eval/truncated_fraction", "eval/failed_fraction"} <= set(e), sorted(e)
        assert e["eval/failed_fraction"] == 0
    samples = json.loads(next((tmp_path / "artifacts" / "eval_round_1").glob("*/samples.json")).read_text())
    assert samples and all(s["transcript"].startswith("<|system|>tools: open_box(box)<|user|>What is the code in box")
                           for s in samples)
    assert all(set(s["episode"]) >= {"turns", "tool_calls", "success"} for s in samples)
