"""The whole-document path's closing (issue 42): no committed token, wherever it lands, leaves the
document unable to end inside the canvas; the up-front refusal counts tokens, not bytes.

Schemas written for these tests: an early choice (an optional key, an anyOf branch, an array
item) makes the rest of the shortest document much longer than the gap left, so a token committed
far from the end would cut the document. An adversarial driver picks such tokens whenever the
mask allows them; the engine decodes them beside a free request and another schema."""

from __future__ import annotations

import random
from dataclasses import replace

import llguidance
import numpy as np
import pytest

from celeris.engine.errors import InvalidRequest
from celeris.engine.requests import Request
from celeris.engine.structured import compiler as compiler_module, completion
from celeris.engine.structured.completion import Fuel, Scan, segment, shortest
from celeris.engine.structured.constraint import Compiler, Constraint, Structured, StructureError
from tests.unit.structured.decoding import decode_beside_free, valid

_STAMP = {"type": "string", "format": "date-time"}
# `{"n":0}` is the shortest document; opening "big" early needs ~12 date-times more.
FAR = {"type": "object", "required": ["n"], "properties": {
    "n": {"type": "integer"},
    "big": {"type": "object", "required": [f"stamp{i}" for i in range(12)],
            "properties": {f"stamp{i}": _STAMP for i in range(12)}},
    "note": {"type": "string"}}}
# A branch chosen by a key's value: the short one or one with a long required remainder.
BRANCH = {"type": "object", "required": ["kind"], "properties": {"kind": {"type": "string"}}, "anyOf": [
    {"properties": {"kind": {"const": "a"}}},
    {"properties": {"kind": {"const": "b"}, "rest": {"type": "array", "minItems": 30, "items": _STAMP}},
     "required": ["rest"]}]}
# Items whose every one is long, in an unbounded array: each `,` opens another.
ITEMS = {"type": "object", "required": ["xs"], "properties": {
    "xs": {"type": "array", "items": {"type": "object", "required": ["when", "until"],
                                      "properties": {"when": _STAMP, "until": _STAMP}}}}}


def _drive(compiler: Compiler, schema: dict, n: int, seed: int) -> tuple[list[int], int]:
    """Decode `schema` on an n-token canvas without a model: at each front, a token that opens
    something (`,` `{` `[` `"`) whenever the mask allows one, else any allowed token; the stop
    id only when nothing else is allowed. -> (tokens before the stop id, fronts whose every
    allowed token was checked against a fresh search)."""
    rng = random.Random(seed)
    c = Constraint(compiler.compile(Structured("json_schema", schema, "s"), n), compiler)
    eos, byts = compiler.tok.eos_id, compiler.tokens.bytes
    out: list[int] = []
    for p in range(n):
        _, words = c.window([p])
        allowed = [int(t) for t in np.flatnonzero(np.unpackbits(words[0].view(np.uint8), bitorder="little"))
                   if t < compiler.vocab_size]
        body = [t for t in allowed if t != eos]
        if not body:
            assert allowed == [eos], "a front with no token to continue"
            return out, p
        opening = [t for t in body if any(b in byts[t] for b in b',{["')]
        tok = rng.choice(opening if opening and rng.random() < 0.8 else body)
        c.commit(p, tok)
        out.append(tok)
    return out, n


@pytest.mark.parametrize("schema,n", [(FAR, 48), (FAR, 120), (BRANCH, 40), (BRANCH, 160), (ITEMS, 60),
                                      (ITEMS, 200)])
def test_an_adversarial_decode_always_closes_inside_the_canvas(compiler, schema, n):
    for seed in range(3):
        out, _ = _drive(compiler, schema, n, seed)
        assert len(out) < n or compiler.tokens.eos not in out
        valid(schema, compiler.tok.decode(out))


def test_every_token_the_mask_allows_leaves_a_completion_that_fits(compiler):
    """At each front of a tight decode, every allowed token is followed by a completion (searched
    afresh, independently of the closer's cache) within the positions left."""
    n = 56
    c = Constraint(compiler.compile(Structured("json_schema", FAR, "s"), n), compiler)
    rng, eos = random.Random(0), compiler.tok.eos_id
    scratch = np.zeros(c.words, np.uint32)
    for p in range(n):
        _, words = c.window([p])
        if p in c._force:  # a token the grammar forces (the matcher already took it)
            c.commit(p, c._force[p])
            continue
        allowed = [int(t) for t in np.flatnonzero(np.unpackbits(words[0].view(np.uint8), bitorder="little"))
                   if t < compiler.vocab_size and t != eos]
        if not allowed:
            break
        m, closer = c._matchers[0], c._closers[0]
        for t in allowed[:40]:
            mm, scan = m.deep_copy(), closer.scan.copy()
            assert mm.consume_token(t)
            scan.feed(compiler.tokens.bytes[t])
            rest = [] if mm.is_accepting() else shortest(compiler.tokens, mm, scan, 4096, scratch)
            assert rest is not None and 1 + len(rest) <= n - p, (p, compiler.tokens.bytes[t])
        c.commit(p, rng.choice([t for t in allowed if b"," in compiler.tokens.bytes[t]] or allowed))


