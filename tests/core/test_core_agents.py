"""Tools and environments (alignflow/agents/): schemas, calls parsed from text, failures as observations,
the code tool's limits, and how a round finds an environment by name."""

from __future__ import annotations

import json
import os

import pytest

from alignflow.agents import Tool, ToolEnvironment, load_environment, make_environment, python, run_calls, tool
from alignflow.agents.tools import ToolSchemaError


def add(a: int, b: int = 0) -> int:
    """Add two integers."""
    return a + b


def explode(x: str) -> str:
    raise RuntimeError(f"boom on {x}")


TOOLS = {"add": tool(add), "explode": tool(explode)}


def test_a_schema_comes_from_the_signature_and_a_parameter_without_a_type_is_named():
    schema = tool(add).schema["function"]
    assert schema["name"] == "add" and schema["description"] == "Add two integers."
    assert schema["parameters"] == {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                    "required": ["a"]}

    def untyped(x):
        return x

    with pytest.raises(ToolSchemaError, match="parameter 'x' has no JSON type"):
        tool(untyped)
    with pytest.raises(ToolSchemaError, match="its schema needs"):
        Tool(add, {"name": "add"})


def call(name, **args) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


def test_calls_run_in_order_and_every_failure_is_an_observation_counted_by_kind():
    text = (call("add", a=2, b=3) + "then" + "<tool_call>{not json</tool_call>" + call("nope", a=1)
            + call("add", c=1) + call("explode", x="it") + "<tool_call>{\"name\": \"add\"")
    out = run_calls(text, TOOLS)
    contents = [m["content"] for m in out.messages]
    assert [m["role"] for m in out.messages] == ["tool"] * 6
    assert contents[0] == "5"
    assert "not JSON" in contents[1]
    assert "no tool 'nope'" in contents[2] and "add, explode" in contents[2]
    assert "missing ['a'], unknown ['c']" in contents[3]
    assert contents[4] == "error: explode raised RuntimeError: boom on it"
    assert "never closed" in contents[5]
    assert (out.calls, out.invalid, out.errors) == (6, 4, 1)
    # Nested past the JSON parser's depth (a collapsed policy's [[[[...): an invalid call, not a crash.
    deep = run_calls("<tool_call>" + "[" * 5000 + "</tool_call>", TOOLS)
    assert (deep.calls, deep.invalid) == (1, 1) and "nested too deeply" in deep.messages[0]["content"]


def test_a_completions_calls_in_openais_form_keep_their_arguments_as_one_json_string():
    from alignflow.agents.tools import openai_tool_calls

    text = call("add", a=2) + '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3}"}</tool_call>' + \
        "<tool_call>" + "[" * 5000 + "</tool_call>" + "<tool_call>[1]</tool_call>"
    calls = openai_tool_calls(text)
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 2}, {"a": 3}]  # a string: as given
    assert [c["id"] for c in calls] == ["call_0", "call_1"]


def test_the_endpoint_and_an_environment_accept_the_same_calls():
    """One parser: a call the endpoint hands an agent is one an environment runs, and one it leaves in the
    text is one an environment counts as invalid."""
    from alignflow.agents.tools import openai_tool_calls

    bodies = {'{"name": "add", "arguments": {"a": 1}}': 1, '{"name": "add", "arguments": "{\\"a\\": 1}"}': 1,
              '{"name": "add"}': 0, '{"name": 7, "arguments": {"a": 1}}': None, '{"name": "add", "arguments": "a=1"}':
              None, '{"name": "add", "arguments": "[1]"}': None, '{"name": "add", "arguments": [1]}': None}
    digits = "1" * 5000  # past Python's 4300-digit limit on int(): a ValueError, not a JSONDecodeError
    bodies |= {f'{{"name": "add", "arguments": {{"a": {digits}}}}}': None,
               f'{{"name": "add", "arguments": "{{\\"a\\": {digits}}}"}}': None}
    for body, result in bodies.items():
        text = f"<tool_call>{body}</tool_call>"
        out, offered = run_calls(text, TOOLS), openai_tool_calls(text)
        if result is None:
            assert (out.invalid, offered) == (1, []), body
            assert any(why in out.messages[0]["content"] for why in ("arguments must be an object", "is {", "not JSON"))
        elif result == 0:  # parses; the tool itself refuses it: missing a
            assert out.invalid == 1 and "missing ['a']" in out.messages[0]["content"] and len(offered) == 1, body
        else:
            assert (out.invalid, out.messages[0]["content"]) == (0, "1"), body
            assert json.loads(offered[0]["function"]["arguments"]) == {"a": 1}, body


