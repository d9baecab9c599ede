"""Enforced tool calls on celeris-tiny (issue 43): under tool_choice "required" or a named function
the generation is exactly the family's call syntax around arguments that parse and validate
against the function's schema (jsonschema), over 20 schemas (MCP-style `$ref`/`$defs`, optional
arguments, enums, nested objects, arrays, bounded numbers), alone and batched beside free rows; a
request whose tools cannot be served fails alone, by its own field."""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import pytest

from celeris.engine.agents.parsers import TOOL_PARSERS
from celeris.engine.agents.reasoning import REASONING_PARSERS
from celeris.engine.agents.tools import ToolChoice, parse_tools
from celeris.engine.errors import InvalidRequest
from celeris.engine.llm import LLM
from celeris.engine.events import FinishReason
from celeris.engine.requests import Request
from celeris.engine.structured.constraint import GRAMMAR, Structured
from tests.unit.agent_schemas import FUNCTIONS, TOOLS

HERMES = TOOL_PARSERS["hermes"]
NAMES = set(FUNCTIONS)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM.load(None)


@pytest.fixture(scope="module")
def tools():
    return parse_tools(TOOLS)


def _params(llm: LLM, seed: int, n: int = 96):
    return replace(llm.defaults, gen_length=n, steps=n, block_length=32, temperature=1.0, seed=seed)


def _build(llm, tools, choice: ToolChoice, seed: int, parallel: bool = False, parser=HERMES):
    return llm.build(Request(prompt="Call a tool:", params=_params(llm, seed),
                             structured=parser.enforced(tools, choice, parallel)))


def _check(out, expect=None, parser=HERMES) -> list:
    """The calls of a finished enforced generation; asserts they are exactly calls, valid."""
    assert out.finish_reason == FinishReason.STOP, out.text
    content, calls = parser.extract(out.text, names=NAMES)
    assert content == "" and calls, out.text
    for c in calls:
        assert expect is None or c.name == expect
        jsonschema.validate(json.loads(c.arguments), FUNCTIONS[c.name])
    return calls


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_named_calls_validate_for_every_schema(llm, tools):
    outs = llm.run([_build(llm, tools, ToolChoice("function", t.name), seed=1) for t in tools])
    for t, out in zip(tools, outs):
        assert len(_check(out, t.name)) == 1


def test_required_picks_a_tool_among_all_twenty(llm, tools):
    outs = llm.run([_build(llm, tools, ToolChoice("required"), seed=s, parallel=s % 2 == 0) for s in range(6)])
    for s, out in enumerate(outs):
        calls = _check(out)
        assert s % 2 == 0 or len(calls) == 1


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_alone_equals_batched_and_a_bad_tool_fails_alone(llm, tools):
    named = ToolChoice("function", "mcp_query_db")
    alone = llm.run([_build(llm, tools, named, seed=3)])[0]
    bad = Structured(GRAMMAR, 'start: %json {"type": "object", "properties": {"a": {"uniqueItems": true}}}',
                     "tools[0].function.parameters")
    with pytest.raises(InvalidRequest) as e:
        llm.build(Request(prompt="x", params=_params(llm, 4), structured=bad))
    assert e.value.violations[0].field == "tools[0].function.parameters"
    free = llm.build(Request(prompt="It was", params=_params(llm, 5)))
    mixed = llm.run([free, _build(llm, tools, named, seed=3), _build(llm, tools, ToolChoice("required"), 6)])
    assert mixed[1].token_ids == alone.token_ids
    _check(alone, "mcp_query_db")
    _check(mixed[2])


@pytest.mark.parametrize("name", ["llada2"])
def test_other_json_formats_enforce_the_same_way(llm, tools, name):
    parser = TOOL_PARSERS[name]
    outs = llm.run([_build(llm, tools, ToolChoice("function", n), 7, parser=parser)
                    for n in ("mcp_tree", "create_event", "convert")])
    for n, out in zip(("mcp_tree", "create_event", "convert"), outs):
        _check(out, n, parser)


@pytest.mark.slow  # 2 min on two idle cores (10 when loaded): the 200 calls, 20 schemas x 5 seeds x 2 choices
def test_two_hundred_calls_all_validate(llm, tools):
    jobs = [(t.name, seed, mode) for t in tools for seed in range(5) for mode in ("function", "required")]
    seqs = [_build(llm, tools if mode == "function" else [t], ToolChoice(mode, name if mode == "function" else None),
                   seed + 10, parallel=mode == "required") for name, seed, mode in jobs
            for t in [next(x for x in tools if x.name == name)]]
    outs = llm.run(seqs)
    valid = 0
    for (name, _, _), out in zip(jobs, outs):
        _check(out, name)
        valid += 1
    assert valid == 200


def test_gemma_calls_keep_their_enforced_shape(llm):
    """Gemma's format is not JSON: its grammar (gemma_format.Rules) enforces keys, requiredness,
    types, enums, anyOf and $ref, not bounds or lengths; these schemas have none, so they validate."""
    schemas = {"add": FUNCTIONS["add"], "move": FUNCTIONS["move"], "ping": FUNCTIONS["ping"],
               "tree": {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "required": ["v"], "properties": {
                   "v": {"type": "boolean"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}}},
               "pick": {"type": "object", "required": ["c"], "properties": {"c": {"enum": ["red", "blue"]},
                                                                           "n": {"type": ["integer", "null"]}}}}
    tools = parse_tools([{"type": "function", "function": {"name": n, "parameters": p}} for n, p in schemas.items()])
    gemma = TOOL_PARSERS["gemma"]
    outs = llm.run([_build(llm, tools, ToolChoice("function", n), 8, parser=gemma) for n in schemas])
    for n, out in zip(schemas, outs):
        assert out.finish_reason == FinishReason.STOP, out.text
        reasoning, text = REASONING_PARSERS["gemma"].split(out.text)  # an empty channel may come first
        content, calls = gemma.extract(text)
        assert reasoning is None
        assert content == "" and [c.name for c in calls] == [n], out.text
        jsonschema.validate(json.loads(calls[0].arguments), schemas[n])
