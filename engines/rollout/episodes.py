"""Episodes run to their end on one rollout engine, each at its own pace.

Every episode is one token sequence after its prompt: the turns the policy sampled (their log-probs
kept, `Rollout.sampled` 1) and the observations between them (`sampled` 0: prompt, environment and tool
tokens carry no loss). When a turn ends, that episode's environment step runs in a thread of its own
while the engine goes on generating the other episodes' turns; its next turn joins the engine's running
batch as soon as the step returns. No episode waits for another.

A turn cut by its token limit (`max_tokens_per_turn`) still goes to the environment, as an API's
`finish_reason: length` message goes to an agent; it is counted (`cut_turns`). An episode ends
  - done: the environment said so. If its last turn was cut, the episode counts as truncated
    (`Rollout.finished` False, so reward.truncation_penalty applies, as to a single-turn response cut by
    its length limit);
  - truncated: `max_turns` turns without done, or no tokens left of `max_episode_tokens` (or of the
    engine's context) for another turn;
  - failed: its environment raised, returned something that is not (observation, reward, done, info),
    or took longer than `step_timeout_s` (the thread is left behind). Its return is `failure_reward`.
A single-turn round is the case of an environment that is done after the first turn.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

from engines.rollout.episode_tokens import EpisodeTokens
from engines.rollout.base import Rollout, Sampling

log = logging.getLogger("alignflow")

# What every episode reports (Rollout.episode), summed or averaged into agent/* and eval/* metrics.
EPISODE_STATS = ("turns", "cut_turns", "tool_calls", "invalid_calls", "tool_errors", "truncated", "failed", "success",
                 "return", "restarts", "abandoned", "no_requests")


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int
    max_tokens_per_turn: int
    max_episode_tokens: int
    max_model_len: int
    step_timeout_s: float
    failure_reward: float

    def turn_budget(self, turns: int, prompt_tokens: int, episode_tokens: int) -> tuple[int, str | None]:
        """(new tokens the next turn may sample, None), or (0, why none: the episode is then truncated), after
        `turns` turns and `episode_tokens` tokens after a prompt of `prompt_tokens`. An environment's episodes
        and an agent's endpoint both keep to it."""
        room = self.max_model_len - prompt_tokens - episode_tokens
        if turns >= self.max_turns:
            return 0, f"the episode has had its max_turns={self.max_turns} turns"
        if room < 1:
            return 0, (f"the conversation fills the model's context ({prompt_tokens + episode_tokens} of "
                       f"{self.max_model_len} tokens)")
        if self.max_episode_tokens - episode_tokens < 1:
            return 0, f"the episode has used its max_episode_tokens={self.max_episode_tokens}"
        return min(self.max_tokens_per_turn, self.max_episode_tokens - episode_tokens, room), None


@dataclass
class _Episode:
    row: int
    prompt_index: int
    env: object
    prompt_ids: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    turn_rewards: list[tuple[int, float]] = field(default_factory=list)
    last_text: str = ""
    stats: dict = field(default_factory=lambda: {k: 0 for k in EPISODE_STATS})
    error: str | None = None
    truncated_by: str | None = None
    ended: bool = False
    finished: bool = True
    last_cut: bool = False


def last_sampled(sampled: list[int]) -> int:
    """The index of the last token the policy sampled (0 where none was): where a reward that ends a turn or
    an episode lands, never on an observation token, which no estimator reads."""
    return max((i for i, s in enumerate(sampled) if s), default=0)


def in_thread(fn: Callable, *args) -> Future:
    """`fn(*args)` in a daemon thread of its own: one that hangs is abandoned, never joined."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # the episode's failure, reported to the loop
            future.set_exception(e)

    threading.Thread(target=run, daemon=True, name="alignflow-env-step").start()
    return future


class RequestClock:
    """Each episode's seconds in its requests to the engine, and so the rest: its agent's own, which
    step_timeout_s bounds (engines/rollout/agentic.py). A busy engine's answers are not the agent's time."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open: dict[str, tuple[int, float]] = {}  # requests in flight, and since when (monotonic)
        self._served: dict[str, float] = {}  # seconds in requests that ended

    @contextlib.contextmanager
    def request(self, episode: str) -> Iterator[None]:
        with self._lock:
            n, since = self._open.get(episode, (0, time.monotonic()))
            self._open[episode] = (n + 1, since)
        try:
            yield
        finally:
            with self._lock:
                n, since = self._open.pop(episode)
                if n > 1:  # an agent asking twice at once: the episode is in a request until both end
                    self._open[episode] = (n - 1, since)
                else:
                    self._served[episode] = self._served.get(episode, 0.0) + time.monotonic() - since

    def agent_seconds(self, episode: str, started: float) -> float:
        """Seconds since `started` (monotonic) that `episode` spent outside its requests."""
        now = time.monotonic()
        with self._lock:
            since = self._open.get(episode, (0, now))[1]
            return now - started - self._served.get(episode, 0.0) - (now - since)


