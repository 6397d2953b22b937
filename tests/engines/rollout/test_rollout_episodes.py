"""Episodes (engines/rollout/episodes.py): one token sequence per episode, loss only where the policy
sampled, every environment failure a counted outcome, and the trained tokens the sampled ones."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from alignflow.agents import ToolEnvironment
from alignflow.agents.boxes import BoxesEnvironment
from alignflow.config import SyntheticTaskConfig
from alignflow.data import agent_task
from engines.rl.experience import from_rollouts
from engines.rollout.base import Sampling
from engines.rollout.episode_tokens import EpisodeTokens
from engines.rollout.episodes import (EpisodeLimits, NothingSampled, episode_metrics, report_failures,
                                    run_episodes)

SAMPLING = Sampling(n=1, temperature=1.0, max_new_tokens=32)


@pytest.fixture(scope="module")
def tok(box_model):
    from engines.models import load_tokenizer

    return load_tokenizer(box_model)


class Scripted:
    """An engine whose turns are written out: episode `row`'s k-th turn is `turns[row][k]` (ended with EOS
    unless listed in `cut`). It keeps every prompt it was given."""

    def __init__(self, turns: dict[int, list[list[int]]], cut: set[tuple[int, int]] = frozenset()):
        self.turns, self.cut, self.queue, self.prompts = turns, cut, [], {}

    def add(self, key, prompt_ids, sampling):
        self.prompts.setdefault(key, []).append(list(prompt_ids))
        self.queue.append(key)

    def busy(self):
        return bool(self.queue)

    def abort(self, keys):
        self.queue = [k for k in self.queue if k not in set(keys)]

    def step(self):
        key = self.queue.pop(0)
        k = len(self.prompts[key]) - 1
        ids = self.turns[key][k]
        return [(key, ids, [-0.25] * len(ids), (key, k) not in self.cut)]


def limits(**kw) -> EpisodeLimits:
    return EpisodeLimits(**{"max_turns": 4, "max_tokens_per_turn": 40, "max_episode_tokens": 200, "max_model_len": 256,
                            "step_timeout_s": 5.0, "failure_reward": -1.0, **kw})


def ids(tok, text: str, eos: bool = True) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if eos else [])


def test_a_two_turn_episode_with_a_tool_call_trains_exactly_the_sampled_tokens(tok):
    record = {"prompt": [{"role": "user", "content": agent_task.question(42)}], "answer": "17",
              "boxes": {"42": 17, "11": 90}}
    call, answer = ids(tok, agent_task.call_text(42)), ids(tok, "17")
    engine = Scripted({0: [call, answer]})
    [r] = run_episodes(engine, tok, [record], 1, SAMPLING, BoxesEnvironment, limits(),
                       lambda t: tok.decode(t, skip_special_tokens=True))
    # What the tiny template writes, spelled out by hand: the tools, the question, then the tool's result.
    prompt = ids(tok, "<|system|>tools: open_box(box)<|user|>What is the code in box 42?<|assistant|>", eos=False)
    observation = ids(tok, "<|system|>17<|assistant|>", eos=False)
    assert r.prompt_ids == prompt
    assert r.token_ids == call + observation + answer
    assert r.sampled == [1] * len(call) + [0] * len(observation) + [1] * len(answer)
    assert engine.prompts[0] == [prompt, prompt + call + observation]  # the sampled turn is never re-tokenised
    assert r.turn_rewards == [(len(r.token_ids) - 1, 1.0)] and r.finished and r.text == "17"
    assert {k: r.episode[k] for k in ("turns", "tool_calls", "success", "return", "truncated")} == \
        {"turns": 2, "tool_calls": 1, "success": 1, "return": 1.0, "truncated": 0}

    exp = from_rollouts([r], tok.pad_token_id)
    positions = exp.response_index[0][exp.action_mask[0].bool()] + 1  # next-token layout -> input position
    assert exp.input_ids[0, positions].tolist() == call + answer
    assert exp.action_mask[0].sum().item() == len(call) + len(answer)
    assert exp.rollout_logprobs[0][exp.action_mask[0].bool()].eq(-0.25).all()
    assert exp.rollout_logprobs[0][~exp.action_mask[0].bool()].eq(0).all()
    assert exp.turn_rewards[0].nonzero().flatten().tolist() == [len(r.token_ids) - 1]


RELEASE = threading.Event()


class Modes(ToolEnvironment):
    """Each record says how its environment behaves."""

    def __init__(self):
        self.tools = BoxesEnvironment().tools
        self._boxes = self.tools[0].fn.__self__

    def reset(self, sample):
        self.mode = sample["mode"]
        self._boxes.sample = sample
        if self.mode == "crash_reset":
            raise RuntimeError("no sandbox")
        return super().reset(sample)

    def step(self, message):
        if self.mode == "hang":
            RELEASE.wait(60)
        if self.mode == "crash":
            raise OSError("environment died")
        if self.mode == "exit":  # a tool that calls sys.exit, or asyncio's CancelledError: BaseExceptions
            raise SystemExit(3)
        if self.mode == "malformed_return":
            return [], 1.0
        return super().step(message)


def test_malformed_calls_raising_tools_hanging_and_crashing_environments_each_get_a_counted_outcome(tok):
    modes = ["malformed_call", "raising_tool", "hang", "crash", "crash_reset", "malformed_return", "turns", "cut",
             "cut_answer", "exit"]
    records = [{"prompt": [{"role": "user", "content": agent_task.question(42)}], "answer": "17",
                "boxes": {"42": 17}, "mode": m} for m in modes]
    call, answer = ids(tok, agent_task.call_text(42)), ids(tok, "17")
    bad_json, wrong_box = ids(tok, "<tool_call>{oops</tool_call>"), ids(tok, agent_task.call_text(99))
    engine = Scripted({0: [bad_json, answer], 1: [wrong_box, answer], 2: [answer], 3: [answer], 5: [answer],
                       6: [call, call, call], 7: [call[:5], answer], 8: [answer[:1]], 9: [answer]},
                      cut={(7, 0), (8, 0)})
    try:
        rollouts = run_episodes(engine, tok, records, 1, SAMPLING, Modes, limits(max_turns=3, step_timeout_s=5.0),
                                lambda t: tok.decode(t, skip_special_tokens=True))
    finally:
        RELEASE.set()  # the abandoned step's thread may end
    got = {m: r.episode for m, r in zip(modes, rollouts)}
    assert got["malformed_call"]["invalid_calls"] == 1 and got["malformed_call"]["success"] == 1
    assert got["raising_tool"]["tool_errors"] == 1 and got["raising_tool"]["success"] == 1
    assert "took longer than step_timeout_s=5" in got["hang"]["error"]  # the hang; the others in time, loaded or not
    assert "OSError: environment died" in got["crash"]["error"]
    assert "environment reset: RuntimeError: no sandbox" in got["crash_reset"]["error"]
    assert "not (observation, reward, done, info)" in got["malformed_return"]["error"]
    assert "environment step: SystemExit: 3" in got["exit"]["error"]  # that episode's end, not the loop's
    for m in ("hang", "crash", "crash_reset", "malformed_return", "exit"):
        assert got[m]["failed"] == 1 and got[m]["return"] == -1.0, m
    assert got["turns"]["truncated"] == 1 and got["turns"]["turns"] == 3 and got["turns"]["tool_calls"] == 3
    assert got["turns"]["truncated_by"] == "the episode has had its max_turns=3 turns"
    turns = rollouts[modes.index("turns")]  # the last call's result is read by no turn, and is not kept
    assert turns.token_ids[-len(call):] == call
    # A cut turn goes to the environment all the same (here an unclosed call, invalid), and is counted;
    # an episode whose last turn was cut counts as truncated.
    assert got["cut"]["cut_turns"] == 1 and got["cut"]["invalid_calls"] == 1 and got["cut"]["success"] == 1
    assert got["cut"]["truncated"] == 0 and got["cut_answer"]["truncated"] == 1 and got["cut_answer"]["turns"] == 1
    assert [r.finished for r in rollouts] == [True] * 6 + [False, True, False, True]
    cut = rollouts[modes.index("cut")]  # the template's end of the cut turn is the environment's, masked
    end = ids(tok, "<|end|><|system|>error: a <tool_call> was opened and never closed<|assistant|>", eos=False)
    assert cut.token_ids == call[:5] + end + answer and cut.sampled == [1] * 5 + [0] * len(end) + [1] * len(answer)
    for r in rollouts:  # every reward lands on a sampled token, where an estimator reads it
        assert not any(r.sampled) or all(r.sampled[t] == 1 for t, _ in r.turn_rewards), r.episode
    crashed_at_reset = rollouts[modes.index("crash_reset")]
    assert crashed_at_reset.prompt_ids and crashed_at_reset.token_ids == []  # a prompt, nothing to train on
    metrics = episode_metrics(rollouts)
    assert metrics["agent/failed_fraction"] == 5 / 10 and metrics["agent/truncated_fraction"] == 2 / 10
    assert metrics["agent/invalid_calls_per_episode"] == 2 / 10 and metrics["agent/success_rate"] == 3 / 10
    exp = from_rollouts(rollouts, tok.pad_token_id)  # the whole batch still makes one Experience
    assert exp.action_mask[modes.index("crash_reset")].sum() == 0


class Twice(ToolEnvironment):
    """Answers every turn with a note; done after the second."""

    def reset(self, sample):
        self.turn = 0
        return super().reset(sample)

    def step(self, message):
        self.turn += 1
        return [{"role": "tool", "content": "noted"}], 0.5, self.turn == 2, {}


def test_a_real_engines_episodes_are_scored_by_the_trainer_on_exactly_the_tokens_it_sampled(eos_prone_engine, tok,
                                                                                           trainer_logprobs):
    """A real engine's episodes: the trainer's forward over each episode's sequence gives back the engine's
    log-probs on every sampled token, so the context it trains on is the one the engine sampled in,
    observations included."""
    records = agent_task.generate(SyntheticTaskConfig(task="boxes", num_sft=1, num_preference=1, num_rl_prompts=4,
                                                      num_eval=1), 0)["prompts"]
    rollouts = run_episodes(eos_prone_engine, tok, records, 2, Sampling(n=2, temperature=1.0), Twice,
                            limits(max_tokens_per_turn=24), lambda t: tok.decode(t, skip_special_tokens=True))
    two_turns = [r for r in rollouts if r.episode["turns"] == 2 and r.finished]
    assert len(two_turns) >= 2, [r.episode for r in rollouts]
    assert [r.prompt_index for r in rollouts] == [0, 0, 1, 1, 2, 2, 3, 3]
    exp = from_rollouts(two_turns, tok.pad_token_id)
    mask = exp.action_mask.bool()
    assert torch.allclose(trainer_logprobs(eos_prone_engine, exp)[mask], exp.rollout_logprobs[mask], atol=1e-4)
    for b, r in enumerate(two_turns):  # the observation tokens sit between the turns, masked
        assert 0 < exp.action_mask[b, : len(r.token_ids)].sum() < len(r.token_ids)
        assert r.episode["return"] == 1.0 and r.episode["success"] == 1


# Qwen3's way: an assistant turn carries an empty think block only while it is the conversation's last message.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ 'system' if m['role'] == 'tool' else m['role'] }}|>"
    "{% if m['role'] == 'assistant' and loop.last %}<think></think>{% endif %}{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_observation_tokens_come_from_what_follows_the_turn_whatever_the_template_does_to_earlier_turns(tok):
    thinking = copy.deepcopy(tok)
    thinking.chat_template = THINKING_TEMPLATE
    other_stop = tok("7", add_special_tokens=False)["input_ids"][-1]
    for t in (tok, thinking):
        obs = EpisodeTokens(t).observation([{"role": "tool", "content": "17"}], t.eos_token_id)
        assert t.decode(obs) == "<|system|>17<|assistant|>"
        # The template closes a turn that did not end in the tokenizer's EOS: one cut by its token limit, or
        # one ended at another of the model's stop ids (vLLM stops at each id of its generation config).
        cut = EpisodeTokens(t).observation([{"role": "tool", "content": "17"}], other_stop)
        assert t.decode(cut) == "<|end|><|system|>17<|assistant|>"


def test_a_turn_ended_at_the_templates_end_of_turn_token_does_not_get_it_twice(tok):
    """Gemma's way: its tokenizer's EOS is <eos>, its turns end in <end_of_turn>, which its generation config
    lists among the stop ids. A turn that stopped there already holds the template's end."""
    gemma_like = copy.deepcopy(tok)
    gemma_like.eos_token = "<|endoftext|>"  # the tokenizer's EOS is no longer the template's end of turn
    end_of_turn = gemma_like.convert_tokens_to_ids("<|end|>")
    assert end_of_turn != gemma_like.eos_token_id
    obs = EpisodeTokens(gemma_like).observation([{"role": "tool", "content": "17"}], end_of_turn)
    assert gemma_like.decode(obs) == "<|system|>17<|assistant|>"
    cut = EpisodeTokens(gemma_like).observation([{"role": "tool", "content": "17"}], None)  # cut by its limit
    assert gemma_like.decode(cut) == "<|end|><|system|>17<|assistant|>"


