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

# Overrides (applied after the schema's own x-guidance): nothing a client sends relaxes these.
OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":", "lenient": False,
           "coerce_one_of": False}
_QUOTED = re.compile(r'"([^"]{1,100})"')
# Schema keywords whose string value an error may quote (an unknown format, a bad pattern, a $ref).
_VALUE_KEYS = ("format", "pattern", "$ref", "$dynamicRef", "type")


def document_grammar(schema: object) -> str:
    """llguidance's grammar of the whole document (not yet validated); ValueError if the
    library cannot read the schema at all (e.g. not an object)."""
    if schema is True:  # JSON Schema's `true`: any document
        schema = {}
    if not isinstance(schema, dict):  # `false` (no document) included
        raise ValueError("must be an object (a schema)")
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=OPTIONS)


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


CLOSE_MARGIN = 24  # positions kept in hand beyond the shortest completion before closing the document
# Bytes tried in order when writing a short completion: closers, then separators (a number or a
# member ends, the next required one starts: digits first would extend a number forever), then
# the shortest values.
_PRIORITY = b'"}],:0123456789nultrefas-.{[' + bytes(range(0x61, 0x7b)) + bytes(range(0x41, 0x5b)) + \
    bytes(b for b in range(0x20, 0x7f) if not chr(b).isalnum())


class Closer:
    """How a document ends before the canvas does. Each step, the document slot's front asks for
    a short completion of the matcher's state: greedily, the first byte (in `_PRIORITY`) the
    grammar allows, until it accepts (a copy of the matcher; one mask a byte). While that
    completion plus CLOSE_MARGIN fits the positions left, the model chooses freely; after, only
    the completion's next byte is allowed, so the document ends inside the canvas. A single token
    that needs more than CLOSE_MARGIN more positions (an optional key longer than that, chosen
    just before) can still leave it unfinished: finish_reason "length" (docs/structured-outputs.md)."""

    def __init__(self, ll: llguidance.LLTokenizer, words: int, eos: int):
        self.words, self.eos = words, eos
        self.byte_token: list[int] = []  # (byte's token id) in _PRIORITY order, for bytes that are one token
        self.digits: set[int] = set()
        for b in dict.fromkeys(_PRIORITY):
            ids = ll.tokenize_bytes(bytes([b]))
            if len(ids) == 1:
                self.byte_token.append(ids[0])
                if 48 <= b <= 57:
                    self.digits.add(ids[0])
        self._scratch = np.zeros(words, dtype=np.uint32)

    def closing(self, matcher: llguidance.LLMatcher, room: int) -> Optional[list[int]]:
        """None while the model may choose freely at a front with `room` positions left (this one
        included); else the completion's tokens (empty: the document may end here)."""
        if matcher.is_accepting() and room <= CLOSE_MARGIN:
            return []
        m, out = matcher.deep_copy(), []
        while not m.is_accepting() and len(out) < room:
            t = self._next(m, self._repeating(out))
            if t is None or not m.consume_token(t):
                break
            out.append(t)
        if not out and not m.is_accepting():  # no completion found: the mask alone decides (never EOS)
            return None
        return out if len(out) + CLOSE_MARGIN >= room else None

    def _repeating(self, out: list[int]) -> set[int]:
        """Tokens to try last: a run of 3 digits, or of one token, would go on forever where the
        grammar allows it (a date-time's fraction digits: '57.000...')."""
        tail = out[-3:]
        if len(tail) < 3:
            return set()
        if all(t in self.digits for t in tail):
            return self.digits
        return {tail[0]} if len(set(tail)) == 1 else set()

    def _next(self, m: llguidance.LLMatcher, later: set[int]) -> Optional[int]:
        """The completion's next token: the first single-byte token in `_PRIORITY` the grammar
        allows (those in `later` last), else the lowest allowed token id that is not EOS; None
        if none is allowed."""
        w = self._scratch
        m.unsafe_compute_mask_ptr(w.ctypes.data, w.nbytes)
        w[self.eos >> 5] &= ~np.uint32(1 << (self.eos & 31))
        order = [t for t in self.byte_token if t not in later] + [t for t in self.byte_token if t in later]
        t = next((t for t in order if w[t >> 5] >> (t & 31) & 1), None)
        if t is None and (nz := np.flatnonzero(w)).size:
            word = int(w[nz[0]])
            t = int(nz[0]) * 32 + (word & -word).bit_length() - 1
        return t
