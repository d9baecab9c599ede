"""The shortest way to a document's end, in tokens (the whole-document path's closing, document.py).

A document grammar's state (an llguidance matcher after some tokens) is completed in two passes:
first as bytes, one single-byte token at a time (`_bytes`: outside strings greedily, the first
byte the grammar allows in a context-aware order: close what is open, separators, the shortest
values; inside a string `"` first, and where a string does not close within STRING_GREEDY bytes
(a pattern or format the greedy order cycles in: 'aa@aa@...') a breadth-first search over the
matcher's states for the fewest bytes that end it), then as tokens: the fewest tokens that spell
those bytes (`segment`, a dynamic program over the vocabulary; llguidance is byte-level, so any
spelling of an allowed byte string is allowed: the matcher checks it anyway). The canvas counts
tokens, so a document's length is its token count, not its bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import llguidance
import numpy as np

from celeris.engine.structured.scan import Scan, Tokens  # noqa: F401 (re-exported)

MAX_SHORTEST = 16384  # bytes the shortest document is looked for within at compile (past that: refused)
# Matcher operations (a mask, a token validated, a state copied) one search may spend: a budget in
# work, not seconds, so a schema's verdict does not depend on the machine's load. At compile a
# search past it refuses the schema (a hostile schema took 141 s of one core before); during
# decoding a search past its budget counts as none found: for a token tried at a front
# (TOKEN_FUEL, at most document.FULL_CHECKS a step) that leaves it out of the step's mask; for
# the front's own completion (STEP_FUEL; a committed token brings its completion, so rarely
# searched) the mask alone decides that step. ~3.7 us an operation on a 2-core AVX2 VM: at most
# ~1.5 s a schema at compile, ~0.2 s a step.
COMPILE_FUEL = 400_000
STEP_FUEL = 20_000
TOKEN_FUEL = 5_000
STRING_GREEDY = 48  # bytes a string may take greedily before its end is searched for breadth first
STRING_DEPTH = 96  # bytes that search goes to
STRING_WIDTH = 32  # matcher states it keeps a byte (distinct by the bytes they allow)
MASK_VOCAB = 16384  # vocabularies up to this size: a mask is cheaper than validating each byte (_classes)


@dataclass(frozen=True)
class Hints:
    """What a schema suggests the search try (examples.hints builds it; the matcher checks every
    try, so a wrong hint costs one validation, never a wrong document).
    `strings`: string contents worth trying where a string does not end greedily (its patterns'
    examples), shortest first. `keys`: the property names some object of the schema requires, as
    JSON string contents in bytes order, each with its rank (lower is tried first: never optional
    anywhere, then shorter). At a key's first byte the search writes the best-ranked one the grammar
    takes there: llguidance keeps a schema's property order, so the keys allowed before an
    object's next required key are its optional ones, which the greedy byte order would write (an
    optional key first in the alphabet, a recursive one forever)."""
    strings: tuple[bytes, ...] = ()
    keys: tuple[tuple[bytes, tuple[bool, int]], ...] = ()


NO_HINTS = Hints()


class OutOfFuel(Exception):
    """A completion search spent its budget of matcher operations (COMPILE_FUEL, STEP_FUEL)."""


class LibraryStopped(Exception):
    """The matcher itself stopped on the grammar (one of llguidance's parser limits, e.g. more
    items in a row than it keeps): no completion was found because none could be searched."""


class Fuel:
    __slots__ = ("left",)

    def __init__(self, budget: int):
        self.left = budget

    def spend(self, n: int = 1) -> None:
        self.left -= n
        if self.left < 0:
            raise OutOfFuel


def shortest(tokens: Tokens, m: llguidance.LLMatcher, scan: Scan, limit: int, scratch: np.ndarray,
             max_bytes: int = MAX_SHORTEST, fuel: int = STEP_FUEL, hints: Hints = NO_HINTS
             ) -> Optional[list[int]]:
    """The fewest tokens found that take m's state to the document's end (m is left as it was),
    or None if none within `limit` tokens (or `max_bytes` bytes) is found. OutOfFuel if the
    search takes more than `fuel` matcher operations, LibraryStopped if the matcher stops on an
    error of its own (a parser limit). `hints`: what the schema suggests trying
    (Hints); where the search with its keys finds nothing, it is tried once more without them."""
    max_bytes = min(max_bytes, limit * tokens.longest)
    budget = Fuel(fuel)
    for tried in (hints, replace(hints, keys=())) if hints.keys else (hints,):
        for order in (tokens.separated, tokens.inside, tokens.numeric):
            tried_m = m.deep_copy()
            path = _bytes(tokens, tried_m, scan.copy(), max_bytes, scratch, order, budget, tried)
            if path is None and tried_m.is_error():  # the library's own limit, not a missing document
                raise LibraryStopped(tried_m.get_error().strip().split("\n")[0][:200])
            if path is not None:
                best = segment(tokens, m, b"".join(tokens.bytes[t] for t in path)) or path
                return best if len(best) <= limit else None
    return None


def segment(tokens: Tokens, m: Optional[llguidance.LLMatcher], data: bytes) -> Optional[list[int]]:
    """The fewest tokens that spell `data` (a dynamic program over its prefixes), if m's state
    takes them all and accepts after them (m None: not checked); else None."""
    n, inf = len(data), 1 << 30
    best, back = [0] + [inf] * n, [0] * (n + 1)
    for i in range(1, n + 1):
        for k in range(max(0, i - tokens.longest), i):
            if best[k] + 1 < best[i] and data[k:i] in tokens.spell:
                best[i], back[i] = best[k] + 1, k
    if best[n] >= inf:
        return None
    out, i = [], n
    while i:
        out.append(tokens.spell[data[back[i]:i]])
        i = back[i]
    out.reverse()
    return out if m is None or accepts(m, out, tokens.eos) else None


def accepts(m: llguidance.LLMatcher, path: list[int], eos: int) -> bool:
    """Whether m's state takes every token of `path` and then accepts (m is left as it was): the
    stop token `eos` is committable after them, which llguidance allows exactly in an accepting
    state. One validation, no copy of the matcher and no consuming: the closer's checks ask this
    of most allowed tokens at every front, and consuming a copy cost 15x more. An empty path asks
    the state itself: validating the stop token alone was refused in 6 of 97k accepting states
    met in decoding. Where that happens after a path the answer is a safe "no" (the closer then
    searches or leaves the token out), never a false "yes"; none was met over 184k paths."""
    if not path:
        return m.is_accepting()
    return m.validate_tokens([*path, eos]) == len(path) + 1


def _bytes(tokens: Tokens, m: llguidance.LLMatcher, scan: Scan, limit: int, scratch: np.ndarray,
           inside: list[int], fuel: Fuel, hints: Hints = NO_HINTS) -> Optional[list[int]]:
    """A short completion of m's state as single-byte tokens (m is consumed): greedily the first
    token in the scan's byte order that the grammar allows (a token repeating itself, or a run of
    digits inside a string, tried last: '57.000...' would go on forever), else the lowest allowed
    token; at a key's first byte the best-ranked required key the grammar takes (`_key`) instead;
    a string still open after STRING_GREEDY bytes is ended by `_string_end` from where it began
    instead (one of the hints' strings first). None if it needs more than `limit` bytes or none is
    found."""
    out: list[int] = []
    opened: Optional[tuple[llguidance.LLMatcher, Scan, int]] = None  # at the open string's first byte
    while not m.is_accepting():
        if len(out) >= limit:
            return None
        if hints.keys and scan.key and scan.string and scan.length == 0:
            key = _key(tokens, m, hints.keys, fuel)
            if key is not None and m.consume_tokens(key):
                out += key
                scan.feed(b"".join(tokens.bytes[t] for t in key))
                continue
        if scan.string and opened is None:
            opened = (m.deep_copy(), scan.copy(), len(out))
        elif not scan.string:
            opened = None
        if opened is not None and len(out) - opened[2] == STRING_GREEDY:
            end = _hinted_end(tokens, opened[0], opened[1], hints.strings, fuel) or _string_end(
                tokens, opened[0], opened[1], scratch, fuel)
            if end is not None:  # the greedy bytes of this string are replaced by the fewest found
                m, scan, out, opened = end[0], end[1], out[:opened[2]] + end[2], None
                continue
        t = _next_byte(tokens, m, scan, out, inside, scratch, fuel)
        if t is None or not m.consume_token(t):
            return None
        out.append(t)
        scan.feed(tokens.bytes[t])
    return out


def _next_byte(tokens: Tokens, m: llguidance.LLMatcher, scan: Scan, out: list[int], inside: list[int],
               scratch: np.ndarray, fuel: Fuel) -> Optional[int]:
    fuel.spend()
    if not scan.string:
        order = tokens.outside
    elif scan.length >= 3 and scan.since >= 2:
        order = inside
    else:  # a part just began: separators last
        order = [t for t in inside if t not in tokens.separators] + [t for t in inside if t in tokens.separators]
    later = _repeating(tokens, out) if scan.string else set()
    t = next((t for t in order if t not in later and _valid(m, t, fuel)), None)
    if t is None:
        t = next((t for t in order if t in later and _valid(m, t, fuel)), None)
    return _lowest(m, tokens.eos, scratch) if t is None else t


def _key(tokens: Tokens, m: llguidance.LLMatcher, keys: tuple[tuple[bytes, tuple[bool, int]], ...], fuel: Fuel
         ) -> Optional[list[int]]:
    """At a key's first byte: the best-ranked of `keys` (Hints.keys) that the grammar takes here
    with its closing quote, as single-byte tokens, or None. The names are in bytes order, so one
    refused at its n-th byte rules out the names after it that share its first n + 1 bytes: about
    one validation for each byte the grammar refuses, not one a name."""
    best: Optional[list[int]] = None
    best_rank: Optional[tuple[bool, int]] = None
    dead: Optional[bytes] = None  # the prefix of the last refused name, up to its refused byte
    for name, rank in keys:
        if dead is not None and name.startswith(dead):
            continue
        if best_rank is not None and rank >= best_rank:
            continue
        path = _closed(tokens, name)
        if path is None:
            continue
        n = m.validate_tokens(path)
        fuel.spend(n + 1)
        if n == len(path):
            best, best_rank = path, rank
        else:  # refused at byte n; at the quote (n == len(name)) only this name is ruled out: `id`, not `identifier`
            dead = (name + b'"')[:n + 1]
    return best


def _closed(tokens: Tokens, contents: bytes) -> Optional[list[int]]:
    """A string's contents and its closing quote as single-byte tokens, or None where a byte has
    no token of its own."""
    path = [tokens.spell.get(contents[i:i + 1]) for i in range(len(contents))] + [tokens.spell.get(b'"')]
    return None if None in path else path


def _valid(m: llguidance.LLMatcher, t: int, fuel: Fuel) -> bool:
    fuel.spend()
    return bool(m.validate_tokens([t]))


def _hinted_end(tokens: Tokens, m: llguidance.LLMatcher, scan: Scan, hints: tuple[bytes, ...], fuel: Fuel
                ) -> Optional[tuple[llguidance.LLMatcher, Scan, list[int]]]:
    """The first hint (shortest first) that, with the closing quote, ends the string open in m's
    state, as single-byte tokens (m is left as it was): (the matcher and scan after them, the
    tokens), or None."""
    for hint in hints:
        path = _closed(tokens, hint)
        if path is None:
            continue
        fuel.spend(len(path))
        if m.validate_tokens(path) != len(path):
            continue
        c, s = m.deep_copy(), scan.copy()
        s.feed(hint + b'"')
        if c.consume_tokens(path) and not s.string:
            return c, s, path
    return None


def _string_end(tokens: Tokens, m: llguidance.LLMatcher, scan: Scan, scratch: np.ndarray, fuel: Fuel
                ) -> Optional[tuple[llguidance.LLMatcher, Scan, list[int]]]:
    """The fewest single-byte tokens found that end the string open in m's state (m is left as it
    was): breadth first over the matcher's states, at most STRING_WIDTH a byte (states that allow
    the same bytes at the same depth counted once), at most STRING_DEPTH bytes. -> (the matcher
    and scan after them, the tokens), or None."""
    level = [(m.deep_copy(), scan, [])]
    for _ in range(STRING_DEPTH):
        seen, nxt = set(), []
        for mm, sc, path in level:
            key, allowed = _classes(tokens, mm, scratch, fuel)
            if key in seen:
                continue
            seen.add(key)
            for t in allowed:
                fuel.spend()
                c, s = mm.deep_copy(), sc.copy()
                if not c.consume_token(t):
                    continue
                s.feed(tokens.bytes[t])
                if not s.string:
                    return c, s, path + [t]
                nxt.append((c, s, path + [t]))
            if len(seen) >= STRING_WIDTH:
                break
        if not nxt:
            return None
        level = nxt
    return None


def _classes(tokens: Tokens, m: llguidance.LLMatcher, scratch: np.ndarray, fuel: Fuel) -> tuple[object, list[int]]:
    """The single-byte tokens m's state allows inside a string, one of each class (`"` first; one
    letter of each case and one digit stand for the rest; any other byte is its own class), and
    a key that tells states apart. On a small vocabulary one mask (the key: the mask); past
    MASK_VOCAB a mask walks the whole vocabulary (~4 ms at 126k tokens against ~2 us a
    validation), so each class is validated token by token instead (the key: the tokens found)."""
    out, classes = [], set()
    if tokens.vocab <= MASK_VOCAB:
        fuel.spend()
        m.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
        key: object = scratch.tobytes()
        bits = np.unpackbits(scratch.view(np.uint8), bitorder="little")[:tokens.vocab].view(bool)
        ok = set(np.flatnonzero(bits & tokens.single).tolist())
        for t in tokens.inside:
            if t in ok and tokens.kind[t] not in classes:
                classes.add(tokens.kind[t])
                out.append(t)
        return key, out
    for t in tokens.inside:
        if tokens.kind[t] in classes:
            continue
        fuel.spend()
        if m.validate_tokens([t]):
            classes.add(tokens.kind[t])
            out.append(t)
    return tuple(out), out


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