def test_an_episode_never_keeps_tokens_past_its_limits_and_says_which_limit_ended_it(tok):
    """An observation that leaves no room for another turn is not kept (no turn reads it: a tool's long output
    would otherwise carry the episode past max_episode_tokens and the model's context), and a first observation
    that leaves none truncates the episode before its first turn, named in a warning."""
    record = {"prompt": [{"role": "user", "content": agent_task.question(42)}], "answer": "17", "boxes": {"42": 17}}
    call = ids(tok, agent_task.call_text(42))
    env = BoxesEnvironment()
    start = EpisodeTokens(tok, [t.schema for t in env.tools]).start(env.reset(record))
    observation = ids(tok, "<|system|>17<|assistant|>", eos=False)
    room = len(call) + len(observation) - 1  # the call fits; the call and its result do not
    [r] = run_episodes(Scripted({0: [call, call]}), tok, [record], 1, SAMPLING, BoxesEnvironment,
                       limits(max_episode_tokens=room), lambda t: tok.decode(t, skip_special_tokens=True))
    assert r.token_ids == call and r.sampled == [1] * len(call) and len(r.token_ids) <= room
    assert r.episode["truncated"] == 1 and r.episode["truncated_by"] == f"the episode has used its max_episode_tokens={room}"
    context = len(start) + len(call) + len(observation)  # the same where the model's context is what is short
    [r] = run_episodes(Scripted({0: [call, call]}), tok, [record], 1, SAMPLING, BoxesEnvironment,
                       limits(max_model_len=context), lambda t: tok.decode(t, skip_special_tokens=True))
    assert len(r.prompt_ids) + len(r.token_ids) < context and "fills the model's context" in r.episode["truncated_by"]


