"""Any agent, through an OpenAI-compatible endpoint: `environment.agent: module:function`.

    def agent(client: openai.OpenAI, sample: dict) -> float:
        reply = client.chat.completions.create(model="policy", messages=[...], tools=[...])
        ...                                   # call tools, ask again, as the agent's own code decides
        return reward

Each episode runs `agent(client, sample)` in a thread of its own, beside the others. Its client talks to
`/v1/chat/completions`, served by this rollout engine's process on 127.0.0.1 (port chosen by the system)
under a key made for this generation: a request without it gets 401. Completions are sampled by the
engine (`EngineLoop`: one thread steps the engine, requests from any thread join its running batch).

What trains is what was sampled. The endpoint keeps each episode's token sequence: when a request's
messages extend the conversation it served before (role and content alike), only the new messages are
rendered and appended (`EpisodeTokens.observation`, masked), and the completion's tokens and log-probs
follow. A request that rewrites the conversation starts the sequence again from its render, and the
restart is counted (`restarts`; training takes the last sequence). An agent that raises or runs past
`step_timeout_s` fails its episode (counted, `failure_reward`); its reward is otherwise the episode's
return. Tool calls in a completion (the template's `<tool_call>` format) come back as `tool_calls`, and
are counted (those that do not parse as invalid calls).
"""

from __future__ import annotations

import json
import queue
import re
import secrets
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from alignflow.agents.tools import CALL
from engines.rollout.base import Rollout, Sampling
from engines.rollout.episode_tokens import EpisodeTokens
from engines.rollout.episodes import EPISODE_STATS, in_thread

PATH = re.compile(r"^/e/([A-Za-z0-9_-]+)/v1/chat/completions$")


class EngineLoop:
    """Requests from any thread (`submit`), served by the thread that calls `run`: the one the engine lives
    on. (vLLM's CPU attention checks that its metadata and its kernels see the same OpenMP thread count,
    which is a thread's own setting: an engine stepped from a second thread fails that check.)"""

    def __init__(self, engine):
        self.engine, self._inbox, self._waiting = engine, queue.Queue(), {}

    def submit(self, prompt_ids: list[int], sampling: Sampling) -> Future:
        future: Future = Future()
        self._inbox.put((prompt_ids, sampling, future))
        return future

    def run(self, done, deadline: float) -> None:
        """Serve until `done()` or the monotonic `deadline`."""
        while not done() and time.monotonic() < deadline:
            try:
                while True:
                    prompt_ids, sampling, future = self._inbox.get(timeout=0.0 if self.engine.busy() else 0.02)
                    key = uuid.uuid4().hex
                    try:
                        self.engine.add(key, prompt_ids, sampling)
                        self._waiting[key] = future
                    except Exception as e:  # a request the engine refuses fails that request, not the loop
                        future.set_exception(e)
            except queue.Empty:
                pass
            if self.engine.busy():
                for key, ids, logprobs, eos in self.engine.step():
                    self._waiting.pop(key).set_result((ids, logprobs, eos))

    def close(self) -> None:
        """Requests still queued or generating are dropped from the engine, their callers told."""
        self.engine.abort(list(self._waiting))
        while not self._inbox.empty():
            self._waiting[uuid.uuid4().hex] = self._inbox.get_nowait()[2]
        for future in self._waiting.values():
            future.set_exception(RuntimeError("the generation these episodes belonged to has ended"))
        self._waiting = {}


@dataclass
class _Sequence:
    """One episode's tokens as the endpoint served them."""

    messages: list[tuple[str, str]]  # (role, content) of the conversation so far, its answers included
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    last_cut: bool = False
    last_text: str = ""


def _said(messages: list[dict]) -> list[tuple[str, str]]:
    return [(m.get("role"), m.get("content") or "") for m in messages]


