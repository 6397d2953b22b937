"""The OpenAI-compatible endpoint through which a user's agent drives its episodes (`environment.agent:
module:function`; engines/rollout/agentic.py runs the agents, each with a client of this endpoint).

`/v1/chat/completions` is served by the rollout engine's process on 127.0.0.1 (port chosen by the system)
under a key made for each generation: a request without it gets 401. Completions are sampled by the
engine (`EngineLoop`: the engine's own thread steps it, requests from any thread join its running batch)
at the round's temperature and top_p, whatever the agent asks (the samples stay on-policy); an agent's
`max_tokens` may only shorten a turn below max_tokens_per_turn. Requests of one episode are answered one
at a time. A request past the episode's `max_turns` completions, or with no tokens left of
`max_episode_tokens` or of the engine's context, is refused (400, saying which) and the episode counts as
truncated, as an environment's does. A request whose client leaves before its answer (its own timeout, or it
stopped) is given up: the engine drops it, and it is counted (`abandoned`). An episode's time in its requests is
kept: step_timeout_s bounds the rest, its agent's own (RequestClock), not a busy engine's answers.

What trains is what was sampled. The endpoint keeps each episode's token sequence: when a request's
messages extend the conversation it served before (role and content alike), only the new messages are
rendered and appended (`EpisodeTokens.observation`, masked), and the completion's tokens and log-probs
follow. A request that rewrites the conversation starts the sequence again from its render, and the
restart is counted (`restarts`; training takes the last sequence). Tool calls in a completion (the
template's `<tool_call>` format) come back as `tool_calls`, and are counted (those that do not parse as
invalid calls). `stream`, `n` > 1, `stop` and `logit_bias` get 400.
"""

from __future__ import annotations

import concurrent.futures
import json
import queue
import re
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from alignflow.agents.tools import openai_tool_calls
from engines.rollout.base import Sampling
from engines.rollout.episode_tokens import EpisodeTokens, ServedSequence, continues, flat, said
from engines.rollout.episodes import EpisodeLimits, RequestClock

PATH = re.compile(r"^/e/([A-Za-z0-9_-]+)/v1/chat/completions$")


class EngineLoop:
    """Requests from any thread (`submit`), served by the thread that calls `run`: the one the engine lives
    on. (vLLM's CPU attention checks that its metadata and its kernels see the same OpenMP thread count,
    which is a thread's own setting: an engine stepped from a second thread fails that check.) A request
    given up (`cancel`) leaves the engine on that thread too: dropped before it starts, or aborted mid-sequence
    (vLLM; the transformers engine generates a step's batch whole). `counts`: requests answered and given up."""

    def __init__(self, engine):
        self.engine, self._inbox, self._waiting = engine, queue.Queue(), {}
        self._closed, self._lock = False, threading.Lock()  # the lock: _closed, and settling futures
        self.counts = {"answered": 0, "abandoned": 0}

    def submit(self, prompt_ids: list[int], sampling: Sampling) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                future.set_exception(RuntimeError("the generation these episodes belonged to has ended"))
            else:
                self._inbox.put((prompt_ids, sampling, future))
        return future

    def cancel(self, future: Future) -> bool:
        """Give up `submit`'s request: no more compute goes to an answer nobody will read. False where the
        answer came first (then `future.result()` has it)."""
        with self._lock:
            if not future.cancel():
                return False
        self._inbox.put((None, None, future))  # the engine's thread drops it
        return True

    def _settle(self, future: Future, result=None, error: BaseException | None = None) -> bool:
        """Whether it was settled: not where it was given up meanwhile (its drop is queued behind)."""
        with self._lock:
            if future.cancelled():
                return False
            future.set_exception(error) if error is not None else future.set_result(result)
            return True

    def run(self, done, deadline: float = float("inf")) -> None:
        """Serve until `done()` (or the monotonic `deadline`: tests' bound)."""
        while not done() and time.monotonic() < deadline:
            try:
                while True:
                    prompt_ids, sampling, future = self._inbox.get(timeout=0.0 if self.engine.busy() else 0.02)
                    if prompt_ids is None:  # `cancel`: abort it where the engine has it
                        self.engine.abort([k for k, f in self._waiting.items() if f is future])
                        self._waiting = {k: f for k, f in self._waiting.items() if f is not future}
                        self.counts["abandoned"] += 1
                        continue
                    if future.cancelled():  # given up before the engine saw it
                        continue
                    key = uuid.uuid4().hex
                    try:
                        self.engine.add(key, prompt_ids, sampling)
                        self._waiting[key] = future
                    except Exception as e:  # a request the engine refuses fails that request, not the loop
                        self._settle(future, error=e)
            except queue.Empty:
                pass
            if self.engine.busy():
                for key, ids, logprobs, eos in self.engine.step():
                    self.counts["answered"] += self._settle(self._waiting.pop(key), (ids, logprobs, eos))

    def close(self) -> None:
        """Requests still queued or generating are dropped from the engine, their callers told; later ones are
        refused at once."""
        with self._lock:
            self._closed = True
        self.engine.abort(list(self._waiting))
        while not self._inbox.empty():
            self._waiting[uuid.uuid4().hex] = self._inbox.get_nowait()[2]
        for future in self._waiting.values():
            self._settle(future, error=RuntimeError("the generation these episodes belonged to has ended"))
        self._waiting = {}


