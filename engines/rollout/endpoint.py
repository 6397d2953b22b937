"""Any agent, through an OpenAI-compatible endpoint: `environment.agent: module:function`.

    def agent(client: openai.OpenAI, sample: dict) -> float:
        reply = client.chat.completions.create(model="policy", messages=[...], tools=[...])
        ...                                   # call tools, ask again, as the agent's own code decides
        return reward

Each episode runs `agent(client, sample)` in a thread of its own, beside the others. Its client talks to
`/v1/chat/completions`, served by this rollout engine's process on 127.0.0.1 (port chosen by the system)
under a key made for this generation: a request without it gets 401. Completions are sampled by the
engine (`EngineLoop`: the engine's own thread steps it, requests from any thread join its running batch)
at the round's temperature and top_p, whatever the agent asks (the samples stay on-policy); an agent's
`max_tokens` may only shorten a turn below max_tokens_per_turn. Requests of one episode are answered one
at a time. A request past the episode's `max_turns` completions, or with no tokens left of
`max_episode_tokens` or of the engine's context, is refused (400, saying which) and the episode counts as
truncated, as an environment's does: an agent that catches the error keeps its reward; one that raises
gets failure_reward, truncated still, not failed.

What trains is what was sampled. The endpoint keeps each episode's token sequence: when a request's
messages extend the conversation it served before (role and content alike), only the new messages are
rendered and appended (`EpisodeTokens.observation`, masked), and the completion's tokens and log-probs
follow. A request that rewrites the conversation starts the sequence again from its render, and the
restart is counted (`restarts`; training takes the last sequence). An agent that raises or runs past
`step_timeout_s` fails its episode (counted, `failure_reward`); its reward is otherwise the episode's
return. Tool calls in a completion (the template's `<tool_call>` format) come back as `tool_calls`, and
are counted (those that do not parse as invalid calls). `stream`, `n` > 1, `stop` and `logit_bias` get 400.
"""

from __future__ import annotations

import json
import math
import queue
import re
import secrets
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from alignflow.agents.tools import openai_tool_calls
from engines.rollout.base import Rollout, Sampling
from engines.rollout.episode_tokens import EpisodeTokens
from engines.rollout.episodes import EPISODE_STATS, EpisodeLimits, in_thread, last_sampled

PATH = re.compile(r"^/e/([A-Za-z0-9_-]+)/v1/chat/completions$")


class EngineLoop:
    """Requests from any thread (`submit`), served by the thread that calls `run`: the one the engine lives
    on. (vLLM's CPU attention checks that its metadata and its kernels see the same OpenMP thread count,
    which is a thread's own setting: an engine stepped from a second thread fails that check.)"""

    def __init__(self, engine):
        self.engine, self._inbox, self._waiting = engine, queue.Queue(), {}
        self._closed, self._lock = False, threading.Lock()

    def submit(self, prompt_ids: list[int], sampling: Sampling) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                future.set_exception(RuntimeError("the generation these episodes belonged to has ended"))
            else:
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
        """Requests still queued or generating are dropped from the engine, their callers told; later ones are
        refused at once."""
        with self._lock:
            self._closed = True
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


# Request fields the endpoint cannot honour and keep the turn on-policy and recorded: refused, not ignored.
UNSERVED = {"stream": "streaming is not served: ask without stream", "n": "one choice per request (n: 1)",
            "stop": "stop sequences would end turns the policy did not end: leave stop out",
            "logit_bias": "logit_bias changes the policy's distribution"}


def _unserved(body: dict) -> str | None:
    bad = [k for k, v in body.items() if k in UNSERVED and v not in (None, False, [], {}) and (k, v) != ("n", 1)]
    return f"{bad[0]}={body[bad[0]]!r}: {UNSERVED[bad[0]]}" if bad else None


class _Server(ThreadingHTTPServer):
    request_queue_size = 1024  # every episode's agent may connect at once (the default backlog is 5)
    daemon_threads = True


