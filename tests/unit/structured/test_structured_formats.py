"""Formats and closing on the whole-document path (issue 42), with schemas written for these tests.

Formats: every value llguidance's date-time, date and time grammars admitted that jsonschema's
format checker rejects (year 0000, February 29 of a common year, second 60) is now outside the
grammar (engine/structured/formats.py), and the other formats Celeris accepts hold against the
checker on tricky values. Closing: a document ends whole inside the canvas, and a schema whose
shortest document does not fit max_tokens is refused up front, by name."""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import llguidance
import pytest

from celeris.engine.errors import InvalidRequest
from celeris.engine.events import FinishReason
from celeris.engine.requests import Request
from celeris.engine.structured.constraint import Compiler, Structured, StructureError
from celeris.engine.structured.formats import exact_formats


def _accepts(compiler: Compiler, schema: dict, value: object) -> bool:
    grammar = compiler.compile(Structured("json_schema", schema, "s"), 512).slots[0].grammar
    m = llguidance.LLMatcher(compiler.ll, grammar, log_level=0)
    for b in json.dumps(value).encode():
        if not m.consume_token(compiler.ll.tokenize_bytes(bytes([b]))[0]):
            return False
    return m.is_accepting()


TRICKY = {
    "date-time": ["0000-01-01T00:00:00Z", "0000-01-01t00:00:00-00:00", "2021-02-29T00:00:00Z", "1900-02-29T10:00:00Z",
                  "2020-02-29T00:00:00Z", "2000-02-29T23:59:59.5+05:30", "2021-01-01T23:59:60Z", "2021-04-31T00:00:00Z",
                  "9999-12-31T23:59:59.123456789-23:59"],
    "date": ["0000-01-01", "0001-01-01", "2021-02-29", "2020-02-29", "1900-02-29", "2000-02-29", "2021-06-31"],
    "time": ["23:59:60Z", "23:59:59Z", "00:00:00-00:00", "24:00:00Z", "12:00:00.5+01:00"],
    "ipv4": ["01.2.3.4", "0.0.0.0", "255.255.255.255", "256.1.1.1"],
    "ipv6": ["::", "1::", "1:2:3:4:5:6:7:8", "fe80::1%eth0", "1::2::3"],
    "uuid": ["00000000-0000-0000-0000-000000000000", "ABCDEF00-0000-0000-0000-000000000000"],
    "email": ["a@b", "a@b.cd"],
}


@pytest.mark.parametrize("fmt", sorted(TRICKY))
def test_every_value_a_format_admits_passes_the_checker(compiler, fmt):
    schema = {"type": "string", "format": fmt}
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    admitted = [v for v in TRICKY[fmt] if _accepts(compiler, schema, v)]
    assert admitted, fmt  # the format is served, not refused
    assert [v for v in admitted if not checker.conforms(v, fmt)] == []


def test_leap_years_are_exact(compiler):
    schema = {"type": "string", "format": "date"}
    for year in (4, 96, 400, 1600, 2000, 2024, 1, 100, 1900, 2100, 2023):
        leap = year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
        assert _accepts(compiler, schema, f"{year:04d}-02-29") == leap, year


def test_draft3_time_is_hh_mm_ss(compiler):
    schema = {"$schema": "http://json-schema.org/draft-03/schema#", "type": "string", "format": "time"}
    assert _accepts(compiler, schema, "12:30:59")
    assert not _accepts(compiler, schema, "12:30:59Z")
    assert jsonschema.Draft3Validator.FORMAT_CHECKER.conforms("12:30:59", "time")


def test_rewriting_keeps_data_and_names_and_intersects_patterns():
    schema = {"properties": {"format": {"type": "string", "format": "date"},
                             "default": {"type": "string", "format": "time", "pattern": "^1"}},
              "default": {"format": "date"}, "enum": [{"format": "date"}]}
    out = exact_formats(schema)
    assert schema["properties"]["format"]["format"] == "date"  # the caller's schema is left as it is
    assert out["default"] == {"format": "date"} and out["enum"] == [{"format": "date"}]
    assert "format" not in out["properties"]["format"] and out["properties"]["format"]["pattern"].startswith("^(")
    assert out["properties"]["default"]["pattern"] == "^1" and len(out["properties"]["default"]["allOf"]) == 1
    assert exact_formats({"type": "string"}) == {"type": "string"}


def test_a_format_with_a_pattern_keeps_both(compiler):
    schema = {"type": "string", "format": "date", "pattern": "^2"}
    assert _accepts(compiler, schema, "2021-01-01") and not _accepts(compiler, schema, "1999-01-01")
    assert not _accepts(compiler, schema, "2021-02-29")


WIDE = {"type": "object", "required": ["a", "b", "c"], "additionalProperties": False, "properties": {
    "a": {"type": "string"}, "b": {"type": "integer"},
    "c": {"type": "object", "required": ["d", "e"], "properties": {
        "d": {"type": "string", "format": "date-time"}, "e": {"type": "array", "items": {"type": "string"}}}},
    "opt": {"type": "object", "required": ["x", "y", "z"], "properties": {
        "x": {"type": "string", "format": "email"}, "y": {"type": "string", "format": "date"},
        "z": {"type": "array", "minItems": 3, "items": {"type": "string", "format": "uuid"}}}}}}


def test_a_schema_whose_shortest_document_does_not_fit_is_refused_up_front(llm, compiler):
    least = compiler.compile(Structured("json_schema", WIDE, "s"), 512).needed
    assert 40 < least < 80
    with pytest.raises(StructureError, match=r"shortest document takes \d+ tokens and its stop token one more; the canvas \(max_tokens\) has"):
        compiler.compile(Structured("json_schema", WIDE, "s"), least - 1)
    params = replace(llm.defaults, gen_length=least - 1, steps=least - 1, block_length=least - 1)
    with pytest.raises(InvalidRequest):
        llm.build(Request(prompt="JSON:", params=params, structured=Structured("json_schema", WIDE, "s")))


@pytest.mark.parametrize("n", [72, 96])
def test_documents_close_whole_inside_a_tight_canvas(llm, n):
    """Free text would run on (unbounded strings, an optional object with a large required
    remainder): the closing must start early enough, and every output validates."""
    params = replace(llm.defaults, gen_length=n, steps=n, block_length=n, temperature=1.0)
    seqs = [llm.build(Request(prompt="JSON:", params=replace(params, seed=s), structured=Structured(
        "json_schema", WIDE, "s"))) for s in range(4)]
    for out in llm.run(seqs):
        assert out.finish_reason == FinishReason.STOP, out.text
        jsonschema.Draft202012Validator(WIDE, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER).validate(
            json.loads(out.text))