def test_python_runs_in_a_fresh_temporary_directory_under_time_and_memory_limits(tmp_path):
    assert python("print(6 * 7)") == "42\n"
    where = python("import os; print(os.getcwd())").strip()
    assert where != os.getcwd() and "alignflow-tool-" in where and not os.path.exists(where)  # removed after
    assert python("while True: pass", timeout_s=0.5) == "error: timed out after 0.5 s"
    hog = python("x = bytearray(400 * 1024 * 1024); print('held')", memory_mb=128)
    assert hog.startswith("error (exit 1)") and "MemoryError" in hog
    assert python("raise SystemExit(3)").startswith("error (exit 3)")
    long = python("print('a' * 5000)", max_output=100)
    assert long.startswith("a" * 100) and "[output cut: 4901 more characters]" in long
    # The model's code does not see this process's credentials (its output becomes observations, transcripts).
    os.environ["ALIGNFLOW_TEST_SECRET"] = "s3cr3t"
    try:
        seen = python("import os; print(sorted(os.environ)); print(os.environ.get('ALIGNFLOW_TEST_SECRET'))")
    finally:
        del os.environ["ALIGNFLOW_TEST_SECRET"]
    assert "s3cr3t" not in seen and "ALIGNFLOW_TEST_SECRET" not in seen and "PATH" in seen
    # One thread per math library: one per core, as numpy loads, passes the address-space limit on a big node.
    assert python("import os; print(*(os.environ[k] for k in ('OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS')))") == "1 1\n"


class Lookup(ToolEnvironment):
    def __init__(self, table: dict):
        self.tools = [tool(self.get)]
        self.table = table

    def get(self, key: str) -> str:
        return self.table[key]


def test_a_tool_environment_observes_calls_and_scores_the_first_answer_without_one():
    env = Lookup({"k": "v"})
    assert env.reset({"prompt": "what is k?", "answer": "v"}) == [{"role": "user", "content": "what is k?"}]
    obs, reward, done, info = env.step({"role": "assistant", "content": call("get", key="k")})
    assert (obs, reward, done) == ([{"role": "tool", "content": "v"}], 0.0, False)
    assert info == {"tool_calls": 1, "invalid_calls": 0, "tool_errors": 0}
    assert env.step({"role": "assistant", "content": " v "}) == ([], 1.0, True, {"success": True})
    env.reset({"prompt": "what is k?", "answer": "v"})
    assert env.step({"role": "assistant", "content": "w"})[1:3] == (0.0, True)


def test_environments_load_by_bundled_name_or_module_path_and_errors_name_the_field():
    assert load_environment("boxes").__name__ == "BoxesEnvironment"
    assert load_environment("test_core_agents:Lookup") is Lookup
    with pytest.raises(ValueError, match=r"^rounds.0.environment.name: 'nowhere' is neither a bundled"):
        load_environment("nowhere", "rounds.0.environment.name")
    with pytest.raises(ValueError, match="cannot import 'no_such_module:Env'"):
        load_environment("no_such_module:Env")
    with pytest.raises(ValueError, match="has no reset"):
        load_environment("json:dumps")
    with pytest.raises(ValueError, match=r"^env.kwargs: .*TypeError"):
        make_environment("test_core_agents:Lookup", {"wrong": 1}, "env")
    assert make_environment("test_core_agents:Lookup", {"table": {}}).tools[0].name == "get"


class Untooled(ToolEnvironment):
    tools = [add]  # a bare function: no schema


def test_an_environment_whose_tool_has_no_schema_is_named():
    with pytest.raises(ValueError, match=r"^evaluation.environment.name: .*not a Tool with a schema"):
        make_environment("test_core_agents:Untooled", {}, "evaluation.environment")
