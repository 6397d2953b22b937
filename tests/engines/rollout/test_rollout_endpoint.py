"""The agent endpoint (engines/rollout/endpoint.py): an OpenAI client's episodes train on the tokens the
engine sampled; the endpoint listens on 127.0.0.1 only and refuses requests without its key."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from alignflow.agents.boxes import OPEN_BOX
from alignflow.config import SyntheticTaskConfig
from alignflow.data import agent_task
from engines.rl.experience import from_rollouts
from engines.rollout.base import Sampling
from engines.rollout.agentic import agent_episodes
from engines.rollout.endpoint import ChatEndpoint, EngineLoop
from engines.rollout.episodes import EpisodeLimits, in_thread


@pytest.fixture
def engine(eos_prone_engine):
    return eos_prone_engine


def two_questions(client, sample):
    """Asks, shows a tool's result, asks again: a ReAct loop of two completions."""
    messages = list(sample["prompt"])
    first = client.chat.completions.create(model="policy", messages=messages, tools=[OPEN_BOX], max_tokens=12)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "tool", "content": sample["answer"]}]
    client.chat.completions.create(model="policy", messages=messages, tools=[OPEN_BOX], max_tokens=12)
    return 1.0


def rewriting(client, sample):
    """Asks twice, the second time with the question changed: the conversation restarts."""
    client.chat.completions.create(model="p", messages=sample["prompt"], max_tokens=4)
    client.chat.completions.create(model="p", messages=[{"role": "user", "content": "another question"}], max_tokens=4)
    return 0.5


def raising(client, sample):
    client.chat.completions.create(model="p", messages=sample["prompt"], max_tokens=4)
    raise RuntimeError("agent bug")


STUCK = threading.Event()


def hanging(client, sample):
    STUCK.wait(30)
    return 1.0


def records(n: int) -> list[dict]:
    return agent_task.generate(SyntheticTaskConfig(task="boxes", num_sft=1, num_preference=1, num_rl_prompts=n,
                                                   num_eval=1), 0)["prompts"]


REFUSALS: list[str] = []


def until_refused(client, sample):
    """Asks again after every answer until the endpoint refuses, then returns a reward all the same."""
    import openai

    messages = list(sample["prompt"])
    for _ in range(20):
        try:
            reply = client.chat.completions.create(model="p", messages=messages, max_tokens=4)
        except openai.BadRequestError as e:
            REFUSALS.append(e.body["message"] if isinstance(e.body, dict) else str(e))
            return 0.5
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "tool", "content": "again"}]
    return 1.0


def limits(max_tokens: int = 12, timeout_s: float = 30.0, **given) -> EpisodeLimits:
    """Turns and episode tokens unbounded unless given (the context, 128 tokens, bounds an episode)."""
    return EpisodeLimits(**{"max_turns": 1000, "max_episode_tokens": 1000, **given}, max_tokens_per_turn=max_tokens,
                         max_model_len=128, step_timeout_s=timeout_s, failure_reward=-1.0)


def run(engine, agent, recs, n=2, timeout_s=30.0, **given):
    return agent_episodes(engine, engine.tokenizer, recs, n, Sampling(n=n, temperature=1.0), agent,
                          lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True),
                          limits(timeout_s=timeout_s, **given))


def test_an_openai_clients_episodes_train_on_exactly_the_tokens_the_engine_sampled(engine, trainer_logprobs):
    rollouts = run(engine, two_questions, records(3))
    assert [r.prompt_index for r in rollouts] == [0, 0, 1, 1, 2, 2]
    for r in rollouts:
        assert r.episode["turns"] == 2 and r.episode["restarts"] == 0 and r.episode["return"] == 1.0
        assert 0 < sum(r.sampled) < len(r.token_ids)  # the tool's result between the completions, masked
    tok = engine.tokenizer
    first = rollouts[0]
    assert tok.decode(first.prompt_ids) == ("<|system|>tools: open_box(box)<|user|>What is the code in box "
                                            f"{records(3)[0]['prompt'][0]['content'].split()[-1]}<|assistant|>")
    exp = from_rollouts(rollouts, tok.pad_token_id)
    mask = exp.action_mask.bool()
    torch.testing.assert_close(trainer_logprobs(engine, exp)[mask], exp.rollout_logprobs[mask], atol=1e-4, rtol=0)


def in_parts(client, sample):
    """Writes every message's content as OpenAI's list of parts, its answers echoed back so."""
    def parts(text):
        return [{"type": "text", "text": text}]

    messages = [{"role": "user", "content": parts(sample["prompt"][0]["content"])}]
    first = client.chat.completions.create(model="p", messages=messages, max_tokens=6)
    messages += [{"role": "assistant", "content": parts(first.choices[0].message.content)},
                 {"role": "tool", "content": parts(sample["answer"])}]
    client.chat.completions.create(model="p", messages=messages, max_tokens=6)
    return 1.0


