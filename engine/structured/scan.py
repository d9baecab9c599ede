"""What the completion search (completion.py) reads: a JSON prefix's lexical state and the
tokenizer's bytes.

`Scan` follows a JSON prefix byte by byte (inside a string, a key or a value, or not): only the
completion's byte order depends on it, the grammar decides what is allowed. `Tokens` is built
once per tokenizer: each token's bytes, the single-byte tokens in the completion's byte orders,
the tokens that hold a quote or a backslash, and a table of byte strings to tokens (`segment`).
"""

from __future__ import annotations

import llguidance
import numpy as np

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
    the completion's byte orders, the tokens that hold a quote or a backslash (inside a string
    they end it or start an escape: never plain text) and a table of byte strings to tokens
    (`segment`)."""

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
        self.single = np.zeros(vocab, dtype=bool)
        self.single[list(one.values())] = True
        # A single-byte token's class in the string search: one letter of each case and one digit stand for the rest.
        self.kind = {t: "a" if b.islower() else "A" if b.isupper() else "0" if b.isdigit() else b
                     for t, b in ((t, self.bytes[t]) for t in one.values())}
        special = {eos} | {t for t in range(vocab) if not self.bytes[t]}
        self.spell: dict[bytes, int] = {}
        for t in range(vocab):  # the lowest id of each byte string (special ids never spell text)
            if t not in special:
                self.spell.setdefault(self.bytes[t], t)
        self.longest = max(map(len, self.spell), default=1)
