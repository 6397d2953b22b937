"""What an environment is, the tool-using kind, and how a round finds one by name.

    class MyEnv(Environment):
        def reset(self, sample: dict) -> list[dict]:          # the first observation: chat messages
            ...
        def step(self, message: dict) -> tuple[list[dict], float, bool, dict]:
            ...                                                # observation, reward, done, info

A round makes one environment per episode (`environment.name`: a bundled name, or `module:Class` from
the user's code, constructed with `environment.kwargs`), calls `reset` with the episode's data record,
then `step` with each model turn ({"role": "assistant", "content": text}). Rewards of every step are the
episode's return; the algorithm sees each where its turn ends. `info` may carry "success" (bool, the
evaluation's success rate; else a positive return counts as success), and "tool_calls",
"invalid_calls", "tool_errors" (counted per episode).

`ToolEnvironment` is the common case: `tools` run on the model's calls (alignflow/agents/tools.py), and
a turn without a call is the answer, scored by `score(sample, answer)`.
"""

from __future__ import annotations

import importlib

from alignflow.agents.tools import Tool, has_call, run_calls

BUNDLED = {"boxes": "alignflow.agents.boxes:BoxesEnvironment"}


def as_messages(prompt: str | list[dict]) -> list[dict]:
    """A record's prompt as chat messages: a string is one user turn."""
    return list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


class Environment:
    tools: list[Tool] = []

    def reset(self, sample: dict) -> list[dict]:
        raise NotImplementedError

    def step(self, message: dict) -> tuple[list[dict], float, bool, dict]:
        raise NotImplementedError


class ToolEnvironment(Environment):
    """Tool calls are run and their results observed; the first turn without one is the answer,
    rewarded with `score(sample, answer)` (1.0 / 0.0 for success by default)."""

    def reset(self, sample: dict) -> list[dict]:
        self.sample = sample
        return as_messages(sample["prompt"])

    def step(self, message: dict) -> tuple[list[dict], float, bool, dict]:
        text = message["content"]
        if has_call(text):
            out = run_calls(text, {t.name: t for t in self.tools})
            return out.messages, 0.0, False, {"tool_calls": out.calls, "invalid_calls": out.invalid,
                                             "tool_errors": out.errors}
        ok = self.score(self.sample, text)
        return [], float(ok), True, {"success": bool(ok)}

    def score(self, sample: dict, answer: str) -> float:
        return float(answer.strip() == str(sample.get("answer", "")).strip())


def load_environment(name: str, field: str = "environment.name") -> type:
    """The environment class `name` names: a bundled one (BUNDLED) or `module:Class`; errors name `field`."""
    path = BUNDLED.get(name, name)
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{field}: {name!r} is neither a bundled environment ({', '.join(sorted(BUNDLED))}) nor "
                         f"module:Class")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{field}: cannot import {path!r}: {e}") from e
    if not callable(getattr(cls, "reset", None)) or not callable(getattr(cls, "step", None)):
        raise ValueError(f"{field}: {path!r} has no reset(sample) and step(message): not an environment")
    return cls


def make_environment(name: str, kwargs: dict, field: str = "environment"):
    """One environment `name(**kwargs)`, checked: its class loads (`load_environment`), it constructs, and its
    tools are Tools with schemas. A ValueError names the field at fault (`field`.name / .kwargs / .tools)."""
    cls = load_environment(name, f"{field}.name")
    try:
        env = cls(**kwargs)
    except Exception as e:
        raise ValueError(f"{field}.kwargs: {name}(**{kwargs!r}) raised {type(e).__name__}: {e}") from e
    for t in getattr(env, "tools", None) or []:
        if not isinstance(t, Tool):
            raise ValueError(f"{field}.name: {name}'s tools hold {t!r}, not a Tool with a schema: wrap the function "
                             f"with alignflow.agents.tool (its schema from its signature) or Tool(fn, schema)")
    return env