def _tool_calls(text: str) -> list[dict]:
    calls = []
    for body in CALL.findall(text):
        try:
            call = json.loads(body)
            calls.append({"id": f"call_{len(calls)}", "type": "function", "function": {
                "name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}})
        except (ValueError, KeyError, TypeError):
            continue  # not a call the agent could run: left in the text
    return calls


class ChatEndpoint:
    def __init__(self, loop: EngineLoop, tokenizer, decode, *, temperature: float, top_p: float, max_tokens: int,
                 max_model_len: int):
        self.loop, self.tokenizer, self.decode = loop, tokenizer, decode
        self.defaults = {"temperature": temperature, "top_p": top_p, "max_tokens": max_tokens}
        self.max_model_len, self.key = max_model_len, secrets.token_urlsafe(24)
        self.sequences: dict[str, _Sequence] = {}
        self.stats: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # the round's log is not a web server's
                pass

            def do_POST(self) -> None:
                match = PATH.match(self.path)
                if self.headers.get("Authorization") != f"Bearer {endpoint.key}":
                    return self._send(401, {"error": {"message": "missing or wrong API key", "type": "auth"}})
                if not match:
                    return self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                    self._send(200, endpoint.complete(match.group(1), body))
                except Exception as e:  # the agent's bad request is its episode's problem, told to it
                    self._send(400, {"error": {"message": f"{type(e).__name__}: {e}", "type": "invalid_request"}})

            def _send(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True, name="alignflow-endpoint").start()

    def url(self, episode: str) -> str:
        return f"http://127.0.0.1:{self.port}/e/{episode}/v1"

    def complete(self, episode: str, body: dict) -> dict:
        messages, tools = list(body["messages"]), body.get("tools") or None
        tokens = EpisodeTokens(self.tokenizer, tools)
        stats = self.stats.setdefault(episode, {"turns": 0, "cut_turns": 0, "restarts": 0, "tool_calls": 0,
                                                "invalid_calls": 0})
        with self._lock:
            seq = self.sequences.get(episode)
            said = _said(messages)
            if seq is not None and said[: len(seq.messages)] == seq.messages and len(said) > len(seq.messages):
                more = tokens.observation(messages[len(seq.messages):], ended=not seq.last_cut)
                seq.tokens, seq.logprobs, seq.sampled = seq.tokens + more, seq.logprobs + [0.0] * len(more), \
                    seq.sampled + [0] * len(more)
            else:
                stats["restarts"] += seq is not None
                seq = self.sequences[episode] = _Sequence(said, tokens.start(messages))
        context = seq.prompt_ids + seq.tokens
        asked = {k: body.get(k) if body.get(k) is not None else v for k, v in self.defaults.items()}
        budget = min(int(asked["max_tokens"]), self.max_model_len - len(context))
        if budget < 1:
            raise ValueError(f"the conversation fills the model's context ({len(context)} of {self.max_model_len} "
                             f"tokens)")
        ids, logprobs, eos = self.loop.submit(context, Sampling(
            n=1, temperature=float(asked["temperature"]), top_p=float(asked["top_p"]), max_new_tokens=budget)).result()
        text = self.decode(ids)
        with self._lock:
            seq.tokens, seq.logprobs = seq.tokens + ids, seq.logprobs + logprobs
            seq.sampled = seq.sampled + [1] * len(ids)
            seq.messages, seq.last_cut, seq.last_text = said + [("assistant", text)], not eos, text
            stats["turns"] += 1
            stats["cut_turns"] += int(not eos)
        calls = _tool_calls(text)
        with self._lock:  # the model's calls, as the template writes them (running them is the agent's part)
            stats["tool_calls"] += len(calls)
            stats["invalid_calls"] += text.count("<tool_call>") - len(calls)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model", "policy"),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text,
                                                     **({"tool_calls": calls} if calls else {})},
                             "finish_reason": ("tool_calls" if calls else "stop") if eos else "length"}],
                "usage": {"prompt_tokens": len(context), "completion_tokens": len(ids),
                          "total_tokens": len(context) + len(ids)}}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def agent_episodes(engine, tokenizer, records: list[dict], n: int, sampling: Sampling, agent, *, timeout_s: float,
                   failure_reward: float, max_tokens: int, max_model_len: int) -> list[Rollout]:
    """`n` episodes of each record, each `agent(client, record)` against this engine's endpoint; grouped per
    record, in order, as `run_episodes` returns them."""
    import openai

    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    loop = EngineLoop(engine)
    endpoint = ChatEndpoint(loop, tokenizer, decode, temperature=sampling.temperature, top_p=sampling.top_p,
                            max_tokens=max_tokens, max_model_len=max_model_len)
    names = [f"{i}-{j}" for i in range(len(records)) for j in range(n)]
    try:
        runs = {name: in_thread(agent, openai.OpenAI(base_url=endpoint.url(name), api_key=endpoint.key,
                                                      max_retries=0, timeout=timeout_s), records[i // n])
                for i, name in enumerate(names)}
        deadline = time.monotonic() + timeout_s
        loop.run(lambda: all(f.done() for f in runs.values()), deadline)
        outcomes = {}
        for name, future in runs.items():
            try:
                outcomes[name] = (float(future.result(timeout=max(0.0, deadline - time.monotonic()))), None)
            except Exception as e:  # raised, or still running at the deadline (its thread is left behind)
                why = f"agent ran past step_timeout_s={timeout_s:g}" if not future.done() else \
                    f"agent raised {type(e).__name__}: {e}"
                outcomes[name] = (failure_reward, why)
    finally:
        endpoint.close()
        loop.close()
    rollouts = []
    for i, name in enumerate(names):
        reward, error = outcomes[name]
        seq = endpoint.sequences.get(name) or _Sequence([], EpisodeTokens(tokenizer).start(
            [{"role": "user", "content": ""}]))
        stats = {k: 0 for k in EPISODE_STATS} | endpoint.stats.get(name, {})
        stats |= {"return": reward, "failed": int(error is not None), "success": int(error is None and reward > 0),
                  "truncated": int(seq.last_cut)}
        rollouts.append(Rollout(prompt_index=i // n, prompt_ids=seq.prompt_ids, token_ids=seq.tokens,
                                text=seq.last_text, logprobs=seq.logprobs,
                                finished=not seq.last_cut, sampled=seq.sampled,
                                turn_rewards=[(max(len(seq.tokens) - 1, 0), reward)],
                                episode={**stats, "error": error}))
    return rollouts
