"""Reward sources for RL rounds: a reward model, a rule, or a remote service.

A rule or a remote service answers, for each (prompt, response, answer),
a float: both are callables on a list of ScoredText. The reward model
scores token sequences instead and runs in a ScorerActor (engines/rl/scoring.py).
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

from alignflow.config.loading import load_callable
from alignflow.redact import redact_url, request_target


class RewardServiceError(RuntimeError):
    """The remote reward service failed or answered something unusable."""


@dataclass(frozen=True)
class ScoredText:
    prompt: str
    response: str
    answer: str | None


def prompt_text(prompt: str | Sequence[dict]) -> str:
    """A record's prompt as rules and judges read it (ScoredText.prompt): a string as it is, chat messages'
    contents one per line."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(m.get("content", "")) for m in prompt)


class RuleReward:
    """A Python function `f(prompt, response, answer) -> float` named by import path."""

    def __init__(self, path: str):
        self.fn = load_callable(path, "reward.rule")

    def __call__(self, items: list[ScoredText]) -> list[float]:
        return [float(self.fn(i.prompt, i.response, i.answer)) for i in items]


class RemoteReward:
    """POST {"prompts", "responses", "answers"} -> {"rewards": [...]} over HTTP.

    Each request has a timeout; failures (connection refused, timeouts, 5xx)
    are retried `max_retries` times with exponential backoff, then raised as
    RewardServiceError naming the URL, the attempts and the last error. A
    4xx answer or a malformed body is not retried.
    """

    def __init__(self, url: str, timeout_s: float, max_retries: int, backoff_s: float = 0.5, field: str = "reward.url"):
        # `${NAME}`s filled in from this process's environment, a `user:password@` sent as basic auth.
        self.url, self.headers = request_target(url, field)
        self.timeout_s, self.max_retries, self.backoff_s = timeout_s, max_retries, backoff_s
        self.name = f"reward service {redact_url(url)}"  # what errors say: the URL without its credentials

    def __call__(self, items: list[ScoredText]) -> list[float]:
        body = json.dumps({
            "prompts": [i.prompt for i in items],
            "responses": [i.response for i in items],
            "answers": [i.answer for i in items],
        }).encode()
        last: Exception | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            request = urllib.request.Request(self.url, data=body,
                                             headers={"Content-Type": "application/json", **self.headers})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
                    return self._parse(resp.read(), len(items))
            except urllib.error.HTTPError as err:
                if err.code < 500:
                    raise RewardServiceError(f"{self.name} rejected the request: HTTP {err.code}") from None
                last = err
            except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
                last = err
            except http.client.HTTPException as err:  # a malformed answer; its text may quote the URL: named only
                last = type(err).__name__
        raise RewardServiceError(
            f"{self.name} failed after {self.max_retries + 1} attempts "
            f"(timeout {self.timeout_s}s each): {last}"
        )

    def _parse(self, raw: bytes, n: int) -> list[float]:
        try:
            rewards = json.loads(raw)["rewards"]
            values = [float(r) for r in rewards]
        except (ValueError, KeyError, TypeError) as err:
            raise RewardServiceError(f"{self.name} answered without a list 'rewards': {err}") from None
        if len(values) != n:
            raise RewardServiceError(f"{self.name} returned {len(values)} rewards for {n} responses")
        return values
