"""Required keys as hints for the shortest document (completion.Hints.keys, examples.required_keys,
issue 42).

llguidance keeps a schema's property order, so before an object's next required key the grammar
also allows the optional keys listed before it. The greedy byte order took the first of those in
its alphabet: documents full of optional keys (a JSON Schema Store schema's shortest document was
counted at 546 tokens, refused at max_tokens 512; with its keys it takes 15), and an optional key
that recurses (`children` before `name`) was followed forever, so its schema was refused. Schemas
written for these tests."""

from __future__ import annotations

from typing import Optional

import llguidance
import numpy as np
import pytest

from celeris.engine.structured.completion import Hints, OutOfFuel, Scan, segment, shortest
from celeris.engine.structured.constraint import Compiler, Structured
from celeris.engine.structured.examples import hints, required_keys
from tests.unit.structured.decoding import decode_beside_free, valid

# Eight optional keys listed before the one required key.
LATE = {"type": "object", "required": ["zz"], "additionalProperties": False, "properties": {
    **{f"{c}{c}": {"type": "string"} for c in "abcdefgh"}, "zz": {"type": "integer"}}}
# An optional recursive key before the required one: the greedy order never left it.
TREE = {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
    "children": {"type": "array", "minItems": 1, "items": {"$ref": "#"}}, "name": {"type": "string"}}}
# `id` (required in `a`) is a prefix of `identifier` (required in `b`, after an optional `a0`).
PREFIX = {"type": "object", "required": ["a", "b"], "additionalProperties": False, "properties": {
    "a": {"type": "object", "required": ["id"], "additionalProperties": False,
          "properties": {"id": {"type": "integer"}}},
    "b": {"type": "object", "required": ["identifier"], "additionalProperties": False,
          "properties": {"a0": {"type": "integer"}, "identifier": {"type": "integer"}}}}}


def _shortest(compiler: Compiler, schema: dict, keyed: bool = True) -> Optional[str]:
    """The shortest document found (with or without the schema's keys), None if none is found
    within 4,096 tokens and the search's budget."""
    m = llguidance.LLMatcher(compiler.ll, compiler.compile(Structured("json_schema", schema, "s"), 512).slots[0].grammar)
    h = hints(schema)
    try:
        path = shortest(compiler.tokens, m, Scan(), 4096, np.zeros((compiler.vocab_size + 31) // 32, np.uint32),
                        hints=h if keyed else Hints(h.strings))
    except OutOfFuel:
        return None
    return None if path is None else compiler.tok.decode(path)


def test_required_keys_are_ranked_and_in_bytes_order():
    schema = {"properties": {"zz": {}, "id": {}, "q\"x": {}, "opt": {}}, "required": ["zz", "id", "q\"x", 3],
              "$defs": {"o": {"properties": {"zz": {}, "identifier": {}}, "required": ["identifier"]}}}
    assert required_keys(schema) == ((b"id", (False, 2)), (b"identifier", (False, 10)), (b'q\\"x', (False, 3)),
                                     (b"zz", (True, 2)))
    assert hints({"type": "string"}) == Hints()


def test_optional_keys_before_the_required_one_are_left_out(compiler):
    assert _shortest(compiler, LATE) == '{"zz":0}'
    greedy = _shortest(compiler, LATE, keyed=False)
    assert greedy.startswith('{"aa":""') and greedy.endswith('"zz":0}')  # what the byte order alone writes
    layout = compiler.compile(Structured("json_schema", LATE, "s"), 512)
    assert layout.needed == len(segment(compiler.tokens, None, b'{"zz":0}')) + 1  # its fewest tokens, the stop


def test_a_recursive_optional_key_no_longer_hides_the_document(compiler):
    assert _shortest(compiler, TREE) == '{"name":""}'
    assert _shortest(compiler, TREE, keyed=False) is None  # before: children, [, {, children, ...


def test_a_refused_name_rules_out_only_names_that_share_its_refused_byte(compiler):
    """At `b`'s first key, `id` is refused at its closing quote: `identifier` (after it in bytes
    order) is still tried and taken, not the optional `a0` the byte order prefers."""
    assert _shortest(compiler, PREFIX) == '{"a":{"id":0},"b":{"identifier":0}}'


@pytest.mark.parametrize("schema", [LATE, TREE, PREFIX], ids=["late", "tree", "prefix"])
def test_documents_decode_in_the_fewest_tokens_beside_a_free_request(llm, compiler, schema):
    """At max_tokens = the shortest document and its stop token (a canvas the greedy count
    refused or never reached), and with room to spare, beside a free request and another schema:
    every output validates and the free request reads as it does alone."""
    least = compiler.compile(Structured("json_schema", schema, "s"), 512).needed
    other = {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}
    decode_beside_free(llm, [(schema, least), (schema, 64), (other, 32)])
    valid(schema, _shortest(compiler, schema))
