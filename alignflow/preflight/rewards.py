"""Preflight's code and services: rule rewards, the checker, agents and environments import; remote reward
services answer a test request."""

from __future__ import annotations

import http.client
import importlib
import inspect
import json
import urllib.error
import urllib.request

from alignflow.config import PipelineConfig
from alignflow.preflight.findings import Findings
from alignflow.errors import ConfigError
from alignflow.redact import redact_url, request_target

REMOTE_TIMEOUT_CAP_S = 10.0


def _callable(field: str, path: str, found: Findings, args: tuple[str, ...]) -> None:
    """`module:function` imports, is callable (as alignflow/config/loading.py load_callable loads it), and takes
    the positional arguments `args` it will be called with: a function of other arguments would raise its
    TypeError only at run time, after generation (a rule's at a round's first step)."""
    module, _, name = path.partition(":")
    if not name:
        return found.fail(field, f"{path!r} must be 'module:function'")
    try:
        fn = getattr(importlib.import_module(module), name)
    except Exception as err:  # noqa: BLE001  (the module may fail in any way while importing)
        return found.fail(field, f"{path!r} cannot be imported: {type(err).__name__}: {err}")
    if not callable(fn):
        return found.fail(field, f"{path!r} is not callable")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or extension function without one: called as it is
        return found.ok()
    try:
        signature.bind(*args)
    except TypeError as err:
        bare = signature.replace(parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
                                 return_annotation=signature.empty)
        return found.fail(field, f"{path!r} is called as f({', '.join(args)}), but takes {bare}: {err}")
    found.ok()


def _remote(field: str, url: str, timeout_s: float, found: Findings) -> None:
    """One request in engines/rl/rewards.py RemoteReward's protocol (POST prompts/responses/answers -> rewards)."""
    body = json.dumps({"prompts": ["preflight"], "responses": ["preflight"], "answers": [None]}).encode()
    shown = redact_url(url)  # what the findings say: the URL without its credentials
    try:
        target, headers = request_target(url, field)
    except ConfigError as err:  # a `${NAME}` the environment does not set
        return found.fail(field, str(err).removeprefix(f"{field}: "))
    request = urllib.request.Request(target, data=body, headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            rewards = json.loads(resp.read())["rewards"]
        [value] = rewards  # ValueError unless exactly one
        float(value)
    except urllib.error.HTTPError as err:
        return found.fail(field, f"{shown} answered a test request with HTTP {err.code}")
    except http.client.HTTPException as err:  # named only: its text may quote the URL, credentials filled in
        return found.fail(field, f"{shown} answered a test request malformed ({type(err).__name__})")
    except OSError as err:  # URLError (refused, unknown host), a timeout
        return found.fail(field, f"{shown} did not answer a test request (timeout {timeout_s:g} s): "
                                 f"{getattr(err, 'reason', err)}")
    except (ValueError, KeyError, TypeError) as err:
        return found.fail(field, f"{shown} answered a test request without a list 'rewards' of one number: {err}")
    found.ok()


def check_rewards(cfg: PipelineConfig, found: Findings) -> None:
    for i, r in enumerate(cfg.rounds):
        for field, c in r.reward.source_fields(f"rounds.{i}.reward"):
            if c.source == "rule":
                _callable(f"{field}.rule", c.rule, found, ("prompt", "response", "answer"))
            elif c.source == "remote":
                _remote(f"{field}.url", c.url, min(c.timeout_s, REMOTE_TIMEOUT_CAP_S), found)
    if cfg.evaluation is not None:
        _callable("evaluation.checker", cfg.evaluation.checker, found, ("response", "answer"))
        if cfg.evaluation.vote_on:
            _callable("evaluation.vote_on", cfg.evaluation.vote_on, found, ("response",))
        exact = type(cfg.evaluation).model_fields["checker"].default
        if cfg.data.source == "files" and cfg.evaluation.checker == exact and cfg.evaluation.environment is None:
            found.notes.append(
                f"evaluation.checker: {exact} (the bundled tasks' check: the whole response equal to the answer) "
                "scores your data; where responses reason before their answer, eval/accuracy and pass@k read near "
                "0: alignflow.rewards:math_correct checks a final mathematical answer, or name your own "
                f"({found.sources.of('evaluation.checker')})")
    envs = [(f"rounds.{i}.environment", r.environment) for i, r in enumerate(cfg.rounds)]
    for field, env in envs + [("evaluation.environment", cfg.evaluation and cfg.evaluation.environment)]:
        if env is not None and env.agent:
            _callable(f"{field}.agent", env.agent, found, ("client", "sample"))
        elif env is not None:  # imports, is an environment, constructs, and its tools carry schemas
            from alignflow.agents.environment import make_environment

            try:
                make_environment(env.name, env.kwargs, field)
                found.ok()
            except ValueError as err:
                found.fail(*str(err).split(": ", 1))