def test_content_in_parts_is_served_as_text_and_continues_the_episode(engine):
    """Chat templates (Qwen2.5's) join a string content; a list of parts used to fail the request (400) and with
    it the episode. Joined as vLLM's server joins them, the second request continues the first's sequence."""
    [r] = run(engine, in_parts, records(1), n=1)
    assert r.episode["turns"] == 2 and r.episode["restarts"] == 0 and r.episode.get("failed", 0) == 0


def test_an_assistant_turn_echoed_as_its_tool_calls_continues_the_conversation():
    """Agents echo a turn back as OpenAI's client or vLLM's tool parser give it: content None (or the text outside
    the calls) beside `tool_calls`. That is the turn served, not a rewritten conversation: a restart would keep
    only the last turn sampled and mask the others as prompt."""
    from engines.rollout.episode_tokens import continues, said

    served_text = 'Let me look.<tool_call>{"name": "open_box", "arguments": {"box": 7}}</tool_call>'
    first = [{"role": "user", "content": "What is in box 7?"}]
    served = said(first) + [("assistant", served_text)]
    call = {"id": "call_0", "type": "function", "function": {"name": "open_box", "arguments": '{"box": 7}'}}
    tool = {"role": "tool", "content": "4242"}
    for content in (served_text, None, "", "Let me look."):  # the last: the text outside (or before) the call
        assert continues(served, first + [{"role": "assistant", "content": content, "tool_calls": [call]}, tool])
    other = {**call, "function": {"name": "open_box", "arguments": '{"box": 8}'}}
    for echoed in ({"role": "assistant", "content": None, "tool_calls": [other]},  # another call
                   {"role": "assistant", "content": "Something else.", "tool_calls": [call]},
                   {"role": "assistant", "content": None}):
        assert not continues(served, first + [echoed, tool])
    assert not continues(served, first + [{"role": "assistant", "content": served_text}])  # adds nothing
    # vLLM's hermes parser gives the text before the first call, where more text follows the calls
    after = served_text + " Then I answer."
    assert continues(said(first) + [("assistant", after)],
                     first + [{"role": "assistant", "content": "Let me look.", "tool_calls": [call]}, tool])
    # parts are joined by newlines, as vLLM's server joins them
    parted = {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "in box 7?"}]}
    assert said([parted]) == [("user", "What is\nin box 7?")]


class Busy:
    """An engine that takes 3 s per step: a GPU engine serving many episodes' turns at once."""

    def __init__(self, engine):
        self.engine = engine

    def step(self):
        time.sleep(3.0)
        return self.engine.step()

    def __getattr__(self, name):
        return getattr(self.engine, name)


def test_an_agent_waiting_on_a_busy_engine_is_not_timed_out(engine):
    """step_timeout_s bounds the agent's own time, not the engine's answers: two turns of 3 s's wait each,
    under a step_timeout_s of 2 s (room for the agent's own time on a loaded machine), end the episode as it
    would end on an idle engine. (It was one
    deadline for every episode from the step's start: on a busy GPU engine most episodes failed, the short ones
    surviving, and the policy learnt to call fewer tools.)"""
    busy = Busy(engine)
    [r] = agent_episodes(busy, engine.tokenizer, records(1), 1, Sampling(n=1, temperature=1.0), two_questions,
                         lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True), limits(timeout_s=2.0))
    assert r.episode["failed"] == 0 and r.episode["turns"] == 2 and r.episode["return"] == 1.0, r.episode


def test_a_rewritten_conversation_restarts_and_failing_agents_are_counted(engine):
    restarted = run(engine, rewriting, records(1), n=1)[0]
    assert restarted.episode["restarts"] == 1 and restarted.episode["turns"] == 2
    assert engine.tokenizer.decode(restarted.prompt_ids) == "<|user|>another question<|assistant|>"
    [broke] = run(engine, raising, records(1), n=1)
    assert broke.episode["failed"] == 1 and broke.episode["return"] == -1.0
    assert broke.episode["error"] == "agent raised RuntimeError: agent bug" and broke.episode["turns"] == 1
    try:
        [stuck] = run(engine, hanging, records(1), n=1, timeout_s=0.5)
    finally:
        STUCK.set()
    assert stuck.episode["failed"] == 1 and "step_timeout_s=0.5" in stuck.episode["error"]
    assert stuck.token_ids == [] and stuck.prompt_ids  # nothing to train on, a prompt to batch with
    assert stuck.episode["no_requests"] == 0  # failed, and said so as that


