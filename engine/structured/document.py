"""The whole-document path: a JSON schema the skeleton cannot express, as one llguidance grammar.

The skeleton (schema.py) places fixed tokens and fills bounded slots in parallel; it cannot hold
`$ref` (recursive too), optional keys, unbounded strings and arrays, anyOf/oneOf/allOf, type lists,
`format` or `additionalProperties`. Such a schema becomes one slot over the whole canvas whose
grammar is the document, from llguidance's own JSON-schema compiler; the slot commits from its
front left to right under the matcher's masks (several positions a step where the grammar forces
tokens: constraint.Constraint), and the stop id fills the canvas after the document's end.

Options are fixed here and override the schema's own `x-guidance`, so a client cannot relax what
is served: compact separators, no free whitespace (every position is content), no `lenient` mode
(a keyword llguidance does not implement is refused, never ignored), `oneOf` never coerced to
`anyOf`. Annotation and unknown keywords are ignored, as JSON Schema says. A schema llguidance
refuses is refused with the schema path its error points at where it can be found (`locate`).
"""

from __future__ import annotations

import json
import re
from typing import Iterator, Optional

import llguidance
import numpy as np

from celeris.engine.structured.formats import exact_formats

# Overrides (applied after the schema's own x-guidance): nothing a client sends relaxes these.
OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":", "lenient": False,
           "coerce_one_of": False}
_QUOTED = re.compile(r'"([^"]{1,100})"')
# Schema keywords whose string value an error may quote (an unknown format, a bad pattern, a $ref).
_VALUE_KEYS = ("format", "pattern", "$ref", "$dynamicRef", "type")


def document_grammar(schema: object) -> str:
    """llguidance's grammar of the whole document (not yet validated); ValueError if the
    library cannot read the schema at all (e.g. not an object). date-time, date and time are
    our exact patterns, not llguidance's looser regexes (formats.py)."""
    if schema is True:  # JSON Schema's `true`: any document
        schema = {}
    if not isinstance(schema, dict):  # `false` (no document) included
        raise ValueError("must be an object (a schema)")
    return llguidance.LLMatcher.grammar_from_json_schema(exact_formats(schema), overrides=OPTIONS)


def _walk(schema: object, root: str) -> Iterator[tuple[str, dict]]:
    """(path, sub-schema dict) of every dict in the schema, parents first, without recursion
    (the schema's nesting was bounded before this runs)."""
    stack = [(root, schema)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, dict):
            yield path, v
            stack += [(f"{path}.{k}", x) for k, x in reversed(list(v.items())) if isinstance(x, (dict, list))]
        elif isinstance(v, list):
            stack += [(f"{path}[{i}]", x) for i, x in reversed(list(enumerate(v))) if isinstance(x, (dict, list))]


def locate(schema: object, message: str, root: str) -> Optional[str]:
    """The schema path llguidance's error `message` points at, or None: a keyword it does not
    implement (`Unimplemented keys: ["uniqueItems"]`) by where that key first appears, else a
    keyword whose string value the message quotes (an unknown format, a pattern that does not
    parse, a $ref it cannot resolve), the longest such value first."""
    if "Unimplemented keys" in message:
        names = _QUOTED.findall(message.split("Unimplemented keys", 1)[1])
        for path, d in _walk(schema, root):
            hit = next((k for k in names if k in d), None)
            if hit is not None:
                return f"{path}.{hit}"
    best: Optional[tuple[int, str]] = None
    for path, d in _walk(schema, root):
        for key in _VALUE_KEYS:
            v = d.get(key)
            if isinstance(v, str) and len(v) >= 2 and v in message and (best is None or len(v) > best[0]):
                best = (len(v), f"{path}.{key}")
    return best[1] if best else None


def grammar_text(schema: object) -> str:
    """The schema's JSON text, key order kept (llguidance writes properties in that order): the
    key its verdict is remembered by."""
    return json.dumps(schema, separators=(",", ":"))


CLOSE_MARGIN = 8  # positions kept in hand beyond the completion before closing the document
CHECK_ZONE = 64  # within this many positions of the completion, tokens that could lengthen it are checked
MAX_CHECKS = 64  # such tokens checked a step; past that they are left out (it is closing time)
MAX_SHORTEST = 4096  # tokens the shortest document is looked for within at compile (not found: served, no promise)
_PRINTABLE = bytes(range(0x20, 0x7f))
_LETTERS = bytes(range(0x61, 0x7b)) + bytes(range(0x30, 0x3a)) + bytes(range(0x41, 0x5b))
# Bytes tried in order when writing the completion. Outside strings: close what is open, then
# separators (a member or item ends, the next required one starts), then the shortest values
# (digits before `"`: a digit is one token, a string two). Inside a string: close it first.
_OUTSIDE = b'}],:0123456789"ntf-.[{' + _LETTERS + _PRINTABLE
_INSIDE = b'"' + _LETTERS + _PRINTABLE
# Inside a string that has 3 or more bytes and may not end yet (a format, a pattern): the bytes
# that separate a format's parts first (email's @, a host's dots, a URI's colon), when the last
# two bytes are not one of them (a part of at least two characters: a top-level domain's).
_SEPARATORS = b'@.-:/_ '