class ChatEndpoint:
    def __init__(self, loop: EngineLoop, tokenizer, decode, limits: EpisodeLimits, *, temperature: float,
                 top_p: float):
        """`limits`: an environment's (EpisodeLimits.turn_budget); its step_timeout_s bounds each request."""
        self.loop, self.tokenizer, self.decode, self.limits = loop, tokenizer, decode, limits
        self.temperature, self.top_p, self.key = temperature, top_p, secrets.token_urlsafe(24)
        self.sequences: dict[str, _Sequence] = {}
        self.stats: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()  # the dicts above
        self._episode_locks: dict[str, threading.Lock] = {}  # one request of an episode at a time
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # a client keeps its connection for the episode's requests

            def log_message(self, *args) -> None:  # the round's log is not a web server's
                pass

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))  # read whole: the next request follows
                match = PATH.match(self.path)
                given = self.headers.get("Authorization", "").encode("utf-8", "replace")
                if not secrets.compare_digest(given, f"Bearer {endpoint.key}".encode()):
                    return self._send(401, {"error": {"message": "missing or wrong API key", "type": "auth"}})
                if not match:
                    return self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
                try:
                    body = json.loads(raw)
                    if why := _unserved(body):
                        raise ValueError(why)
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

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True, name="alignflow-endpoint").start()

    def url(self, episode: str) -> str:
        return f"http://127.0.0.1:{self.port}/e/{episode}/v1"

    def complete(self, episode: str, body: dict) -> dict:
        """One completion of `episode`'s conversation. Requests of one episode are answered one at a time, and
        its sequence changes only once the completion is in: a refused request leaves it as it was. Sampling is
        the round's (temperature, top_p: on-policy, whatever the agent asks); `max_tokens` may only shorten a
        turn."""
        with self._lock:
            lock = self._episode_locks.setdefault(episode, threading.Lock())
            stats = self.stats.setdefault(episode, {"turns": 0, "cut_turns": 0, "restarts": 0, "tool_calls": 0,
                                                    "invalid_calls": 0})
        with lock:
            messages, tools = list(body["messages"]), body.get("tools") or None
            tokens, said = EpisodeTokens(self.tokenizer, tools), _said(messages)
            seq = self.sequences.get(episode)
            extends = seq is not None and said[: len(seq.messages)] == seq.messages and len(said) > len(seq.messages)
            if extends:
                more = tokens.observation(messages[len(seq.messages):],
                                          seq.tokens[-1] if seq.tokens and not seq.last_cut else None)
                base = _Sequence(said, seq.prompt_ids, seq.tokens + more, seq.logprobs + [0.0] * len(more),
                                 seq.sampled + [0] * len(more))
            else:
                base = _Sequence(said, tokens.start(messages))
            context = base.prompt_ids + base.tokens
            left, over = self.limits.turn_budget(stats["turns"], len(base.prompt_ids), len(base.tokens))
            if over:  # the episode is truncated (what the agent returns is still its reward)
                with self._lock:
                    stats["truncated"] = 1
                raise ValueError(over)
            asked = body.get("max_tokens") or body.get("max_completion_tokens")
            budget = min(int(asked or left), left)
            if budget < 1:
                raise ValueError(f"max_tokens must be at least 1, got {asked}")
            ids, logprobs, eos = self.loop.submit(context, Sampling(
                n=1, temperature=self.temperature, top_p=self.top_p, max_new_tokens=budget)
            ).result(timeout=self.limits.step_timeout_s)
            text = self.decode(ids)
            calls = openai_tool_calls(text)
            with self._lock:
                stats["restarts"] += int(seq is not None and not extends)
                self.sequences[episode] = _Sequence(said + [("assistant", text)], base.prompt_ids, base.tokens + ids,
                                                    base.logprobs + logprobs, base.sampled + [1] * len(ids),
                                                    last_cut=not eos, last_text=text)
                stats["turns"] += 1
                stats["cut_turns"] += int(not eos)
                # the model's calls as the template writes them, those that do not parse among them, as an
                # environment's episodes count them (running them is the agent's part)
                stats["tool_calls"] += (opened := text.count("<tool_call>"))
                stats["invalid_calls"] += opened - len(calls)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model", "policy"),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text,
                                                     **({"tool_calls": calls} if calls else {})},
                             "finish_reason": ("tool_calls" if calls else "stop") if eos else "length"}],
                "usage": {"prompt_tokens": len(context), "completion_tokens": len(ids),
                          "total_tokens": len(context) + len(ids)}}

    def snapshot(self) -> tuple[dict, dict]:
        """(sequences, stats) as they stand, copied under the lock: late requests cannot tear them."""
        with self._lock:
            return dict(self.sequences), {k: dict(v) for k, v in self.stats.items()}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def agent_episodes(engine, tokenizer, records: list[dict], n: int, sampling: Sampling, agent, decode,
                   limits: EpisodeLimits) -> list[Rollout]:
    """`n` episodes of each record, each `agent(client, record)` against this engine's endpoint; grouped per
    record, in order, as `run_episodes` returns them. A request the limits leave no turn for is refused and
    truncates its episode; `limits.step_timeout_s` bounds a whole episode."""
    import openai

    timeout_s, failure_reward = limits.step_timeout_s, limits.failure_reward
    loop = EngineLoop(engine)
    endpoint = ChatEndpoint(loop, tokenizer, decode, limits, temperature=sampling.temperature, top_p=sampling.top_p)
    clients: dict = {}
    names = [f"{i}-{j}" for i in range(len(records)) for j in range(n)]
    try:
        # trust_env=False: an HTTP(S)_PROXY of the cluster's would take the loopback requests (and the key) away
        clients.update({name: openai.OpenAI(base_url=endpoint.url(name), api_key=endpoint.key, max_retries=0,
                                            timeout=timeout_s, http_client=openai.DefaultHttpxClient(trust_env=False))
                        for name in names})
        runs = {name: in_thread(agent, clients[name], records[i // n]) for i, name in enumerate(names)}
        deadline = time.monotonic() + timeout_s
        loop.run(lambda: all(f.done() for f in runs.values()), deadline)
        outcomes = {}
        for name, future in runs.items():
            try:
                reward = float(future.result(timeout=max(0.0, deadline - time.monotonic())))
                outcomes[name] = (reward, None) if math.isfinite(reward) else \
                    (failure_reward, f"agent returned a reward of {reward}")  # NaN would spread to the whole step
            except Exception as e:  # raised, or still running at the deadline (its thread is left behind)
                why = f"agent ran past step_timeout_s={timeout_s:g}" if not future.done() else \
                    f"agent raised {type(e).__name__}: {e}"
                outcomes[name] = (failure_reward, why)
    finally:
        loop.close()  # late requests are refused from here on
        endpoint.close()
        for client in clients.values():
            client.close()
    sequences, all_stats = endpoint.snapshot()
    rollouts = []
    for i, name in enumerate(names):
        reward, error = outcomes[name]
        seq = sequences.get(name) or _Sequence([], EpisodeTokens(tokenizer).start([{"role": "user", "content": ""}]))
        stats = {k: 0 for k in EPISODE_STATS} | all_stats.get(name, {})
        # A limit refused a request (stats["truncated"]): the episode is truncated, not failed, even where the
        # agent raised at the refusal (its return is then failure_reward; the error stays in its transcript).
        limited = bool(stats.get("truncated", 0))
        stats |= {"return": reward, "failed": int(error is not None and not limited), "truncated": int(seq.last_cut or
                  limited), "success": int(error is None and reward > 0 and not limited)}
        rollouts.append(Rollout(prompt_index=i // n, prompt_ids=seq.prompt_ids, token_ids=seq.tokens,
                                text=seq.last_text, logprobs=seq.logprobs,
                                finished=not stats["truncated"], sampled=seq.sampled,
                                turn_rewards=[(last_sampled(seq.sampled), reward)],
                                episode={**stats, "error": error}))
    return rollouts
