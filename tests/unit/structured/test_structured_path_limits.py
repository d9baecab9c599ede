"""docs/limits.md's structured-output table holds on both decoding paths (issue 60 item 8): past
the skeleton's own bounds (65 properties, a 257-character pattern) a schema is served on the
whole-document path, and a schema the library stops on (500 optional properties: more items in a
parser row than llguidance keeps) is refused with that reason, not as a missing document."""

from __future__ import annotations

import pytest

from celeris.engine.structured.constraint import Structured, StructureError


def _props(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}


@pytest.mark.parametrize("schema", [
    _props(65),
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "a" * 257}}},
])
def test_past_the_skeletons_bounds_the_document_path_serves_it(compiler, schema):
    assert compiler.compile(Structured("json_schema", schema, "rf"), 300).path == "document"


def test_a_schema_the_library_stops_on_is_refused_with_that_reason(compiler):
    with pytest.raises(StructureError) as e:
        compiler.compile(Structured("json_schema", _props(500), "rf"), 64)
    assert "parser limits" in e.value.reason and "no document" not in e.value.reason, e.value.reason


def _call_grammar(llm, pattern: str):
    from celeris.engine.agents.parsers import TOOL_PARSERS
    from celeris.engine.agents.tools import ToolChoice, parse_tools

    tools = parse_tools([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": ["a"], "properties": {"a": {"type": "string", "pattern": pattern}}}}}])
    return TOOL_PARSERS["hermes"].enforced(tools, ToolChoice("required"), True, specials=llm.tokenizer.special_markers)


def test_a_call_whose_end_cannot_be_found_is_refused_at_compile_not_during_decode(llm, compiler):
    """Issue 60 item 5: a tool whose pattern is `[^\\x00-\\x7f]{1,5}` took 26-35 s of closing
    search over one call's steps; the call's shortest text is now searched for at compile (within
    COMPILE_FUEL), so it is refused there, and an ordinary pattern is served as before."""
    assert compiler.compile(_call_grammar(llm, "[a-z]{1,5}"), 96).path == "document"
    with pytest.raises(StructureError) as e:
        compiler.compile(_call_grammar(llm, "[^\\x00-\\x7f]{1,5}"), 96)
    assert e.value.path == "tools" and "found" in e.value.reason, e.value
