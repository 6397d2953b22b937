"""Tools a policy calls: Python functions with a JSON schema, and the calls parsed from its text.

    @tool
    def open_box(box: int) -> str:
        "The code inside box `box`."
        ...

`tool` reads the schema from the signature (every parameter needs a type: int, float, str, bool, list,
dict) and the docstring; `Tool(fn, schema)` takes a schema as written. Schemas reach the model through
its tokenizer's chat template (`apply_chat_template(tools=...)`), and calls come back in the Hermes
format most templates use (Qwen2/2.5/3, the tiny default):

    <tool_call>{"name": "open_box", "arguments": {"box": 37}}</tool_call>

A call that is not JSON, names no known tool, has wrong arguments, or whose tool raises becomes an
error observation the model reads, and is counted (`ToolOutcome`): it never ends a round.
`python` runs code in a subprocess with a time limit, a memory limit and a temporary working directory.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
OPEN_CALL = "<tool_call>"
_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


class ToolSchemaError(ValueError):
    """A tool whose schema cannot be made or is malformed (names the tool and what is missing)."""


@dataclass(frozen=True)
class Tool:
    fn: Callable[..., Any]
    schema: dict  # OpenAI function-tool form: {"type": "function", "function": {"name", "description", "parameters"}}

    def __post_init__(self) -> None:
        f = self.schema.get("function") if isinstance(self.schema, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(f.get("parameters"), dict):
            raise ToolSchemaError(f"tool {getattr(self.fn, '__name__', self.fn)!r}: its schema needs "
                                  f"{{'type': 'function', 'function': {{'name': str, 'parameters': {{...}}}}}}, got "
                                  f"{self.schema!r}")

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


def tool(fn: Callable[..., Any]) -> Tool:
    """A Tool whose schema comes from `fn`'s signature and docstring; a parameter without a JSON type is a
    ToolSchemaError naming it (give it an annotation, or build `Tool(fn, schema)`)."""
    props, required = {}, []
    for name, p in inspect.signature(fn).parameters.items():
        kind = _JSON_TYPES.get(p.annotation) if not isinstance(p.annotation, str) else \
            {t.__name__: j for t, j in _JSON_TYPES.items()}.get(p.annotation)
        if kind is None:
            raise ToolSchemaError(f"tool {fn.__name__!r}: parameter {name!r} has no JSON type (annotate it as one of "
                                  f"{sorted(t.__name__ for t in _JSON_TYPES)}, or give Tool(fn, schema))")
        props[name] = {"type": kind}
        if p.default is inspect.Parameter.empty:
            required.append(name)
    return Tool(fn, {"type": "function", "function": {
        "name": fn.__name__, "description": inspect.getdoc(fn) or "",
        "parameters": {"type": "object", "properties": props, "required": required}}})


@dataclass
class ToolOutcome:
    """What a turn's tool calls came to: the observation messages, and the counts."""

    messages: list[dict] = field(default_factory=list)
    calls: int = 0
    invalid: int = 0  # not JSON, no such tool, wrong arguments
    errors: int = 0  # the tool raised


def has_call(text: str) -> bool:
    return OPEN_CALL in text


def run_calls(text: str, tools: dict[str, Tool]) -> ToolOutcome:
    """Each `<tool_call>` of `text` run, in order; one "tool" message per call. An opened call that never
    closes counts as invalid."""
    out = ToolOutcome()
    bodies = CALL.findall(text)
    if text.count(OPEN_CALL) > len(bodies):
        bodies.append(None)
    for body in bodies:
        out.calls += 1
        content, kind = _run_one(body, tools)
        if kind == "invalid":
            out.invalid += 1
        elif kind == "error":
            out.errors += 1
        out.messages.append({"role": "tool", "content": content})
    return out


def openai_tool_calls(text: str) -> list[dict]:
    """The `<tool_call>`s of a completion as OpenAI's `tool_calls` (arguments a JSON string); a call that does
    not parse (`parse_call`, as an environment's episodes parse them) is left out, as it stays in the text."""
    parsed = [parse_call(body)[0] for body in CALL.findall(text)]
    return [{"id": f"call_{i}", "type": "function", "function": {"name": call["name"],
                                                                 "arguments": json.dumps(call["arguments"])}}
            for i, call in enumerate(c for c in parsed if c is not None)]


