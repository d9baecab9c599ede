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
