"""Clean arguments by default: an enforced call reads an object schema as OpenAI's strict mode does
(no keys beyond `properties` unless the schema says so), so the docs' own example tool, whose
schema does not say `additionalProperties: false`, gets calls with its one key on the embedded model."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

from celeris.engine.agents.parsers import TOOL_PARSERS
from celeris.engine.agents.tools import ToolChoice, args_schema, parse_tools, strict_objects
from celeris.engine.llm import LLM
from celeris.engine.events import FinishReason
from celeris.engine.requests import Request

# docs/tools.md's example tool, as written there
DOCS_TOOL = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "maxLength": 32}}}}}]


def test_objects_without_a_word_on_other_keys_take_none():
    schema = {"type": "object", "properties": {
        "where": {"type": "object", "properties": {"city": {"type": "string"}}},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
        "open": {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
        "typed": {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "number"}},
        "pattern": {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}},
        "either": {"anyOf": [{"type": "object", "properties": {"b": {}}}, {"type": "null"}]},
        "parts": {"allOf": [{"properties": {"c": {}}}, {"properties": {"d": {}}}]},
        "properties": {"type": "object", "properties": {"e": {}}},  # a key named like the keyword
        "ref": {"$ref": "#/$defs/node"}},
        "$defs": {"node": {"type": "object", "properties": {"n": {}}}}}
    before = copy.deepcopy(schema)
    out = strict_objects(schema)
    assert schema == before  # a copy: the client's tool (rendered into the prompt) is untouched
    props = out["properties"]
    assert out["additionalProperties"] is False and props["where"]["additionalProperties"] is False
    assert props["tags"]["items"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True and props["typed"]["additionalProperties"] == {"type": "number"}
    assert "additionalProperties" not in props["pattern"]
    assert props["either"]["anyOf"][0]["additionalProperties"] is False and props["either"]["anyOf"][1] == {"type": "null"}
    assert all("additionalProperties" not in part for part in props["parts"]["allOf"])  # each names part of the keys
    assert props["properties"]["additionalProperties"] is False and set(props) == set(before["properties"])
    assert out["$defs"]["node"]["additionalProperties"] is False
    assert args_schema(before)["additionalProperties"] is False  # what enforcement compiles


def test_an_all_of_members_alternatives_stay_open_and_their_properties_strict():
    """allOf of anyOf objects (the round-five flood's shape): closing each alternative would make
    the intersection unsatisfiable; their properties' own objects are still read strictly."""
    inner = {"type": "object", "properties": {"x": {}}}
    schema = {"allOf": [{"anyOf": [{"type": "object", "properties": {"a": {}, "deep": inner}}, {"type": "null"}]},
                        {"oneOf": [{"properties": {"b": {}}}]},
                        {"if": {"properties": {"c": {}}}, "then": {"properties": {"d": {}}}}]}
    out = strict_objects(schema)
    first, second, third = out["allOf"]
    assert "additionalProperties" not in first["anyOf"][0] and "additionalProperties" not in second["oneOf"][0]
    assert "additionalProperties" not in third["if"] and "additionalProperties" not in third["then"]
    assert first["anyOf"][0]["properties"]["deep"]["additionalProperties"] is False


def test_the_docs_example_tool_gets_only_its_own_keys_on_the_embedded_model():
    llm = LLM.load(None)
    tools = parse_tools(DOCS_TOOL)
    hermes = TOOL_PARSERS["hermes"]
    seqs = [llm.build(Request(messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                              tools=DOCS_TOOL, params=replace(llm.defaults, gen_length=64, seed=seed),
                              structured=hermes.enforced(tools, ToolChoice("function", "get_weather"), False)))
            for seed in range(8)]
    for out in llm.run(seqs):
        assert out.finish_reason == FinishReason.STOP, out.text
        _, calls = hermes.extract(out.text, names={"get_weather"})
        assert len(calls) == 1 and set(json.loads(calls[0].arguments)) == {"city"}, out.text