def test_a_batch_where_no_episode_sampled_a_token_is_an_error_naming_why(tok, caplog):
    record = {"prompt": [{"role": "user", "content": agent_task.question(42)}], "answer": "17", "boxes": {"42": 17}}
    answer = ids(tok, "17")
    decode = lambda t: tok.decode(t, skip_special_tokens=True)  # noqa: E731
    env = BoxesEnvironment()
    short = len(EpisodeTokens(tok, [t.schema for t in env.tools]).start(env.reset(record)))
    unstarted = run_episodes(Scripted({0: [answer], 1: [answer]}), tok, [record], 2, SAMPLING, BoxesEnvironment,
                             limits(max_model_len=short), decode)  # the prompt alone fills the context
    assert [r.episode["turns"] for r in unstarted] == [0, 0] and all(r.episode["truncated"] for r in unstarted)
    with pytest.raises(NothingSampled, match=r"none of the 2 episodes sampled a token \(0 failed, 2 truncated before "
                                             r"their first turn\): the conversation fills the model's context"):
        report_failures(unstarted, "round step 3")
    crashed = run_episodes(Scripted({}), tok, [{**record, "mode": "crash_reset"}], 1, SAMPLING, Modes, limits(),
                           decode)
    with pytest.raises(NothingSampled, match="1 failed, 0 truncated.*environment reset: RuntimeError: no sandbox"):
        report_failures(crashed, "eval")
    [one] = run_episodes(Scripted({0: [answer]}), tok, [record], 1, SAMPLING, BoxesEnvironment, limits(), decode)
    with caplog.at_level("WARNING", logger="alignflow"):  # one episode that sampled: a warning, and no error
        report_failures(unstarted + [one], "round step 4")
    assert "2 of 3 episodes were truncated before their first turn: the conversation fills" in caplog.text


