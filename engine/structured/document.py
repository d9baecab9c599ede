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

from celeris.engine.structured.completion import (  # noqa: F401 (MAX_SHORTEST: re-exported)
    MAX_SHORTEST, NO_HINTS, TOKEN_FUEL, Hints, OutOfFuel, Scan, Tokens, accepts, segment, shortest)
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


def walk(schema: object, root: str) -> Iterator[tuple[str, dict]]:
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
        for path, d in walk(schema, root):
            hit = next((k for k in names if k in d), None)
            if hit is not None:
                return f"{path}.{hit}"
    best: Optional[tuple[int, str]] = None
    for path, d in walk(schema, root):
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
TEXT_ZONE = 64  # within this many positions of the completion, plain string text is checked token by token
MAX_TEXT_CHECKS = 256  # such tokens checked a step; past that they are left out (it is closing time)
PROBES = 3  # plain text tokens checked each step farther from the end (one failing: all are checked)
FULL_CHECKS = 8  # tokens a step whose completion is searched anew (shortest bytes first); past that left out


class Closer:
    """How a document ends before the canvas does (one per forced slot of a request).

    It keeps a completion of the matcher's state: the fewest tokens found to the document's end
    (completion.shortest). The invariant: at every front, the completion fits the positions left.
    It holds at the first front (Compiler refuses a schema whose shortest document does not fit
    max_tokens) and each step keeps it: the mask keeps only tokens after which some completion
    still fits the room left (`check`), wherever the front is, and the completion found for each
    kept token is remembered, so the one committed brings its completion with it (nothing is
    recomputed). A token is kept when, after it, the current completion still ends the document
    (`[t] + completion` validates: plain text inside a string, a digit), or the completion's bytes
    go on from its bytes (a longer token along the same text), else when a new shortest
    completion from after it fits (at most FULL_CHECKS such searches a step, the shortest tokens
first; a token past them is left out). Plain text inside a string (no quote, no backslash: it can end
    nothing) is the one class not checked token by token farther than TEXT_ZONE from the end:
    there PROBES of them are checked each step, and if one fails (the text decides the rest, e.g.
    an anyOf branch), all of them are, as near the end. When the completion plus CLOSE_MARGIN
    reaches the room left, only its next token is allowed."""

    def __init__(self, tokens: Tokens, words: int, hints: Hints = NO_HINTS):
        self.t, self.hints = tokens, hints  # examples.hints of the schema: strings and keys worth trying
        self.scan = Scan()
        self.path: Optional[list[int]] = None  # the completion of the matcher's current state, if known
        self._after: dict[int, list[int]] = {}  # the completion after each token the last check kept
        self._searches = 0  # new completions searched for in this step's check
        self._unsure = False  # whether `path` is yet to be verified (kept across unchecked plain text)
        self._scratch = np.zeros(words, dtype=np.uint32)

    def consumed(self, tokens: list[int]) -> None:
        """The slot's matcher consumed these tokens (committed or fast-forwarded)."""
        for t in tokens:
            text = self.scan.string and not self.t.quoting[t]
            self.scan.feed(self.t.bytes[t])
            if self.path and self.path[0] == t:
                self.path = self.path[1:]
            elif t in self._after:
                self.path = self._after[t]
            else:  # plain text a check let through unchecked: the completion likely still holds (verified on use)
                self.path, self._unsure = (self.path, True) if text and self.path is not None else (None, False)
            self._after = {}

    def spelled(self, ff: list[int]) -> list[int]:
        """The forced tokens `ff` (llguidance's fast-forward) as the completion spells their bytes,
        where its whole tokens do: the invariant counts the completion's tokens, and llguidance's
        own spelling of a forced key can take more of them (a vocabulary with short tokens its
        tokenizer never produces), which would leave the rest of the completion no room. Else (no
        completion known, or one that spells them alike or not along the same bytes) ff as it is."""
        path = self.path
        if not path or path[:len(ff)] == ff:
            return ff
        data = b"".join(self.t.bytes[t] for t in ff)
        got, k = b"", 0
        while k < len(path) and len(got) + len(self.t.bytes[path[k]]) <= len(data):
            got, k = got + self.t.bytes[path[k]], k + 1
        return path[:k] if k and data.startswith(got) else ff

    def completion(self, matcher: llguidance.LLMatcher, limit: int) -> Optional[list[int]]:
        """The completion of the matcher's state (remembered until a token leaves it), or None if
        it needs more than `limit` tokens."""
        if self._unsure and self.path is not None and not accepts(matcher, self.path, self.t.eos):
            self.path = None
        self._unsure = False
        if self.path is None:
            self.path = _searched(lambda: shortest(self.t, matcher, self.scan, limit, self._scratch, hints=self.hints))
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
        """Clear from the mask `words` each token after which no completion is known to fit the
        room left (room - 1 positions after this one)."""
        path = self.completion(matcher, room)
        self._after, self._searches = {}, 0
        if path is None:  # nothing known fits (a state no check led to): the mask alone decides
            return
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:self.t.vocab].view(bool)
        ids = np.flatnonzero(bits)
        if self.scan.string:  # plain text first in line for the probes and the budget
            text = ids[~self.t.quoting[ids]]
            others = ids[self.t.quoting[ids]]
        else:
            text, others = ids[:0], ids
        for t in sorted(map(int, others), key=lambda x: len(self.t.bytes[x])):
            self._keep_or_clear(matcher, path, t, room, words)
        if not text.size:
            return
        probes = text[np.linspace(0, text.size - 1, min(PROBES, text.size)).astype(int)]
        if len(path) + TEXT_ZONE < room and all(self._fits(matcher, path, int(t), room) for t in probes):
            return  # far from the end and the text decides nothing seen: plain text stays
        for t in map(int, text[:MAX_TEXT_CHECKS]):
            self._keep_or_clear(matcher, path, t, room, words)
        if text.size > MAX_TEXT_CHECKS:  # the rest left out at once (hundreds near the end)
            rest = text[MAX_TEXT_CHECKS:].astype(np.int64)
            np.bitwise_and.at(words, rest >> 5, ~np.left_shift(np.uint32(1), (rest & 31).astype(np.uint32)))

    def _keep_or_clear(self, matcher: llguidance.LLMatcher, path: list[int], t: int, room: int,
                       words: np.ndarray) -> None:
        if not self._fits(matcher, path, t, room):
            self._clear(words, t)

    @staticmethod
    def _clear(words: np.ndarray, t: int) -> None:
        words[t >> 5] &= ~np.uint32(1 << (t & 31))

    def _fits(self, matcher: llguidance.LLMatcher, path: list[int], t: int, room: int) -> bool:
        """Whether some completion of at most room - 1 tokens is known after token t (remembered
        in _after for `consumed`)."""
        if t == self.t.eos or (path and t == path[0]):
            return True
        after = self._after_token(matcher, path, t, room - 1)
        if after is None or len(after) > room - 1:
            return False
        self._after[t] = after
        return True

    def _after_token(self, matcher: llguidance.LLMatcher, path: list[int], t: int, limit: int
                     ) -> Optional[list[int]]:
        """A completion after token t: the current one if it still ends the document after t, the
        rest of its bytes if they go on from t's, else a new shortest one (within `limit`)."""
        if len(path) <= limit and accepts(matcher, [t] + path, self.t.eos):
            return path
        m = matcher.deep_copy()
        if not m.consume_token(t):
            return None
        tb, got, k = self.t.bytes[t], b"", 0
        while k < len(path) and len(got) < len(tb):  # the completion's tokens that t's bytes reach into
            got, k = got + self.t.bytes[path[k]], k + 1
        if got.startswith(tb) and (len(got) > len(tb) or k < len(path)):
            head = segment(self.t, None, got[len(tb):]) if len(got) > len(tb) else []
            rest = None if head is None else head + path[k:]
            if rest is not None and len(rest) <= limit and accepts(m, rest, self.t.eos):
                return rest
        if self._searches >= FULL_CHECKS:
            return None
        self._searches += 1
        scan = self.scan.copy()
        scan.feed(tb)
        return _searched(lambda: shortest(self.t, m, scan, limit, self._scratch, max_bytes=2 * limit + 32,
                                          fuel=TOKEN_FUEL, hints=self.hints))


def _searched(search) -> Optional[list[int]]:
    """A completion search during decoding; past its budget it counts as
    none found (completion.STEP_FUEL, TOKEN_FUEL)."""
    try:
        return search()
    except OutOfFuel:
        return None