def _checked_step(result) -> tuple[list[dict], float, bool, dict]:
    if not (isinstance(result, tuple) and len(result) == 4):
        raise TypeError(f"step returned {type(result).__name__}, not (observation, reward, done, info)")
    obs, reward, done, info = result
    if not isinstance(obs, list) or not all(isinstance(m, dict) and "role" in m for m in obs):
        raise TypeError(f"step's observation must be a list of chat messages, got {obs!r:.80}")
    if not math.isfinite(reward := float(reward)):  # a NaN return would spread to the whole step's loss
        raise ValueError(f"step returned a reward of {reward}")
    return obs, reward, bool(done), dict(info or {})


def run_episodes(engine, tokenizer, records: list[dict], n: int, sampling: Sampling,
                 make_env: Callable[[], object], limits: EpisodeLimits, decode: Callable[[list[int]], str]
                 ) -> list[Rollout]:
    """`n` episodes of each record on `engine` (its add / step / busy), grouped per record in order.
    `sampling.max_new_tokens` is ignored: each turn gets what `limits` leave it."""
    made = [in_thread(make_env) for _ in range(len(records) * n)]  # a constructor that raises or hangs fails
    wait(made, timeout=limits.step_timeout_s)                         # its episode, not the round
    episodes = [_Episode(row=k, prompt_index=k // n, env=f.result() if f.done() and not f.exception() else None)
                for k, f in enumerate(made)]
    tools = next((getattr(ep.env, "tools", None) for ep in episodes if ep.env is not None), None)
    tokens = EpisodeTokens(tokenizer, [t.schema for t in tools] if tools else None)
    pending: dict[Future, tuple[_Episode, str, float]] = {}  # env call -> (episode, "reset"/"step", deadline)

    def call(ep: _Episode, what: str, fn: Callable, *args) -> None:
        pending[in_thread(fn, *args)] = (ep, what, time.monotonic() + limits.step_timeout_s)

    def fail(ep: _Episode, why: str) -> None:
        ep.error, ep.ended = why, True
        ep.stats["failed"], ep.stats["return"] = 1, limits.failure_reward
        ep.turn_rewards = [(last_sampled(ep.sampled), limits.failure_reward)]

    def truncate(ep: _Episode, why: str) -> None:
        ep.ended, ep.finished, ep.stats["truncated"], ep.truncated_by = True, False, 1, why

    def next_turn(ep: _Episode, more: list[int]) -> None:
        """The episode's next turn, after the observation tokens `more`. Where the limits leave no room for one,
        the episode is truncated and `more` is not kept: no turn reads it, and it could pass the context."""
        budget, why = limits.turn_budget(ep.stats["turns"], len(ep.prompt_ids), len(ep.tokens) + len(more))
        if budget < 1:
            return truncate(ep, why)
        ep.tokens += more
        ep.logprobs += [0.0] * len(more)
        ep.sampled += [0] * len(more)
        engine.add(ep.row, ep.prompt_ids + ep.tokens, Sampling(n=1, temperature=sampling.temperature,
                                                               top_p=sampling.top_p, max_new_tokens=budget,
                                                               ignore_eos=sampling.ignore_eos))

    def observed(ep: _Episode, what: str, result) -> None:
        if what == "reset":
            ep.prompt_ids = tokens.start(result)
            return next_turn(ep, [])
        obs, reward, done, info = _checked_step(result)
        for k in ("tool_calls", "invalid_calls", "tool_errors"):
            ep.stats[k] += int(info.get(k, 0))
        if reward:
            ep.turn_rewards.append((last_sampled(ep.sampled), reward))
            ep.stats["return"] += reward
        if done:
            ep.ended = True
            ep.stats["success"] = int(info.get("success", ep.stats["return"] > 0))
            if ep.last_cut:
                ep.finished, ep.stats["truncated"] = False, 1
            return
        next_turn(ep, tokens.observation(obs, ep.tokens[-1] if ep.tokens and not ep.last_cut else None))

    by_row = {ep.row: ep for ep in episodes}
    for ep, record in zip(episodes, (r for r in records for _ in range(n))):
        if ep.env is None:
            f = made[ep.row]
            fail(ep, f"environment construction: {type(f.exception()).__name__}: {f.exception()}" if f.done() else
                 f"environment construction took longer than step_timeout_s={limits.step_timeout_s:g}")
        else:
            call(ep, "reset", ep.env.reset, record)
    try:
        _run(engine, pending, by_row, observed, fail, call, decode, limits.step_timeout_s)
    finally:  # whatever ends the loop, nothing of these episodes stays queued in the engine
        engine.abort(list(by_row))
    for ep in episodes:
        if not ep.prompt_ids:  # its reset failed: an empty user turn for a prompt, nothing sampled after it
            ep.prompt_ids = tokens.start([{"role": "user", "content": ""}])
    return [Rollout(prompt_index=ep.prompt_index, prompt_ids=ep.prompt_ids, token_ids=ep.tokens, text=ep.last_text,
                    logprobs=ep.logprobs, finished=ep.finished, sampled=ep.sampled, turn_rewards=ep.turn_rewards,
                    episode={**ep.stats, "error": ep.error, "truncated_by": ep.truncated_by}) for ep in episodes]


def _run(engine, pending: dict, by_row: dict, observed: Callable, fail: Callable, call: Callable, decode: Callable,
         timeout_s: float) -> None:
    """Until no environment call is pending and the engine is idle: take what environments answered (failing
    those past their deadline), step the engine, and give each ended turn to its environment."""
    while pending or engine.busy():
        for future in [f for f in pending if f.done()]:
            ep, what, _ = pending.pop(future)
            try:
                observed(ep, what, future.result())
            except BaseException as e:  # SystemExit from a tool, CancelledError from asyncio: that episode's end
                if isinstance(e, KeyboardInterrupt):
                    raise
                fail(ep, f"environment {what}: {type(e).__name__}: {e}")
        now = time.monotonic()
        for future in [f for f, (_, _, deadline) in pending.items() if deadline < now]:
            ep, what, _ = pending.pop(future)
            fail(ep, f"environment {what} took longer than step_timeout_s={timeout_s:g}")
        if engine.busy():
            for row, ids, logprobs, eos in engine.step():
                ep = by_row[row]
                ep.tokens += ids
                ep.logprobs += logprobs
                ep.sampled += [1] * len(ids)
                ep.stats["turns"] += 1
                ep.stats["cut_turns"] += int(not eos)
                ep.last_cut, ep.last_text = not eos, decode(ids)
                call(ep, "step", ep.env.step, {"role": "assistant", "content": ep.last_text})
        elif pending:
            wait(list(pending), timeout=max(0.0, min(d for _, _, d in pending.values()) - time.monotonic()),
                 return_when=FIRST_COMPLETED)


class NothingSampled(RuntimeError):
    """Not one episode of a batch got to sample a token: each failed or was truncated before its first turn."""


def report_failures(rollouts: list[Rollout], where: str) -> None:
    """Warnings naming how many episodes failed, and how many were truncated before their first turn (their first
    observation leaves the model no room), each with the first few distinct reasons. Where no episode sampled a
    token at all, NothingSampled: a round would train on nothing and an evaluation score nothing."""
    episodes = [r.episode for r in rollouts if r.episode is not None]
    errors = [e["error"] for e in episodes if e.get("error")]
    unstarted = [e["truncated_by"] for e in episodes if e.get("truncated_by") and not e["turns"]]
    silent = ["the agent returned without a request to the endpoint: its return counts in its group, over no "
              "tokens"] * sum(e.get("no_requests", 0) for e in episodes)
    kinds = (("failed", errors), ("were truncated before their first turn", unstarted), ("sampled nothing", silent))
    for what, reasons in kinds:
        if reasons:
            log.warning("%s: %d of %d episodes %s: %s", where, len(reasons), len(rollouts), what,
                        "; ".join(list(dict.fromkeys(reasons))[:3]))
    if episodes and not any(any(r.sampled) if r.sampled is not None else r.token_ids for r in rollouts):
        reasons = list(dict.fromkeys(errors + unstarted))[:3]
        raise NothingSampled(f"{where}: none of the {len(rollouts)} episodes sampled a token "
                             f"({len(errors)} failed, {len(unstarted)} truncated before their first turn): "
                             + "; ".join(reasons))


def episode_metrics(rollouts: list[Rollout], prefix: str = "agent") -> dict[str, float]:
    """Per episode: success rate, return, turns, tool calls, invalid calls, tool errors, and the shares truncated
    and failed, as `prefix`/<name> means; nothing for single responses."""
    stats = [r.episode for r in rollouts if r.episode is not None]
    if not stats:
        return {}
    names = {"success": "success_rate", "truncated": "truncated_fraction", "failed": "failed_fraction",
             "no_requests": "no_requests_fraction"}
    name = lambda k: names.get(k, k if k == "return" else k + "_per_episode")  # noqa: E731
    return {f"{prefix}/{name(k)}": sum(s[k] for s in stats) / len(stats) for k in EPISODE_STATS}
