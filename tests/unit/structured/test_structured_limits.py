"""Structured outputs refuse what they cannot honour before any work (issue 40, items 1-4): an
empty language at compile, by the client's field or schema path; `pattern` with `minLength` /
`maxLength` honoured together or refused; schema nesting and size bounded before parsing (never a
RecursionError); the cheap checks before any slot grammar compiles; structured builds on a thread
of their own, so compiling never queues in front of another request's tokenizing."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import replace

import jsonschema
import pytest

from celeris.engine.errors import InvalidRequest, Overloaded
from celeris.engine.llm import LLM
from celeris.engine.requests import Request
from celeris.engine.structured import constraint
from celeris.engine.structured.constraint import MAX_SCHEMA_NESTING, Structured

EMPTY_REGEXES = [r"[^\s\S]", r"[^\x00-\x7f]{1,5}"]
EMPTY_PATTERNS = ['"', "\\\\", "^[À-ÿ]{1,20}$", '^"{1,3}$']


def _params(llm: LLM, n: int = 64):
    return replace(llm.defaults, gen_length=n, steps=n, block_length=32, temperature=1.0, seed=4)


def _refusal(llm: LLM, spec: Structured, n: int = 64) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as e:
        llm.build(Request(prompt="x", params=_params(llm, n), structured=spec))
    return e.value


def _one_string(**string) -> dict:
    return {"type": "object", "properties": {"a": {"type": "string", **string}}}


@pytest.mark.parametrize("regex", EMPTY_REGEXES)
def test_an_empty_regex_language_is_refused_at_compile_naming_the_field(llm, regex):
    e = _refusal(llm, Structured("regex", regex, "structured_outputs.regex"))
    assert e.violations[0].field == "structured_outputs.regex" and "empty" in e.violations[0].description


@pytest.mark.parametrize("pattern", EMPTY_PATTERNS)
def test_a_pattern_no_json_string_can_hold_is_refused_by_its_path(llm, pattern):
    e = _refusal(llm, Structured("json_schema", _one_string(pattern=pattern), "response_format.json_schema.schema"))
    assert e.violations[0].field == "response_format.json_schema.schema.properties.a"
    assert "empty" in e.violations[0].description


def test_a_pattern_shorter_than_min_length_is_refused_by_path(llm):
    e = _refusal(llm, Structured("json_schema", _one_string(pattern="a{0,2}", minLength=5), "s"))
    assert e.violations[0].field == "s.properties.a.minLength"
    # an intersection found empty only by the constraint library is refused too
    e = _refusal(llm, Structured("json_schema", _one_string(pattern="[a-c]{1,2}|[0-9]{8}", minLength=3, maxLength=6), "s"))
    assert e.violations[0].field == "s.properties.a" and "empty" in e.violations[0].description


@pytest.mark.slow  # decodes a few canvases
def test_pattern_and_lengths_hold_together_in_what_is_served(llm):
    cases = [_one_string(pattern="^[0-9]{1,20}$", maxLength=3), _one_string(pattern="[a-c]{1,2}|[0-9]{8}", minLength=5),
             _one_string(pattern="^[a-z]{0,9}$", minLength=4, maxLength=6)]
    seqs = [llm.build(Request(prompt="Value:", params=replace(_params(llm), seed=s), structured=Structured("json_schema", c)))
            for c in cases for s in range(3)]
    for r, schema in zip(llm.run(seqs), [c for c in cases for _ in range(3)]):
        jsonschema.validate(json.loads(r.text), schema)  # pattern, minLength and maxLength, all of them


def _nested_text(depth: int) -> str:
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "null"}' + "}}" * depth


def _nested_value(depth: int) -> dict:
    v: dict = {"type": "null"}
    for _ in range(depth):
        v = {"type": "object", "properties": {"a": v}}
    return v


@pytest.mark.parametrize("schema", ["[" * 16000 + "]" * 16000, _nested_text(700), _nested_value(5000)],
                         ids=["brackets", "json-text", "parsed-value"])
def test_a_schema_nested_thousands_deep_is_refused_naming_the_limit(llm, schema):
    e = _refusal(llm, Structured("json_schema", schema, "response_format.json_schema.schema"))
    assert e.violations[0].field == "response_format.json_schema.schema"
    assert f"{MAX_SCHEMA_NESTING} deep" in e.violations[0].description


def test_nesting_within_the_limit_is_checked_by_the_schema_rules_not_the_limit(llm):
    # 16 levels of JSON, 8 objects: deeper than the skeleton's 4, so the whole-document path (#42)
    seq = llm.build(Request(prompt="x", params=_params(llm), structured=Structured("json_schema", _nested_text(8), "s")))
    assert seq.constraint.layout.path == "document"


def test_a_schema_too_big_for_max_tokens_is_refused_before_any_slot_compiles(llm, monkeypatch):
    compiled = []
    grammar = constraint.Compiler._grammar
    monkeypatch.setattr(constraint.Compiler, "_grammar", lambda self, *a: compiled.append(a) or grammar(self, *a))
    wide = {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": f"^x{{{i}}}[a-z]{{1,30}}$"}
                                             for i in range(20)}}
    for _ in range(20):  # twenty clients' refused schemas compile nothing
        e = _refusal(llm, Structured("json_schema", wide, "s"), n=64)
        assert "max_tokens" in e.violations[0].description
    assert compiled == []


def test_a_slot_grammar_is_compiled_once_per_compiler(llm, monkeypatch):
    checked = []
    check = constraint.Compiler._check
    monkeypatch.setattr(constraint.Compiler, "_check", lambda self, *a: checked.append(a) or check(self, *a))
    monkeypatch.setattr(llm.requests, "_compiler", None)  # a fresh compiler: nothing remembered from other tests
    small = {"type": "object", "properties": {"k": {"type": "string", "pattern": "^[a-z]{1,4}$"}}}
    for _ in range(3):  # a schema sent again is not compiled again (nor is a refused one)
        llm.build(Request(prompt="x", params=_params(llm), structured=Structured("json_schema", small)))
        _refusal(llm, Structured("regex", "[^\\s\\S]"))
    assert len(checked) == 2


def test_structured_builds_never_queue_in_front_of_other_requests(llm, monkeypatch):
    """Compiling runs on its own thread: while it is stuck, free-text requests still build."""
    release = threading.Event()
    compile_ = constraint.Compiler.compile
    monkeypatch.setattr(constraint.Compiler, "compile", lambda self, *a: release.wait(60) and compile_(self, *a))
    spec = Structured("regex", "[a-z]{1,4}")

    async def main():
        stuck = [asyncio.ensure_future(llm.build_async(Request(prompt="x", params=_params(llm), structured=spec)))
                 for _ in range(4)]
        free = await asyncio.wait_for(llm.build_async(Request(prompt="plain", params=_params(llm))), 30)
        done_first = not any(t.done() for t in stuck)
        release.set()
        await asyncio.gather(*stuck)
        return free, done_first

    free, done_first = asyncio.run(main())
    assert free.constraint is None and done_first


def _large_schema(n: int = 0) -> dict:
    """An object schema whose JSON is over LARGE_SCHEMA_CHARS (many optional string keys)."""
    props = {f"field_{n}_{i:04d}": {"type": "string", "maxLength": 8, "description": "x" * 40}
             for i in range(constraint.LARGE_SCHEMA_CHARS // 60)}
    return {"type": "object", "properties": props}


def test_large_schemas_compile_on_their_own_lane_a_few_waiting_at_most(llm, monkeypatch):
    """A schema over LARGE_SCHEMA_CHARS compiles on a lane of its own: while large ones are stuck
    compiling, another client's small schema still builds (the stuck client's own further builds
    wait at its gate, engine/structured/lanes.py); past LARGE_SCHEMAS_WAITING more are refused as
    overload (retry later), not queued without bound."""
    assert Structured("json_schema", _large_schema()).large and not Structured("regex", "[a-z]").large
    release = threading.Event()
    compile_ = constraint.Compiler.compile

    def stuck_if_large(self, spec, *a):
        if spec.large:
            release.wait(60)
        return compile_(self, spec, *a)

    monkeypatch.setattr(constraint.Compiler, "compile", stuck_if_large)
    big = [Structured("json_schema", _large_schema(k)) for k in range(constraint.LARGE_SCHEMAS_WAITING + 1)]

    async def main():
        stuck = [asyncio.ensure_future(llm.build_async(Request(prompt="x", params=_params(llm), structured=s)))
                 for s in big[:-1]]
        await asyncio.sleep(0)  # every stuck build has counted itself
        with pytest.raises(Overloaded, match="one at a time"):
            await llm.build_async(Request(prompt="x", params=_params(llm), structured=big[-1]))
        small = await asyncio.wait_for(llm.build_async(Request(prompt="x", params=_params(llm),
                                                               structured=Structured("regex", "[a-z]{1,4}")),
                                                       client="another client"), 30)
        waiting = not any(t.done() for t in stuck)
        release.set()
        results = await asyncio.gather(*stuck, return_exceptions=True)
        return small, waiting, results

    small, waiting, results = asyncio.run(main())
    assert small.constraint is not None and waiting
    assert llm.requests._large_waiting == 0  # every place given back
    assert all(not isinstance(r, Overloaded) for r in results)


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_a_request_without_a_length_gets_the_canvas_its_structure_needs(llm):
    """No max_tokens (fit_canvas): a structure longer than the default canvas sizes it, in whole
    blocks, up to max_gen_length; a client's own length is never changed; past max_gen_length the
    refusal names the canvas as before."""
    d = llm.defaults
    spec = Structured("regex", "a{100}")  # 100 tokens at the most: more than the default 64
    with pytest.raises(InvalidRequest, match="canvas"):
        llm.build(Request(prompt="x", structured=spec))
    seq = llm.build(Request(prompt="x", structured=spec, fit_canvas=True))
    p = seq.params
    assert p.gen_length == -(-100 // d.block_length) * d.block_length and p.block_length == d.block_length
    assert p.steps == p.gen_length * d.steps // d.gen_length  # the defaults' steps per token
    result = llm.run([seq])[0]
    assert result.text == "a" * 100
    too_long = Structured("regex", "a{600}")  # over max_gen_length (512)
    with pytest.raises(InvalidRequest, match="canvas"):
        llm.build(Request(prompt="x", structured=too_long, fit_canvas=True))
    free = llm.build(Request(prompt="x", fit_canvas=True))  # nothing to fit: the defaults
    assert free.params.gen_length == d.gen_length
