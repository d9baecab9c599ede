"""Tools and tool choice (engine/agents/tools.py, issue 43): OpenAI's shapes parsed, every bad
field refused by its exact path, limits checked before any schema compiles."""

from __future__ import annotations

import re
import time

import pytest

from celeris.engine.agents import tools as agent_tools
from celeris.engine.agents.tools import MAX_TOOLS, Tool, ToolChoice, new_call_id, parse_tool_choice, parse_tools
from celeris.engine.errors import InvalidRequest
from tests.unit.agent_schemas import FUNCTIONS, TOOLS


def _fn(name="f", **kw) -> dict:
    return {"type": "function", "function": {"name": name, **kw}}


def _field(value, **kw) -> str:
    with pytest.raises(InvalidRequest) as e:
        parse_tools(value, **kw)
    return e.value.violations[0].field


def test_the_twenty_test_schemas_parse():
    tools = parse_tools(TOOLS)
    assert [t.name for t in tools] == list(FUNCTIONS)
    assert tools[0].parameters == FUNCTIONS["get_weather"] and tools[0].description == "the get_weather tool"
    assert parse_tools(None) == () and parse_tools([]) == ()
    assert parse_tools([_fn("x")])[0] == Tool("x", "", {"type": "object"}, False)  # parameters missing
    assert tools[0].openai()["function"]["name"] == "get_weather"


@pytest.mark.parametrize("value,field", [
    ("nope", "tools"),
    ([{"type": "retrieval"}], "tools[0].type"),
    ([_fn("ok"), {"type": "function"}], "tools[1].function"),
    ([_fn("has space")], "tools[0].function.name"),
    ([_fn("x" * 65)], "tools[0].function.name"),
    ([_fn("a"), _fn("b"), _fn("a")], "tools[2].function.name"),
    ([_fn("a", parameters=[1])], "tools[0].function.parameters"),
    ([_fn("a", parameters={"type": "string"})], "tools[0].function.parameters.type"),
    ([_fn("a", description=3)], "tools[0].function.description"),
    ([_fn("a", strict="yes")], "tools[0].function.strict"),
])
def test_bad_tools_are_refused_by_field(value, field):
    assert _field(value) == field


COMPILE_REFUSED = [
    ([_fn("a"), _fn("b"), _fn("c", parameters={"type": "object", "properties": {
        "x": {"type": "array", "uniqueItems": True}}})], "tools[2].function.parameters.properties.x.uniqueItems"),
    ([_fn("a", parameters={"type": "object", "properties": {"d": {"type": "string", "format": "nope"}}})],
     "tools[0].function.parameters.properties.d.format"),
    ([_fn("a", parameters={"type": "object", "properties": {"r": {"$ref": "#/$defs/missing"}}})],
     "tools[0].function.parameters"),
]


def test_schemas_the_library_refuses_are_named_by_path_when_the_engine_compiles_them(verdicts):
    """The door checks shapes only; the engine compiles each schema (in the verdicts' child
    process, on the compile lanes) and names the path llguidance's error points at."""
    for value, field in COMPILE_REFUSED:
        tools = [t.openai() for t in parse_tools(value)]  # the shapes pass the door
        v = agent_tools.compile_problems(tools, verdicts)
        assert [x.field for x in v] == [field], v
    assert agent_tools.compile_problems([t.openai() for t in parse_tools(TOOLS)], verdicts) == []


def test_a_tool_list_past_its_compile_budget_is_refused_by_name(verdicts):
    slow = [t.openai() for t in parse_tools([_fn(f"t{i}", parameters={"type": "object", "properties": {
        f"p{i}": {"type": "string"}}}) for i in range(3)])]
    v = agent_tools.compile_problems(slow, verdicts, budget_s=0.0)
    assert len(v) == 1 and v[0].field == "tools[0].function.parameters" and "did not compile within" in v[0].description
    assert agent_tools.compile_problems(slow, verdicts) == []  # a fresh child answers the next request


@pytest.fixture(scope="module")
def verdicts():
    from celeris.engine.structured.verdicts import Verdicts

    v = Verdicts()
    yield v
    v.close()


def test_the_door_names_its_own_root():
    assert _field([_fn("a b")], field="body.tools") == "body.tools[0].function.name"


def test_limits_come_before_any_compile(monkeypatch):
    calls = []
    monkeypatch.setattr(agent_tools, "schema_problem", lambda text: calls.append(text) or "")
    assert _field([_fn(f"t{i}") for i in range(MAX_TOOLS + 1)]) == "tools"
    deep = {"type": "object", "properties": {"a": {}}}
    node = deep["properties"]["a"]
    for _ in range(40):
        node["items"] = {"type": "array"}
        node = node["items"]
    assert _field([_fn("d", parameters=deep)]) == "tools[0].function.parameters"
    big = {"type": "object", "description": "x" * 300_000}
    assert _field([_fn("b", parameters=big)]) == "tools"
    assert calls == []  # none of them reached the compiler
    t0 = time.perf_counter()
    with pytest.raises(InvalidRequest):
        parse_tools([_fn("a")] * 10_000)
    assert time.perf_counter() - t0 < 0.1


def test_tool_choice():
    tools = parse_tools([_fn("a"), _fn("b")])
    assert parse_tool_choice(None, tools) == ToolChoice("auto")
    assert parse_tool_choice(None, ()) == ToolChoice("none")
    assert parse_tool_choice("none", ()) == ToolChoice("none")
    assert parse_tool_choice("required", tools) == ToolChoice("required")
    assert parse_tool_choice({"type": "function", "function": {"name": "b"}}, tools) == ToolChoice("function", "b")
    for value, tools_given, field in [
        ("always", tools, "tool_choice"), ("required", (), "tool_choice"),
        ({"type": "function", "function": {"name": "zz"}}, tools, "tool_choice.function.name"),
        ({"type": "function", "function": {}}, tools, "tool_choice.function.name"),
        ({"type": "function", "function": {"name": "a"}}, (), "tool_choice"), (3, tools, "tool_choice"),
    ]:
        with pytest.raises(InvalidRequest) as e:
            parse_tool_choice(value, tools_given)
        assert e.value.violations[0].field == field, value


def test_call_ids_look_like_openai_ones():
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)