def parse_call(body: str | None) -> tuple[dict | None, str]:
    """A `<tool_call>` body (None: opened, never closed) as ({"name": str, "arguments": dict}, "") or (None,
    why not). `arguments` may be an object or a JSON string of one (as OpenAI's API writes it); absent, {}."""
    if body is None:
        return None, "error: a <tool_call> was opened and never closed"
    try:
        call = json.loads(body)
    except ValueError as e:  # JSONDecodeError, or an integer past Python's 4300 digits
        return None, f"error: the tool call is not JSON ({getattr(e, 'msg', e)})"
    except RecursionError:  # nested past the parser's depth: [[[[... from a collapsed policy
        return None, "error: the tool call is nested too deeply to parse"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None, 'error: a tool call is {"name": ..., "arguments": {...}}'
    args = call.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            pass
    if not isinstance(args, dict):
        return None, "error: arguments must be an object (or a JSON string of one)"
    return {"name": call["name"], "arguments": args}, ""


def _run_one(body: str | None, tools: dict[str, Tool]) -> tuple[str, str]:
    call, why = parse_call(body)
    if call is None:
        return why, "invalid"
    t = tools.get(call["name"])
    if t is None:
        return f"error: no tool {call['name']!r}; tools: {', '.join(sorted(tools))}", "invalid"
    args = call["arguments"]
    params = t.schema["function"]["parameters"]
    missing = [k for k in params.get("required", []) if k not in args]
    unknown = [k for k in args if k not in params.get("properties", {})]
    if missing or unknown:
        return f"error: {t.name} takes {sorted(params.get('properties', {}))}; missing {missing}, unknown {unknown}", \
            "invalid"
    try:
        return str(t.fn(**args)), "ok"
    except Exception as e:  # the tool's failure is the model's observation, not the round's end
        return f"error: {t.name} raised {type(e).__name__}: {e}", "error"


_PYTHON_RUNNER = """
import resource, sys
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
code = sys.stdin.read()
exec(compile(code, "<tool>", "exec"), {"__name__": "__tool__"})
"""


def _tool_env(home: str) -> dict[str, str]:
    """The environment the model's code gets: what a Python needs to run, none of this process's credentials
    (HF_TOKEN, cloud keys, the endpoint's), which its output would carry into observations and transcripts. Its
    math libraries take one thread: OpenBLAS and OpenMP otherwise start one per core as numpy loads, whose stacks
    on a many-core GPU node pass the address-space limit, and the import fails."""
    keep = ("PATH", "LANG", "LC_ALL", "TZ", "SYSTEMROOT")
    one = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    return {k: os.environ[k] for k in keep if k in os.environ} | {"HOME": home, "TMPDIR": home} | one


def python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, max_output: int = 2000) -> str:
    """Run `code` in a fresh Python subprocess, in a temporary working directory that is removed after,
    under a wall-clock limit and an address-space limit: its stdout (and stderr), cut to `max_output`
    characters with the cut said. A timeout or a crash is returned as text, never raised.

    Limits, not a sandbox: the code runs as this user, with its files and network (not this process's
    environment variables: `_tool_env`). Where the model's code is
    not trusted, run the environment's tools in a container or a VM of their own."""
    with tempfile.TemporaryDirectory(prefix="alignflow-tool-") as cwd:
        try:
            done = subprocess.run([sys.executable, "-I", "-c", _PYTHON_RUNNER, str(memory_mb << 20)], input=code,
                                  capture_output=True, text=True, timeout=timeout_s, cwd=cwd, env=_tool_env(cwd))
        except subprocess.TimeoutExpired:
            return f"error: timed out after {timeout_s:g} s"
    out = done.stdout + (done.stderr if done.returncode else "")
    if len(out) > max_output:
        out = out[:max_output] + f"\n[output cut: {len(out) - max_output} more characters]"
    return out if done.returncode == 0 else f"error (exit {done.returncode}):\n{out}"


python_tool = Tool(lambda code: python(code), {"type": "function", "function": {
    "name": "python", "description": "Run Python code; returns what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}})