def test_the_shortest_document_counts_tokens_not_bytes(compiler):
    """Keys spelled by multi-byte tokens: the up-front count is the fewest tokens, below the
    bytes, and a canvas of exactly that many tokens and the stop token is accepted and closes."""
    schema = {"type": "object", "required": ["description", "properties", "required"], "properties": {
        "description": {"type": "integer"}, "properties": {"type": "integer"}, "required": {"type": "integer"},
        "note": {"type": "string"}}}  # an optional key: the document path
    layout = compiler.compile(Structured("json_schema", schema, "s"), 512)
    least = layout.needed
    assert layout.path == "document"
    data = b'{"description":0,"properties":0,"required":0}'
    assert 0 < least < len(data)
    compiler.compile(Structured("json_schema", schema, "s"), least)
    with pytest.raises(StructureError, match=rf"shortest document takes {least - 1} tokens and its stop token"):
        compiler.compile(Structured("json_schema", schema, "s"), least - 1)
    out, _ = _drive(compiler, schema, least, 0)
    valid(schema, compiler.tok.decode(out))


def test_a_string_the_greedy_order_cycles_in_is_ended_by_search(compiler):
    """A pattern the greedy byte order never ends ('aa@aa@...'): the search finds its end, so the
    schema is served with its end promised, and a schema with no finite document is refused."""
    schema = {"type": "object", "required": ["id"], "properties": {
        "id": {"type": "string", "pattern": "^[a-z]{2}@[a-z]{2}#[0-9]{3}$"}, "note": {"type": "string"}}}
    layout = compiler.compile(Structured("json_schema", schema, "s"), 512)
    assert layout.path == "document" and 0 < layout.needed < 30
    p = shortest(compiler.tokens, llguidance.LLMatcher(compiler.ll, layout.slots[0].grammar), Scan(), 4096,
                 np.zeros((compiler.vocab_size + 31) // 32, np.uint32))
    valid(schema, compiler.tok.decode(p))
    endless = {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "required": ["next"],
                                                          "properties": {"next": {"$ref": "#/$defs/node"}}}}}
    with pytest.raises(StructureError, match="no document of at most|search budget"):  # whichever ends first
        compiler.compile(Structured("json_schema", endless, "s"), 512)


@pytest.mark.parametrize("pattern", ["^[a-z]{2}@[a-z]{2}#[0-9]{3}$", "^[A-Z]{3}-[0-9]{2}$", "^[0-9a-f]{8}-[0-9a-f]{4}$"])
def test_the_string_search_validates_bytes_past_mask_vocab_as_a_mask_would_allow_them(compiler, monkeypatch,
                                                                                      pattern):
    """Past MASK_VOCAB the breadth-first search validates its bytes one by one instead of reading
    them from a mask (a mask walks the whole vocabulary: ~4 ms at LLaDA's 126k tokens, where
    decoding spent most of a step in these masks). Both ways find the same bytes at every state
    along the way and the same end of the string."""
    schema = {"type": "object", "required": ["id"], "properties": {"id": {"type": "string", "pattern": pattern},
                                                                   "note": {"type": "string"}}}  # the document path
    m = llguidance.LLMatcher(compiler.ll, compiler.compile(Structured("json_schema", schema, "s"), 512).slots[0].grammar)
    assert m.consume_tokens(compiler.ll.tokenize_str('{"id":"'))
    scan, scratch = Scan(), np.zeros((compiler.vocab_size + 31) // 32, np.uint32)
    scan.feed(b'{"id":"')

    def both(state):
        masked = completion._classes(compiler.tokens, state, scratch, Fuel(100))[1]
        monkeypatch.setattr(completion, "MASK_VOCAB", 0)
        validated = completion._classes(compiler.tokens, state, scratch, Fuel(1000))[1]
        monkeypatch.undo()
        return masked, validated

    masked_end = completion._string_end(compiler.tokens, m, scan, scratch, Fuel(10**6))
    monkeypatch.setattr(completion, "MASK_VOCAB", 0)
    validated_end = completion._string_end(compiler.tokens, m, scan, scratch, Fuel(10**6))
    monkeypatch.undo()
    assert masked_end is not None and validated_end is not None and masked_end[2] == validated_end[2]
    state = m.deep_copy()
    for t in masked_end[2]:
        masked, validated = both(state)
        assert masked == validated and t in masked
        assert state.consume_token(t)


def test_tight_canvases_validate_beside_a_free_request_and_another_schema(llm):
    """Through the engine: the far-from-end schemas at tight max_tokens, in one batch with a free
    request and a different schema; a refused request fails alone, and every document validates."""
    other = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}}}
    tiny = replace(llm.defaults, gen_length=2, steps=2, block_length=2, temperature=1.0, seed=0)
    with pytest.raises(InvalidRequest, match="shortest document"):  # refused up front, alone
        llm.build(Request(prompt="JSON:", params=tiny, structured=Structured("json_schema", ITEMS, "s")))
    decode_beside_free(llm, [(FAR, 64), (BRANCH, 48), (ITEMS, 64), (FAR, 96), (BRANCH, 96), (other, 32)])