def test_an_agent_that_returns_without_asking_the_endpoint_is_counted_and_said(engine, caplog):
    """Its reward still enters its group (moving the others' baseline) over no tokens: agent/no_requests_fraction
    and a warning say so, not a quiet empty episode."""
    from engines.rollout.episodes import episode_metrics, report_failures

    silent = run(engine, lambda client, sample: 1.0, records(1), n=2)
    assert [(r.episode["no_requests"], r.episode["failed"], r.token_ids) for r in silent] == [(1, 0, [])] * 2
    mixed = run(engine, two_questions, records(1), n=2) + silent
    assert episode_metrics(mixed)["agent/no_requests_fraction"] == 0.5
    with caplog.at_level("WARNING", logger="alignflow"):
        report_failures(mixed, "round_1 step 3")
    assert [r.getMessage() for r in caplog.records] == [
        "round_1 step 3: 2 of 4 episodes sampled nothing: the agent returned without a request to the endpoint: "
        "its return counts in its group, over no tokens"]


def test_an_agents_episode_keeps_to_max_turns_and_max_episode_tokens_and_is_then_truncated(engine):
    REFUSALS.clear()
    [turns] = run(engine, until_refused, records(1), n=1, max_turns=2)
    assert REFUSALS == ["ValueError: the episode has had its max_turns=2 turns"]
    assert turns.episode["turns"] == 2 and turns.episode["truncated"] == 1 and not turns.finished
    assert turns.episode["return"] == 0.5 and turns.episode["failed"] == 0  # the agent's reward stands
    assert turns.episode["success"] == 0  # truncated, as an environment's episode cut by max_turns
    REFUSALS.clear()
    [tokens] = run(engine, until_refused, records(1), n=1, max_episode_tokens=10)
    assert REFUSALS == ["ValueError: the episode has used its max_episode_tokens=10"]
    assert 0 < len(tokens.token_ids) <= 10 and tokens.episode["truncated"] == 1 and not tokens.finished
    # An agent that does not catch the refusal raises: still truncated, not failed; its return is failure_reward.
    [raised] = run(engine, two_questions, records(1), n=1, max_turns=1)
    assert raised.episode["truncated"] == 1 and raised.episode["failed"] == 0 and raised.episode["return"] == -1.0
    assert "max_turns=1" in raised.episode["error"] and raised.episode["turns"] == 1
    REFUSALS.clear()
    [free] = run(engine, two_questions, records(1), n=1, max_turns=2, max_episode_tokens=200)
    assert REFUSALS == [] and free.episode["turns"] == 2 and free.episode["failed"] == 0


def send(url: str, key: str | None, body: dict) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _keep_alive_post(conn, path: str, key: bytes, body: dict) -> int:
    conn.putrequest("POST", path)
    data = json.dumps(body).encode()
    for name, value in (("Authorization", b"Bearer " + key), ("Content-Type", b"application/json"),
                        ("Content-Length", str(len(data)).encode())):
        conn.putheader(name, value)
    conn.endheaders(data)
    resp = conn.getresponse()
    resp.read()
    return resp.status


def test_the_endpoint_listens_on_loopback_only_and_refuses_requests_without_its_key(engine):
    import psutil

    loop = EngineLoop(engine)
    endpoint = ChatEndpoint(loop, engine.tokenizer, engine.tokenizer.decode, limits(max_tokens=4, timeout_s=600.0),
                            temperature=1.0, top_p=1.0)

    def post(url, key, body):  # the engine is served here, on the test's thread, as in an actor's
        asked = in_thread(send, url, key, body)
        loop.run(asked.done, time.monotonic() + 30)
        return asked.result()

    try:
        listening = [c.laddr for c in psutil.Process().net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == endpoint.port]
        assert listening and all(a.ip == "127.0.0.1" for a in listening), listening
        body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
        url = endpoint.url("ep") + "/chat/completions"
        assert post(url, None, body)[0] == 401
        assert post(url, "wrong", body)[0] == 401
        status, reply = post(url, endpoint.key, body)
        assert status == 200 and reply["choices"][0]["message"]["role"] == "assistant"
        assert reply["usage"]["completion_tokens"] == len(endpoint.sequences["ep"].tokens) > 0
        before = endpoint.sequences["ep"]
        flood = {"model": "policy", "messages": body["messages"] + [reply["choices"][0]["message"],
                                                                      {"role": "tool", "content": "x " * 200}]}
        status, refused = post(url, endpoint.key, flood)  # past the context: refused, and nothing of it kept
        assert status == 400 and "fills the model's context" in refused["error"]["message"]
        assert endpoint.sequences["ep"] is before and endpoint.stats["ep"]["turns"] == 1
        assert post(url.replace("/e/ep/", "/x/"), endpoint.key, body)[0] == 404
        assert post(url, endpoint.key, {"messages": "not a list"})[0] == 400
        assert len(endpoint.key) >= 32 and endpoint.key not in url
        # What it cannot serve and keep the turn on-policy and recorded is refused, not ignored.
        turns = endpoint.stats["ep"]["turns"]
        for extra, said in (({"stream": True}, "streaming"), ({"n": 2}, "one choice"), ({"stop": ["Obs"]}, "stop"),
                            ({"logit_bias": {"5": 10}}, "logit_bias")):
            status, refused = post(url, endpoint.key, body | extra)
            assert status == 400 and said in refused["error"]["message"], refused
        assert post(url, endpoint.key, body | {"n": 1, "stream": False})[0] == 200
        assert endpoint.stats["ep"]["turns"] == turns + 1
        # One connection, several requests (HTTP/1.1): a refused request's body is read, not taken for the next.
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=10)
        path = url.removeprefix(f"http://127.0.0.1:{endpoint.port}")
        for key, expected in (("wrong", 401), ("\u00e9t\u00e9", 401), (endpoint.key, 200)):
            asked = in_thread(_keep_alive_post, conn, path, key.encode("latin-1"), body)
            loop.run(asked.done, time.monotonic() + 30)
            assert asked.result() == expected
        conn.close()
    finally:
        endpoint.close()
        loop.close()


