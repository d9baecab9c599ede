"""Structured outputs (engine/structured): the schema subset and its refusals by path, integer
ranges as regexes, and decoding under the constraint with both runners: every output parses and
validates, a constrained request decodes the same alone and in a batch, and unconstrained rows
sharing its forwards decode exactly as without it."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import jsonschema
import pytest

from celeris.engine.errors import InvalidRequest
from celeris.engine.llm import EMBEDDED_MODELS, LLM
from celeris.engine.requests import Request
from celeris.engine.families.checkpoint import read_config
from celeris.engine.structured.constraint import Compiler, Constraint, StructureError, Structured
from celeris.engine.tokenizer import Tokenizer
from celeris.engine.structured.regexes import int_range, max_width, RegexError
from celeris.engine.structured.schema import MAX_DEPTH, SchemaError, Slot, compile_schema
from tests.unit.schemas import PERSON


@pytest.mark.parametrize("lo,hi", [(0, 0), (0, 9), (5, 123), (-50, 17), (-1000, -3), (7, 100000)])
def test_int_range_matches_exactly_the_range(lo, hi):
    r = re.compile(int_range(lo, hi) + r"\Z")
    assert [n for n in range(lo - 30, hi + 31) if r.match(str(n))] == list(range(lo, hi + 1))


@pytest.mark.parametrize("schema,path", [
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "object"}, "maxItems": 2}}},
     "s.properties.tags.items"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": []}, "s.required"),
    ({"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}]}}}, "s.properties.a.anyOf"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "$defs": {"A": {"type": "string"}}}, "s.$defs"),
    ({"type": "object", "properties": {"a": {"$ref": "#/properties/b"}, "b": {"type": "string"}}},
     "s.properties.a.$ref"),
    ({"type": "object", "properties": {"a": {"oneOf": [{"type": "string"}], "type": "string"}}}, "s.properties.a.oneOf"),
    ({"type": "object", "properties": {"a": {"allOf": [{"type": "integer"}]}}}, "s.properties.a.allOf"),
    ({"type": ["string", "null"]}, "s.type"),
    ({"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 5}}}, "s.properties.a.multipleOf"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "patternProperties": {}}, "s.patternProperties"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "minProperties": 1}, "s.minProperties"),
    ({"type": "object", "properties": {"a": {"type": "string", "maxLength": 1000}}}, "s.properties.a.maxLength"),
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": 5, "maxLength": 2}}},
     "s.properties.a.minLength"),
    ({"type": "string", "enum": ["a", 1]}, "s.enum"),
    ({"type": "integer", "const": 1.5}, "s.const"),
    ({"enum": [{"a": 1}]}, "s.enum"),
    ({"enum": []}, "s.enum"),
    ({"type": "integer", "maximum": 1e20}, "s.maximum"),
    ({"type": "integer", "exclusiveMinimum": True}, "s.exclusiveMinimum"),
    ({"type": "number", "minimum": 0.1, "maximum": 0.9}, "s"),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 99}, "s.maxItems"),
    ({"type": "array", "items": [{"type": "integer"}], "maxItems": 2}, "s.items"),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 2, "uniqueItems": True}, "s.uniqueItems"),
    ({"type": "array", "items": {"type": "string", "pattern": "[a-z]{2}"}, "maxItems": 2}, "s.items.pattern"),
    ({"type": "object", "properties": {'a"b': {"type": "string"}}}, "s.properties"),
    ({"type": "object", "properties": {"a": {"type": "string", "format": "email"}}}, "s.properties.a.format"),
    ({"type": "array", "items": {"type": "integer"}}, "s.maxItems"),
    ({"type": "string", "pattern": "[a-z]+"}, "s.pattern"),
    ({"type": "object", "properties": {}, "additionalProperties": True}, "s.additionalProperties"),
])
def test_unsupported_schemas_are_refused_by_path(schema, path):
    with pytest.raises((SchemaError, RegexError)) as e:
        compile_schema(schema, "s")
    assert e.value.path == path


def test_nesting_is_bounded_at_the_stated_depth():
    def nested(n: int) -> dict:
        s: dict = {"type": "integer"}
        for _ in range(n):
            s = {"type": "object", "properties": {"x": s}}
        return s

    compile_schema(nested(MAX_DEPTH), "s")  # the stated depth compiles
    with pytest.raises(SchemaError, match="nest") as e:
        compile_schema(nested(MAX_DEPTH + 1), "s")
    assert e.value.path == "s" + ".properties.x" * MAX_DEPTH


# Every part of the issue's subset compiles, and what it serves validates (jsonschema checks the
# slot regexes' every match here by sampling them with the constraint in the decoding tests).
SUBSET = {"type": "object", "additionalProperties": False, "$schema": "https://json-schema.org/draft/2020-12/schema",
          "required": ["s", "p", "e", "te", "i", "x", "n", "b", "z", "a", "o"], "properties": {
              "s": {"type": "string", "minLength": 1, "maxLength": 8}, "p": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"},
              "e": {"enum": ["a", "b"]}, "te": {"type": "string", "enum": ["x", "y"]},
              "i": {"type": "integer", "minimum": -3, "maximum": 7},
              "x": {"type": "integer", "exclusiveMinimum": 2, "exclusiveMaximum": 6},
              "n": {"type": "number", "minimum": -2.5, "exclusiveMaximum": 3}, "b": {"type": "boolean"},
              "z": {"type": "null"}, "a": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
              "o": {"type": "object", "properties": {"k": {"const": 1}}}}}


def test_the_subset_compiles_and_exclusive_bounds_stay_inside():
    parts = compile_schema(SUBSET, "s")
    slot = {p.path: p for p in parts if isinstance(p, Slot)}
    assert set(slot) == {f"s.properties.{k}" for k in SUBSET["required"] if k != "o"} | {"s.properties.o.properties.k"}
    x = re.compile(slot["s.properties.x"].regex + r"\Z")
    assert [v for v in range(-5, 15) if x.match(str(v))] == [3, 4, 5]
    n = re.compile(slot["s.properties.n"].regex + r"\Z")
    assert n.match("1.999999") and n.match("2") and n.match("-2") and not n.match("3") and not n.match("-2.5")


def test_regex_width_is_bounded_before_compiling():
    assert max_width(r"[a-z]{1,8}@[a-z]{2,6}\.com", "r") == 8 + 1 + 6 + 4
    with pytest.raises(RegexError, match="unbounded"):
        max_width("a+b", "r")


@pytest.fixture(scope="module")
def compiler():
    folder = EMBEDDED_MODELS["celeris-tiny"]
    cfg = read_config(folder)
    tok = Tokenizer.from_dir(folder, cfg)
    return Compiler(tok, cfg.vocab_size), tok


def test_skeleton_slots_fronts_and_filler(compiler):
    comp, tok = compiler
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": ["x", "yz"]}}}
    layout = comp.compile(Structured("json_schema", schema, "s"), 32)
    text = tok.render(layout.canvas)
    assert text.startswith('{"a":') and '"b":' in text and len(layout.slots) == 2
    assert all(layout.canvas[i] == tok.mask_id for s in layout.slots for i in range(s.start, s.start + s.capacity))
    c = Constraint(layout, comp)
    a, b = layout.slots
    assert c.fronts(0, 32) == [a.start, b.start]  # one front a slot, in parallel
    allowed = c.allowed(a.start)
    assert {tok.token_text(i) for i in allowed.nonzero().flatten().tolist()} <= {"t", "f", "tr", "fa", "true", "false",
                                                                               "tru", "fal", "fals"}
    assert not allowed[comp.json_filler] and not allowed[tok.eos_id]  # nothing matched yet: no end
    for t in comp._encode("true"):
        c.commit(c.fronts(a.start, a.start + a.capacity)[0], t)
    end = c.fronts(a.start, a.start + a.capacity)[0]
    assert c.allowed(end)[comp.json_filler]  # a complete match may end
    c.commit(end, comp.json_filler)
    rest = c.fronts(a.start, a.start + a.capacity)
    assert rest == list(range(end + 1, a.start + a.capacity))  # the slot's tail: all at once, filler only
    assert all(c.allowed(p).sum() == 1 for p in rest)


def test_regex_and_choice_fill_the_canvas_and_end_with_a_stop(compiler):
    comp, tok = compiler
    layout = comp.compile(Structured("choice", ["yes", "no"]), 8)
    assert len(layout.slots) == 1 and layout.slots[0].capacity == 8 and layout.slots[0].filler == tok.eos_id
    with pytest.raises(StructureError, match="tokens"):
        comp.compile(Structured("regex", "[a-z]{20}"), 8)
    with pytest.raises(StructureError) as e:
        comp.compile(Structured("json_schema", {"type": "object", "properties": {"x": {"type": "string", "maxLength": 32}}},
                                "f"), 8)
    assert e.value.path == "f" and "max_tokens" in e.value.reason


@pytest.fixture(scope="module", params=["celeris-tiny", "celeris-tiny-block"])
def llm(request):
    return LLM.load(EMBEDDED_MODELS[request.param])


def _params(llm, seed):
    return replace(llm.defaults, gen_length=128, steps=128, block_length=32, temperature=1.0, seed=seed)


def _run(llm, specs_prompts):
    return llm.run([llm.build(Request(prompt=p, params=params, structured=spec)) for spec, p, params in specs_prompts])


@pytest.mark.slow  # seconds on an idle machine, minutes on a loaded one
def test_outputs_always_validate_with_both_runners(llm):
    jobs = [(Structured("json_schema", PERSON), "Person:", _params(llm, s)) for s in range(3)]
    jobs += [(Structured("choice", ["not sure", "a/b", "x-y [z]"]), "Q:", _params(llm, 1)),
             (Structured("regex", r"[a-z]{1,8}@[a-z]{2,6}\.(com|org)"), "Mail:", _params(llm, 2)),
             (Structured("json_object"), "Obj:", _params(llm, 3))]
    jobs += [(Structured("json_schema", SUBSET), "All:", _params(llm, s)) for s in range(2)]
    out = [r.text for r in _run(llm, jobs)]
    for text in out[6:]:
        jsonschema.validate(json.loads(text), SUBSET)
    for text in out[:3]:
        jsonschema.validate(json.loads(text), PERSON)
        assert text.startswith('{"name":"') and text.endswith("}")  # exactly the JSON, no filler
    assert out[3] in ("not sure", "a/b", "x-y [z]")
    assert re.fullmatch(r"[a-z]{1,8}@[a-z]{2,6}\.(com|org)", out[4])
    assert isinstance(json.loads(out[5]), dict)


@pytest.mark.slow
def test_alone_equals_batched_and_free_rows_are_untouched(llm):
    spec = Structured("json_schema", PERSON)
    alone = _run(llm, [(spec, "Person:", _params(llm, 7))])[0]
    free_alone = llm.run([llm.build(Request(prompt="It was", params=_params(llm, 8)))])[0]
    mixed = _run(llm, [(None, "It was", _params(llm, 8)), (spec, "Person:", _params(llm, 7)),
                       (Structured("choice", ["yes", "no"]), "Q:", _params(llm, 9))])
    assert mixed[1].text == alone.text and mixed[1].token_ids == alone.token_ids
    assert mixed[0].token_ids == free_alone.token_ids


def test_refusals_name_the_field(llm):
    # Arrays of objects go the whole-document path now; `not` is what neither path honours.
    bad = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "object", "not": {}}}}}
    with pytest.raises(InvalidRequest) as e:
        llm.build(Request(prompt="x", structured=Structured("json_schema", bad, "response_format.json_schema.schema")))
    assert e.value.violations[0].field == "response_format.json_schema.schema.properties.tags.items.not"
    with pytest.raises(InvalidRequest, match="canvas"):
        llm.build(Request(prompt="x", params=replace(llm.defaults, gen_length=8, steps=8, block_length=8),
                          structured=Structured("json_schema", PERSON)))
    with pytest.raises(InvalidRequest, match="stop"):
        llm.build(Request(prompt="x", params=replace(llm.defaults, stop=("}",)), structured=Structured("regex", "a{1,3}")))
    with pytest.raises(InvalidRequest, match="characters"):
        llm.build(Request(prompt="x", structured=Structured("json_schema", "[" * 400_000)))


def test_constrain_in_place_equals_the_copy_and_the_copy_leaves_the_logits_alone():
    import torch
    from celeris.engine.sampling.select import constrain
    logits = torch.randn(2, 3, 10)
    allowed = torch.zeros(2, 10, dtype=torch.bool)
    allowed[0, [1, 4]] = allowed[1, 7] = True
    flat = torch.tensor([1, 5])
    before = logits.clone()
    copy = constrain(logits, flat, allowed)
    assert torch.equal(logits, before)  # a row that asks for logprobs reads the model's own
    inplace = constrain(logits, flat, allowed, inplace=True)
    assert torch.equal(inplace, copy) and inplace.data_ptr() == logits.data_ptr()
    assert copy.view(6, 10)[1].isfinite().nonzero().flatten().tolist() == [1, 4]
    assert torch.equal(copy.view(6, 10)[[0, 2, 3, 4]], before.view(6, 10)[[0, 2, 3, 4]])