def test_a_completion_search_past_its_budget_refuses_the_schema_by_name(llm, monkeypatch):
    """A schema whose shortest document the compile-time search cannot find within COMPILE_FUEL
    matcher operations is refused (deterministically: a budget in work, not seconds)."""
    monkeypatch.setattr(compiler_module, "COMPILE_FUEL", 5)
    fresh = Compiler(llm.tokenizer, llm.requests.family_vocab)  # verdicts are remembered per compiler
    with pytest.raises(StructureError, match="search budget"):
        fresh.compile(Structured("json_schema", FAR, "response_format.json_schema.schema"), 120)


def test_per_token_searches_cut_by_their_budget_only_narrow_the_mask(compiler, monkeypatch):
    """With TOKEN_FUEL tiny every per-token search runs out: those tokens leave the mask, and the
    adversarial decode still closes inside the canvas and validates."""
    from celeris.engine.structured import document

    monkeypatch.setattr(document, "TOKEN_FUEL", 1)
    for schema, n in ((FAR, 48), (BRANCH, 40), (ITEMS, 60)):
        out, _ = _drive(compiler, schema, n, 0)
        valid(schema, compiler.tok.decode(out))


def test_forced_tokens_take_the_completions_spelling_where_it_is_shorter(compiler):
    """llguidance's fast-forward tokens for a forced key may spell it in more tokens than the
    completion the invariant counted (seen with llada-vocab: `no`,`d`,`e`,`M`,`a`,`ps` where the
    completion had three), which left the rest of the completion no room: the forced bytes are
    committed as the completion spells them instead, where its whole tokens cover them."""
    from celeris.engine.structured.document import Closer

    toks = compiler.tokens
    one = {b: toks.spell[bytes([b])] for b in b'"nodeMaps:[]}'}
    ff = [one[b] for b in b'"nodeMaps"']  # ten single-byte tokens
    closer = Closer(toks, (compiler.vocab_size + 31) // 32)
    head = segment(toks, None, b'"nodeMaps"')
    assert len(head) < len(ff)
    closer.path = head + segment(toks, None, b":[]}")
    assert closer.spelled(ff) == head  # the same bytes, the completion's fewer tokens
    closer.path = None  # no completion known: llguidance's own tokens
    assert closer.spelled(ff) == ff
    closer.path = ff + [one[ord(":")]]  # the completion spells them alike
    assert closer.spelled(ff) == ff


class _ByteForcing:
    """An llguidance matcher whose fast-forward spells each forced byte as its own token, as
    llguidance did for some keys on llada-vocab (`no`,`d`,`e`,`M`,`a`,`ps`)."""

    def __init__(self, m: llguidance.LLMatcher, tokens):
        self._m, self._tokens = m, tokens

    def compute_ff_tokens(self) -> list[int]:
        data = b"".join(self._tokens.bytes[t] for t in self._m.compute_ff_tokens())
        return [self._tokens.spell[data[i:i + 1]] for i in range(len(data))]

    def __getattr__(self, name):
        return getattr(self._m, name)


def test_forced_keys_cut_by_a_narrow_window_still_take_the_completions_spelling(compiler):
    """A window of one column lets one forced token commit a step. The completion's spelling is
    chosen over all the forced bytes before that cut: cut first, the single-byte piece is not the
    completion's first token, the completion is lost, and a key spelled byte by byte leaves the
    document no room on a canvas of its shortest length."""
    schema = {"type": "object", "required": ["nodeMaps", "description"], "properties": {  # "note" is
        "nodeMaps": {"type": "integer"}, "description": {"type": "integer"},  # optional: the document path
        "note": {"type": "string"}}}
    key = segment(compiler.tokens, None, b'{"nodeMaps":')
    assert len(key) < len(b'{"nodeMaps":')
    n = next(n for n in range(4, 64) if _compiles(compiler, schema, n))  # the tightest canvas served
    c = Constraint(compiler.compile(Structured("json_schema", schema, "s"), n), compiler)
    assert c.layout.path == "document"
    c._matchers[0] = _ByteForcing(c._matchers[0], compiler.tokens)
    out: list[int] = []
    for p in range(n):
        _, words = c.window([p])  # one column: at most one forced token a step
        allowed = [int(t) for t in np.flatnonzero(np.unpackbits(words[0].view(np.uint8), bitorder="little"))
                   if t < compiler.vocab_size]
        tok = min(allowed)  # any: the tight canvas leaves the mask one way to go
        c.commit(p, tok)
        out.append(tok)
    assert out[:len(key)] == key  # the completion's spelling, not one token a byte
    text = compiler.tok.decode([t for t in out if t != compiler.tok.eos_id])
    valid(schema, text)


def _compiles(compiler: Compiler, schema: dict, n: int) -> bool:
    try:
        compiler.compile(Structured("json_schema", schema, "s"), n)
        return True
    except StructureError:
        return False


class _Broken:
    """An llguidance matcher that raises where the fast-forward asks it for forced tokens."""

    def __init__(self, m: llguidance.LLMatcher):
        self._m = m

    def compute_ff_tokens(self) -> list[int]:
        raise RuntimeError("matcher state lost")

    def __getattr__(self, name):
        return getattr(self._m, name)


def test_a_matcher_raising_in_the_fast_forward_fails_its_own_request_by_name(compiler):
    """The fast-forward runs llguidance too (and a completion search): its errors are this
    request's InvalidRequest, which the step turns into this row's error alone (masks.window_masks
    catches only that), never an exception out of the batch's step."""
    schema = {"type": "object", "required": ["nodeMaps"], "properties": {
        "nodeMaps": {"type": "integer"}, "note": {"type": "string"}}}
    c = Constraint(compiler.compile(Structured("json_schema", schema, "s"), 64), compiler)
    c._matchers[0] = _Broken(c._matchers[0])
    with pytest.raises(InvalidRequest, match="the constraint library failed"):
        c.window(list(range(8)))


@pytest.mark.parametrize("schema", [FAR, BRANCH, ITEMS], ids=["far", "branch", "items"])
def test_accepts_by_validation_equals_consuming_a_copy(compiler, schema):
    """completion.accepts asks llguidance whether the stop token is committable after a path (one
    validation) instead of consuming the path on a copy and asking is_accepting: the same answer
    on every path tried, from states along random walks (short and long, ending documents or not)."""
    from celeris.engine.structured.completion import accepts

    rng = random.Random(3)
    eos = compiler.tok.eos_id
    c = Constraint(compiler.compile(Structured("json_schema", schema, "s"), 256), compiler)
    m = c._matchers[0]
    words = np.zeros(c.words, dtype=np.uint32)
    checked = agreed_true = 0
    for _ in range(120):
        m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        allowed = [int(t) for t in np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))
                   if t < compiler.vocab_size and t != eos]
        if not allowed:
            break
        probe, walk = m.deep_copy(), []
        for _ in range(rng.randrange(0, 40)):  # a path from here, along what the grammar allows
            probe.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
            nxt = [int(t) for t in np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))
                   if t < compiler.vocab_size and t != eos]
            if not nxt:
                break
            walk.append(rng.choice(nxt))
            probe.consume_token(walk[-1])
        for path in (walk, walk[:len(walk) // 2], walk + [rng.randrange(compiler.vocab_size)], []):
            copy = m.deep_copy()
            slow = m.validate_tokens(path) == len(path) and copy.consume_tokens(path) and copy.is_accepting()
            assert accepts(m, path, eos) == slow, path
            checked, agreed_true = checked + 1, agreed_true + slow
        assert m.consume_token(rng.choice(allowed))
    assert checked >= 20 and 1 <= agreed_true < checked  # both answers were met