# Request fields the endpoint cannot honour and keep the turn on-policy and recorded: refused, not ignored.
UNSERVED = {"stream": "streaming is not served: ask without stream", "n": "one choice per request (n: 1)",
            "stop": "stop sequences would end turns the policy did not end: leave stop out",
            "logit_bias": "logit_bias changes the policy's distribution"}


def _unserved(body: dict) -> str | None:
    bad = [k for k, v in body.items() if k in UNSERVED and v not in (None, False, [], {}) and (k, v) != ("n", 1)]
    return f"{bad[0]}={body[bad[0]]!r}: {UNSERVED[bad[0]]}" if bad else None


class Abandoned(RuntimeError):
    """A request given up before its answer: its client left."""


# How often a waiting request checks that its client is still there: a client that left costs at most this
# much more generation (plus the engine step under way) before the engine drops its request.
GONE_POLL_S = 0.5


class _Server(ThreadingHTTPServer):
    request_queue_size = 1024  # every episode's agent may connect at once (the default backlog is 5)
    daemon_threads = True


class ChatEndpoint:
    def __init__(self, loop: EngineLoop, tokenizer, decode, limits: EpisodeLimits, *, temperature: float,
                 top_p: float):
        """`limits`: an environment's (EpisodeLimits.turn_budget)."""
        self.loop, self.tokenizer, self.decode, self.limits = loop, tokenizer, decode, limits
        self.temperature, self.top_p, self.key = temperature, top_p, secrets.token_urlsafe(24)
        self.sequences: dict[str, ServedSequence] = {}
        self.stats: dict[str, dict[str, int]] = {}
        self.clock = RequestClock()  # each episode's time in its requests, and its agent's own
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
                    self._send(200, endpoint.complete(match.group(1), body, gone=self._gone))
                except Abandoned as e:
                    self.close_connection = True  # a client that left is told nothing
                except Exception as e:  # the agent's bad request is its episode's problem, told to it
                    self._send(400, {"error": {"message": f"{type(e).__name__}: {e}", "type": "invalid_request"}})

            def _gone(self) -> bool:
                """The client closed its connection (its own timeout, or it stopped): the socket reads as ended.
                (So does one that only shut down its sending side to wait for the answer, as `nc -N` does.)"""
                try:
                    return self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
                except BlockingIOError:  # nothing to read: still there
                    return False
                except OSError:  # reset by the client
                    return True

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

    def complete(self, episode: str, body: dict, gone: Callable[[], bool] = lambda: False) -> dict:
        """One completion of `episode`'s conversation. Requests of one episode are answered one at a time, and
        its sequence changes only once the completion is in: a refused request leaves it as it was. Sampling is
        the round's (temperature, top_p: on-policy, whatever the agent asks); `max_tokens` may only shorten a
        turn. A request whose client is `gone()` before its answer is given up (`Abandoned`, counted): the engine
        drops it, and the episode stays as it was. Its time is the engine's, not the agent's (RequestClock)."""
        with self.clock.request(episode):
            return self._complete(episode, body, gone)

    def _complete(self, episode: str, body: dict, gone: Callable[[], bool]) -> dict:
        with self._lock:
            lock = self._episode_locks.setdefault(episode, threading.Lock())
            stats = self.stats.setdefault(episode, {"turns": 0, "cut_turns": 0, "restarts": 0, "tool_calls": 0,
                                                    "invalid_calls": 0, "abandoned": 0})
        with lock:
            messages, tools = [flat(m) for m in body["messages"]], body.get("tools") or None
            tokens, spoken = EpisodeTokens(self.tokenizer, tools), said(messages)
            seq = self.sequences.get(episode)
            extends = seq is not None and continues(seq.messages, messages)
            if extends:
                more = tokens.observation(messages[len(seq.messages):],
                                          seq.tokens[-1] if seq.tokens and not seq.last_cut else None)
                base = ServedSequence(seq.messages + spoken[len(seq.messages):], seq.prompt_ids, seq.tokens + more,
                                      seq.logprobs + [0.0] * len(more), seq.sampled + [0] * len(more))
            else:
                base = ServedSequence(spoken, tokens.start(messages))
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
            future = self.loop.submit(context, Sampling(n=1, temperature=self.temperature, top_p=self.top_p,
                                                        max_new_tokens=budget))
            try:
                ids, logprobs, eos = self._answer(future, gone)
            except Abandoned:
                with self._lock:
                    stats["abandoned"] += 1
                raise
            text = self.decode(ids)
            calls = openai_tool_calls(text)
            with self._lock:
                stats["restarts"] += int(seq is not None and not extends)
                self.sequences[episode] = ServedSequence(
                    base.messages + [("assistant", text)], base.prompt_ids, base.tokens + ids, base.logprobs + logprobs,
                    base.sampled + [1] * len(ids), last_cut=not eos, last_text=text)
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

    def _answer(self, future: Future, gone: Callable[[], bool]) -> tuple[list[int], list[float], bool]:
        """The engine's answer; a generation is bounded by its tokens (the turn's budget), so the wait is given
        up only where the client left."""
        while True:
            try:
                return future.result(timeout=GONE_POLL_S)
            except concurrent.futures.TimeoutError:
                if gone() and self.loop.cancel(future):  # else the answer came meanwhile: taken at the next round
                    raise Abandoned("request given up: its client closed the connection") from None

    def snapshot(self) -> tuple[dict, dict]:
        """(sequences, stats) as they stand, copied under the lock: late requests cannot tear them."""
        with self._lock:
            return dict(self.sequences), {k: dict(v) for k, v in self.stats.items()}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