def test_a_prompt_limit_measures_the_prompt_an_environments_episode_starts_with(tok):
    """A string prompt becomes a user turn and the environment's tools are listed (its schemas through the
    template): the filter measures that, where the record alone measures shorter."""
    from alignflow.config import EnvironmentConfig
    from engines.batches import filter_prompts, render_prompt
    from engines.rollout.agentic import episode_start

    record = {"prompt": agent_task.question(42), "answer": "17", "boxes": {"42": 17}}
    env = BoxesEnvironment()
    started = EpisodeTokens(tok, [t.schema for t in env.tools]).start(env.reset(record))
    measure = episode_start(tok, EnvironmentConfig(name="boxes"))
    assert measure(record) == started and len(started) > len(render_prompt(tok, record["prompt"]))
    kept, report = filter_prompts(tok, [record, {**record, "prompt": "x"}], len(started) - 1, "prompts", measure)
    assert [r["prompt"] for _, r in kept] == ["x"] and report.overlong == 1


def test_an_environments_tool_schemas_widen_the_prompt_limit_the_data_settled(tok, box_model):
    """The data stage measures prompts with their own tools; an environment lists its tools' schemas in every
    prompt. With the data's limit alone (`auto`: its longest prompt) every episode's prompt was left out and the
    round failed: the limit now takes the schemas' tokens on top."""
    from alignflow.config import EnvironmentConfig
    from alignflow.errors import PromptTooLongError
    from engines.batches import filter_prompts, render_prompt
    from engines.rollout.agentic import episode_prompts, episode_start
    from tasks.stages.data import TokenLimits

    records = [{"prompt": agent_task.question(i), "answer": "1", "boxes": {}} for i in (7, 42, 1234)]
    env = EnvironmentConfig(name="boxes")
    measure = episode_start(tok, env)
    data_limit = max(len(render_prompt(tok, r["prompt"])) for r in records)  # what `auto` settles
    grown = [len(measure(r)) - len(render_prompt(tok, r["prompt"])) for r in records]
    render, schemas = episode_prompts(tok, env, records)
    assert schemas == max(grown) > 0 and [render(r) for r in records] == [measure(r) for r in records]
    with pytest.raises(PromptTooLongError):
        filter_prompts(tok, records, data_limit, "prompts", measure)
    prompt, model_len = TokenLimits(data_limit, 8).for_generation(16, str(box_model), "round_1: ",
                                                                  schemas=max(grown))
    kept, report = filter_prompts(tok, records, prompt, "prompts", measure)
    assert len(kept) == 3 and report.overlong == 0 and prompt == data_limit + max(grown) and model_len == prompt + 16
    assert episode_prompts(tok, EnvironmentConfig(agent="my_agent:run"), records)[1] == 0