class Scan:
    """Where a JSON prefix stands, fed byte by byte: inside a string (a key or a value) or not.
    Only the completion's byte order depends on it (the grammar decides what is allowed)."""

    __slots__ = ("stack", "string", "key", "escape", "want_key", "length", "since")

    def __init__(self):
        self.stack, self.string, self.key, self.escape, self.want_key = [], False, False, False, False
        self.length = 0  # bytes in the string open now
        self.since = 0  # bytes since its last separator (or its start)

    def copy(self) -> "Scan":
        c = Scan()
        c.stack, c.string, c.key, c.escape, c.want_key = list(self.stack), self.string, self.key, self.escape, \
            self.want_key
        c.length, c.since = self.length, self.since
        return c

    def feed(self, data: bytes) -> None:
        for b in data:
            if self.string:
                self.length += 1
                self.since = 0 if b in _SEPARATORS else self.since + 1
                if self.escape:
                    self.escape = False
                elif b == 0x5C:  # backslash
                    self.escape = True
                elif b == 0x22:
                    self.string = False
            elif b == 0x22:
                self.string, self.key, self.want_key, self.length, self.since = True, self.want_key, False, 0, 0
            elif b in (0x7B, 0x5B):  # { [
                self.stack.append(b)
                self.want_key = b == 0x7B
            elif b in (0x7D, 0x5D):  # } ]
                if self.stack:
                    self.stack.pop()
                self.want_key = False
            elif b == 0x2C:  # ,
                self.want_key = bool(self.stack) and self.stack[-1] == 0x7B
            elif b == 0x3A:  # :
                self.want_key = False

    @property
    def in_value_string(self) -> bool:
        return self.string and not self.key


class Tokens:
    """Per tokenizer, built once (Compiler.tokens): each token's bytes, the single-byte tokens in
    the completion's two byte orders, and which tokens may lengthen the completion inside a
    string value (those holding a quote or a backslash: they end the string or start an escape)."""

    def __init__(self, ll: llguidance.LLTokenizer, vocab: int, eos: int):
        self.eos, self.vocab = eos, vocab
        self.bytes = [ll.decode_bytes([t]) for t in range(vocab)]
        one = {}
        for b in range(256):
            ids = ll.tokenize_bytes(bytes([b]))
            if len(ids) == 1:
                one[b] = ids[0]
        self.outside = [one[b] for b in dict.fromkeys(_OUTSIDE) if b in one]
        self.inside = [one[b] for b in dict.fromkeys(_INSIDE) if b in one]
        self.separators = {one[b] for b in _SEPARATORS if b in one}
        self.separated = self.inside[:1] + [one[b] for b in _SEPARATORS if b in one] + [
            t for t in self.inside[1:] if t not in self.separators]
        self.digits = {one[b] for b in b"0123456789" if b in one}
        self.numeric = self.inside[:1] + [t for t in self.inside[1:] if t in self.digits] + [
            t for t in self.inside[1:] if t not in self.digits]
        self.quoting = np.array([b'"' in x or b"\\" in x for x in self.bytes], dtype=bool)