def nan_reward(client, sample):
    client.chat.completions.create(model="p", messages=sample["prompt"], max_tokens=4)
    return float("nan")


def test_agents_reach_the_endpoint_past_a_proxy_and_a_nan_reward_fails_the_episode(engine, monkeypatch):
    """A cluster's HTTP_PROXY would take the loopback requests (and the key) to the proxy, where every
    request fails; the clients ignore the environment's proxies. A NaN return would spread to every row's
    advantage: its episode fails instead."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # the discard port: nothing answers there
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    [ok] = run(engine, two_questions, records(1), n=1)
    assert ok.episode["failed"] == 0 and ok.episode["turns"] == 2 and ok.episode["error"] is None
    [nan] = run(engine, nan_reward, records(1), n=1)
    assert nan.episode["failed"] == 1 and nan.episode["return"] == -1.0 and "nan" in nan.episode["error"]


def _until(condition, what: str, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what} after {seconds:g} s"
        time.sleep(0.05)


def test_a_request_its_client_gives_up_on_is_dropped_before_the_engine_generates_it(engine):
    """An agent whose own client times out (or that stops) closes its connection while its request waits for
    the engine: the endpoint gives the request up, the engine never generates it, and the episode stays as it
    was; counted. A request that only waits long is not given up (a busy engine is not the agent's failing), and
    its wait is not the agent's time."""
    import socket

    loop = EngineLoop(engine)
    endpoint = ChatEndpoint(loop, engine.tokenizer, engine.tokenizer.decode, limits(max_tokens=4, timeout_s=2.0),
                            temperature=1.0, top_p=1.0)
    body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "hi"}]}).encode()
    url = endpoint.url("ep") + "/chat/completions"
    try:  # the client leaves: the whole request sent, then the connection closed
        with socket.create_connection(("127.0.0.1", endpoint.port)) as conn:
            conn.sendall(b"POST /e/ep/v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                         + endpoint.key.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
        _until(lambda: endpoint.stats.get("ep", {}).get("abandoned") == 1, "the request to be given up")
        # The engine's thread serves now: it drops the request rather than generate it.
        loop.run(lambda: loop.counts["abandoned"] == 1, time.monotonic() + 60)
        assert loop.counts == {"answered": 0, "abandoned": 1} and not engine.busy()
        assert "ep" not in endpoint.sequences and endpoint.stats["ep"]["turns"] == 0
        # The episode goes on: its next request waits, nobody serving the engine for 3 step_timeout_s, and is
        # answered then as its first would have been, the wait counted as the engine's, not the agent's.
        started = time.monotonic()
        asked = in_thread(send, url, endpoint.key, json.loads(body))
        time.sleep(6.0)
        assert not asked.done() and endpoint.clock.agent_seconds("ep", started) < 2.0
        loop.run(asked.done, time.monotonic() + 60)
        status, reply = asked.result()
        assert status == 200 and reply["usage"]["completion_tokens"] == len(endpoint.sequences["ep"].tokens) > 0
        assert endpoint.stats["ep"]["turns"] == 1 and loop.counts == {"answered": 1, "abandoned": 1}
        assert endpoint.clock.agent_seconds("ep", started) < 2.0 < time.monotonic() - started - 3.5
    finally:
        endpoint.close()
        loop.close()
