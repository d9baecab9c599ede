"""The whole-document path (engine/structured/document.py, issue 42): schemas the skeleton cannot
express ($ref incl. recursive, optional keys, unbounded arrays of objects, anyOf, type lists,
annotation keywords) decode on celeris-tiny as one llguidance grammar and validate; the path is
chosen per schema and reported; a constrained row decodes the same alone as beside free rows;
what llguidance cannot honour is refused by its schema path, never relaxed. Schemas are written
for these tests."""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import pytest

from celeris.engine.errors import InvalidRequest
from celeris.engine.llm import LLM
from celeris.engine.requests import Request
from celeris.engine.events import FinishReason
from celeris.engine.structured.constraint import Structured

NODE = {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "required": ["v"], "properties": {
    "v": {"type": "integer", "minimum": 0, "maximum": 99},
    "kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/node"}}}}}}
OPTIONAL = {"type": "object", "required": ["id"], "additionalProperties": False, "properties": {
    "id": {"type": "integer"}, "note": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}}}
ROWS = {"type": "array", "items": {"type": "object", "required": ["k", "on"], "additionalProperties": False,
                                   "properties": {"k": {"type": "string"}, "on": {"type": "boolean"}}}}
ANY_OF = {"type": "object", "required": ["x"], "properties": {"x": {"anyOf": [
    {"type": "integer", "minimum": 10}, {"type": "string", "enum": ["none", "some"]}]}}}
TYPE_LIST = {"type": "object", "required": ["a", "b"], "additionalProperties": False, "properties": {
    "a": {"type": ["integer", "null"]}, "b": {"type": ["boolean", "string"], "maxLength": 4}}}
ANNOTATED = {"$id": "https://example.com/t.json", "title": "T", "description": "d", "$comment": "c",
             "examples": [{"n": 1}], "type": "object", "required": ["n"], "additionalProperties": False,
             "javaType": "com.example.T", "properties": {"n": {"type": "integer", "default": 3, "readOnly": True,
                                                                "id": "n", "minimum": 0, "maximum": 9}}}
DOCUMENTS = {"ref": NODE, "optional": OPTIONAL, "rows": ROWS, "anyOf": ANY_OF, "types": TYPE_LIST,
             "annotated": ANNOTATED}
SKELETON = {"type": "object", "properties": {"a": {"type": "boolean"}, "s": {"type": "string", "maxLength": 4}}}


def _params(llm: LLM, seed: int, n: int = 64):
    return replace(llm.defaults, gen_length=n, steps=n, block_length=32, temperature=1.0, seed=seed)


def _build(llm: LLM, schema: object, seed: int, prompt: str = "JSON:", field: str = "s"):
    return llm.build(Request(prompt=prompt, params=_params(llm, seed), structured=Structured("json_schema", schema,
                                                                                           field)))


def test_the_path_is_chosen_per_schema(llm):
    assert _build(llm, SKELETON, 0).constraint.layout.path == "skeleton"
    for name, schema in DOCUMENTS.items():
        layout = _build(llm, schema, 0).constraint.layout
        assert layout.path == "document", name
        assert len(layout.slots) == 1 and layout.slots[0].capacity == 64  # bounded by max_tokens only
    unbounded = {"type": "object", "properties": {"s": {"type": "string"}}}  # no silent 32-character cap
    assert _build(llm, unbounded, 0).constraint.layout.path == "document"


@pytest.mark.parametrize("schema,path", [
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}},
     "f.properties.a.uniqueItems"),
    ({"type": "object", "properties": {"d": {"type": "string", "format": "not-a-format"}}}, "f.properties.d.format"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "f.properties.a.not"),
    ({"type": "object", "properties": {"a": {"$ref": "https://example.com/elsewhere.json"}}}, "f.properties.a.$ref"),
    ({"anyOf": [{"type": "string"}, {"type": "object", "if": {"required": ["a"]}, "then": {}}]}, "f.anyOf[1].if"),
])
def test_what_llguidance_cannot_honour_is_refused_by_path(llm, schema, path):
    with pytest.raises(InvalidRequest) as e:
        _build(llm, schema, 0, field="f")
    assert e.value.violations[0].field == path, e.value.violations[0]


def test_forced_tokens_commit_several_positions_a_step(llm):
    key = "a_rather_long_key_that_the_grammar_forces"
    schema = {"type": "object", "required": [key], "additionalProperties": False,
              "properties": {key: {"type": "boolean"}}}
    seq = _build(llm, schema, 1)
    out = llm.run([seq])[0]
    assert json.loads(out.text).keys() == {key}
    assert seq.nfe < len(out.token_ids) // 2  # the key, its quotes and colon came in one step


@pytest.mark.slow  # a minute on a loaded machine
def test_every_document_schema_decodes_valid(llm):
    jobs = [(name, seed) for name in DOCUMENTS for seed in (0, 1)]
    outs = llm.run([_build(llm, DOCUMENTS[name], seed) for name, seed in jobs])
    for (name, seed), out in zip(jobs, outs):
        assert out.finish_reason == FinishReason.STOP, (name, seed, out.text)
        jsonschema.validate(json.loads(out.text), DOCUMENTS[name])


@pytest.mark.slow
def test_alone_equals_inside_a_batch_with_free_rows(llm):
    alone = llm.run([_build(llm, NODE, 5)])[0]
    free = llm.run([llm.build(Request(prompt="It was", params=_params(llm, 6)))])[0]
    mixed = llm.run([llm.build(Request(prompt="It was", params=_params(llm, 6))), _build(llm, NODE, 5),
                     _build(llm, SKELETON, 7)])
    assert mixed[1].token_ids == alone.token_ids and mixed[1].text == alone.text
    assert mixed[0].token_ids == free.token_ids
    jsonschema.validate(json.loads(alone.text), NODE)