class Closer:
    """How a document ends before the canvas does (one per forced slot of a request). It keeps a
    completion of the matcher's state: a short sequence of tokens to the document's end, written
    greedily (`shortest`: one single-byte token at a time, the first the grammar allows in a
    context-aware byte order, checked with `validate_tokens`, no masks). While the completion plus
    CLOSE_MARGIN fits the positions left, the model chooses freely; after, only the completion's
    next token is allowed, and committing it leaves the rest of the completion valid (nothing is
    recomputed while closing). Within CHECK_ZONE positions of the completion, every allowed token
    that could lengthen it (anything but plain string-value text) is checked first: the
    completion after it must still fit, else it is left out of the mask. So a document ends as a
    complete document whenever its completion fits the canvas; Compiler refuses a schema whose
    shortest document does not fit max_tokens."""

    def __init__(self, tokens: Tokens, words: int):
        self.t = tokens
        self.scan = Scan()
        self.path: Optional[list[int]] = None  # the completion of the matcher's current state, if known
        self._scratch = np.zeros(words, dtype=np.uint32)

    def consumed(self, tokens: list[int]) -> None:
        """The slot's matcher consumed these tokens (committed or fast-forwarded)."""
        for t in tokens:
            self.scan.feed(self.t.bytes[t])
            self.path = self.path[1:] if self.path and self.path[0] == t else None

    def completion(self, matcher: llguidance.LLMatcher, limit: int) -> Optional[list[int]]:
        """The completion of the matcher's state (remembered until a token leaves it), or None if
        it needs more than `limit` tokens."""
        if self.path is None:
            self.path = shortest(self.t, matcher, self.scan, limit, self._scratch)
            if self.path is None:
                return None
        return self.path if len(self.path) <= limit else None

    def closing(self, matcher: llguidance.LLMatcher, room: int) -> Optional[list[int]]:
        """None while the model may choose freely at a front with `room` positions left (this one
        included); else the completion's tokens (empty: the document may end here)."""
        if matcher.is_accepting() and room <= CLOSE_MARGIN:
            return []
        path = self.completion(matcher, room)
        if path is None:  # no completion fits: the mask alone decides (never EOS)
            return None
        return path if len(path) + CLOSE_MARGIN >= room else None

    def check(self, matcher: llguidance.LLMatcher, room: int, words: np.ndarray) -> None:
        """Near the end (the completion within CHECK_ZONE of `room`), clear from the mask `words`
        each token after which the completion would no longer fit the room left."""
        path = self.completion(matcher, room)
        if path is None or len(path) + CHECK_ZONE < room:
            return
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:self.t.vocab].view(bool)
        ids = np.flatnonzero(bits & self.t.quoting) if self.scan.in_value_string else np.flatnonzero(bits)
        checks = 0
        for t in map(int, ids):
            if t == self.t.eos or (path and t == path[0]):
                continue
            fits = False
            if checks < MAX_CHECKS:
                checks += 1
                m, scan = matcher.deep_copy(), self.scan.copy()
                if m.consume_token(t):
                    scan.feed(self.t.bytes[t])
                    fits = shortest(self.t, m, scan, room - 1, self._scratch) is not None
            if not fits:
                words[t >> 5] &= ~np.uint32(1 << (t & 31))


def shortest(tokens: Tokens, m: llguidance.LLMatcher, scan: Scan, limit: int,
             scratch: np.ndarray) -> Optional[list[int]]:
    """A short completion of m's state (m is left as it was): `_greedy` with a format's separators
    tried early inside strings, else (it found none within `limit`: a cycle such as
    'aa@aa@aa...') without them, else digits first (a pattern of digits that letters never reach)."""
    for order in (tokens.separated, tokens.inside, tokens.numeric):
        path = _greedy(tokens, m.deep_copy(), scan.copy(), limit, scratch, order)
        if path is not None:
            return path
    return None


def _greedy(tokens: Tokens, m: llguidance.LLMatcher, scan: Scan, limit: int,
            scratch: np.ndarray, inside: list[int]) -> Optional[list[int]]:
    """A short completion of m's state (m is consumed): greedily the first single-byte token in
    the scan's byte order that the grammar allows (a token repeating itself, or a run of digits
    inside a string, tried last: '57.000...' would go on forever), else the lowest allowed token;
    None if it needs more than `limit` tokens or none is found."""
    out: list[int] = []
    while not m.is_accepting():
        if len(out) >= limit:
            return None
        if not scan.string:
            order = tokens.outside
        elif scan.length >= 3 and scan.since >= 2:
            order = inside
        else:  # a part just began: separators last
            order = [t for t in inside if t not in tokens.separators] + [t for t in inside if t in tokens.separators]
        later = _repeating(tokens, out) if scan.string else set()
        t = next((t for t in order if t not in later and m.validate_tokens([t])), None)
        if t is None:
            t = next((t for t in order if t in later and m.validate_tokens([t])), None)
        if t is None:
            t = _lowest(m, tokens.eos, scratch)
        if t is None or not m.consume_token(t):
            return None
        out.append(t)
        scan.feed(tokens.bytes[t])
    return out


def _repeating(tokens: Tokens, out: list[int]) -> set[int]:
    """Tokens to try last: a run of 3 digits, or of one token."""
    tail = out[-3:]
    if len(tail) < 3:
        return set()
    if all(t in tokens.digits for t in tail):
        return tokens.digits
    return {tail[0]} if len(set(tail)) == 1 else set()


def _lowest(m: llguidance.LLMatcher, eos: int, w: np.ndarray) -> Optional[int]:
    """The lowest allowed token id that is not EOS (one mask), None if none."""
    m.unsafe_compute_mask_ptr(w.ctypes.data, w.nbytes)
    w[eos >> 5] &= ~np.uint32(1 << (eos & 31))
    nz = np.flatnonzero(w)
    if not nz.size:
        return None
    word = int(w[nz[0]])
    return int(nz[0]) * 32 + (word & -word).bit_length() - 1
