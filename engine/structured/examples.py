"""What a schema suggests the closing's search try (completion.Hints): short strings its
`pattern`s match, for ending a string, and the property names its objects require, for keys.

The completion search ends an open string breadth first over the grammar's states, letting one
letter of each case and one digit stand for the rest; a pattern that needs particular bytes
(`\\.png$`, `1.2`, `^(wifi|ethernet)$`) is never ended that way. Each pattern in the schema is
read here (Python's regex parser: JSON Schema's ECMA-262 patterns are, for what matters here,
its syntax) into the shortest string it matches, lengthened through its repeats (or, where it is
not anchored, padded) to the `minLength` beside it. They are only hints: the search tries each
from where the string began and keeps it only if the grammar's matcher takes its bytes and the
closing quote, so a wrong guess (a lookahead, a flag) costs one try, never a wrong document.

The keys are every name some object lists in `required` (the first MAX_KEYS met), ranked: names
never listed as optional anywhere first, then shorter. The search takes, at a key's first byte,
the best-ranked one the grammar allows there. Since llguidance keeps the schema's property order,
what it allows there is the object's next required key and the optional keys listed before it;
an optional key is a candidate only if another object requires it, and then it ranks as optional.
A wrong pick (the next required key is optional elsewhere, and a shorter one is too) only makes
the document longer: the matcher checks every byte.
"""

from __future__ import annotations

import json
import re
import warnings
from itertools import islice
from typing import Iterator, Optional

from celeris.engine.structured.completion import Hints
from celeris.engine.structured.document import walk

try:  # Python 3.11+: the regex parser's modules (private, stable since 2.x under sre_* names)
    import re._constants as C  # noqa: N812 (the parser's opcode names)
    import re._parser as sre
except ImportError:  # pragma: no cover (3.10)
    import sre_constants as C  # noqa: N812
    import sre_parse as sre

MAX_PATTERNS = 64  # patterns read per schema (the first ones met)
MAX_KEYS = 512  # required property names read per schema (the first ones met)
MAX_EXAMPLE = 256  # characters: a longer example is no hint
_PICK = "a0A_-. "  # the first of these a negated class allows stands for it
_CATEGORY = {C.CATEGORY_DIGIT: "0", C.CATEGORY_NOT_DIGIT: "a", C.CATEGORY_WORD: "a", C.CATEGORY_NOT_WORD: "-",
             C.CATEGORY_SPACE: " ", C.CATEGORY_NOT_SPACE: "a"}


_ATOMIC = getattr(C, "ATOMIC_GROUP", None)  # (?>...), 3.11+
_REPEATS = tuple(getattr(C, name) for name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT") if hasattr(C, name))


class _Unsupported(Exception):
    pass


def hints(schema: object) -> Hints:
    """The schema's hints (module docstring): `strings`, a short example of each `pattern`,
    shortest first, each once; `keys`, the required property names with their ranks, in bytes
    order. Both as JSON string contents (UTF-8, escaped as JSON writes them, without quotes)."""
    out: dict[bytes, None] = {}
    for node in _patterns(schema):
        text = example(node["pattern"], _int(node.get("minLength"), 0), _int(node.get("maxLength"), MAX_EXAMPLE))
        if text is not None:
            out.setdefault(_contents(text))
    return Hints(tuple(sorted(out, key=len)), required_keys(schema))


def required_keys(schema: object) -> tuple[tuple[bytes, tuple[bool, int]], ...]:
    """(name, rank) of each property name some object of the schema requires, in bytes order; the
    rank is (whether some object lists it as optional, its length in characters)."""
    required: dict[str, None] = {}
    optional: set[str] = set()
    for _, node in walk(schema, ""):
        props, listed = node.get("properties"), node.get("required")
        if not isinstance(props, dict):
            continue
        must = {k for k in listed if isinstance(k, str)} if isinstance(listed, list) else set()
        for name in props:
            if name in must:
                if len(required) < MAX_KEYS:
                    required.setdefault(name, None)
            else:
                optional.add(name)
    return tuple(sorted((_contents(k), (k in optional, len(k))) for k in required))


def _contents(text: str) -> bytes:
    """A JSON string's contents as compact JSON writes them (UTF-8, without its quotes)."""
    return json.dumps(text, ensure_ascii=False)[1:-1].encode("utf-8", "surrogatepass")


def example(pattern: str, min_len: int = 0, max_len: int = MAX_EXAMPLE) -> Optional[str]:
    """A short string `pattern` matches (searched, as JSON Schema's patterns are) of min_len to
    max_len characters, or None where this reader cannot tell one."""
    try:
        with warnings.catch_warnings():  # Python's FutureWarnings about its own future syntax ('[[')
            warnings.simplefilter("ignore")
            parsed = sre.parse(pattern)
    except (re.error, RecursionError, OverflowError, ValueError):
        return None
    try:
        text = _Writer().write(parsed, need=0)
        if len(text) < min_len:  # lengthen through the repeats, then pad where the pattern is not anchored
            text = _Writer().write(parsed, need=min_len - len(text))
        if len(text) < min_len:
            ops = [op for op, _ in parsed]
            end_anchored = bool(ops) and ops[-1] is C.AT
            start_anchored = bool(ops) and ops[0] is C.AT
            if not end_anchored:
                text += "a" * (min_len - len(text))
            elif not start_anchored:
                text = "a" * (min_len - len(text)) + text
    except (_Unsupported, RecursionError):
        return None
    return text if min_len <= len(text) <= min(max_len, MAX_EXAMPLE) else None


class _Writer:
    """The shortest string of a parsed pattern; `need` extra characters go into the first repeats
    with room for them."""

    def __init__(self):
        self.groups: dict[int, str] = {}

    def write(self, parsed, need: int) -> str:
        self.need = need
        return self._seq(parsed)

    def _seq(self, items) -> str:
        return "".join(self._one(op, av) for op, av in items)

    def _one(self, op, av) -> str:
        if op is C.LITERAL:
            return chr(av)
        if op is C.NOT_LITERAL:
            return "a" if av != ord("a") else "b"
        if op is C.ANY:
            return "a"
        if op is C.IN:
            return _member(av)
        if op in (C.AT, C.ASSERT, C.ASSERT_NOT):
            return ""  # anchors and lookarounds: the matcher decides
        if op is C.BRANCH:
            return min((self._seq(alt) for alt in av[1]), key=len)
        if op is C.SUBPATTERN:
            group, _, _, body = av
            text = self._seq(body)
            if group is not None:
                self.groups[group] = text
            return text
        if op is _ATOMIC:
            return self._seq(av)
        if op in _REPEATS:
            lo, hi, body = av
            unit = self._seq(body)
            count = lo
            if self.need > 0 and unit and hi > lo:
                more = min(hi - lo, -(-self.need // len(unit)))
                count, self.need = lo + more, self.need - more * len(unit)
            if count * len(unit) > MAX_EXAMPLE:
                raise _Unsupported
            return unit * count
        if op is C.GROUPREF:
            return self.groups.get(av, "")
        raise _Unsupported(op)


def _member(items) -> str:
    """A character of a class ([...], \\d, \\w): its first member, or for a negated class the
    first of _PICK it leaves out."""
    if items and items[0][0] is C.NEGATE:
        pick = next((ch for ch in _PICK if not _in(ord(ch), items[1:])), None)
        if pick is None:
            raise _Unsupported("negated class")
        return pick
    for op, av in items:
        if op is C.LITERAL:
            return chr(av)
        if op is C.RANGE:
            return chr(av[0])
        if op is C.CATEGORY and av in _CATEGORY:
            return _CATEGORY[av]
    raise _Unsupported("class")


def _in(code: int, items) -> bool:
    """Whether a character is in a class's (not negated) items."""
    for op, av in items:
        if op is C.LITERAL and av == code or op is C.RANGE and av[0] <= code <= av[1]:
            return True
        if op is C.CATEGORY:
            ch = chr(code)
            hit = {C.CATEGORY_DIGIT: ch.isdigit(), C.CATEGORY_NOT_DIGIT: not ch.isdigit(),
                   C.CATEGORY_WORD: ch.isalnum() or ch == "_", C.CATEGORY_NOT_WORD: not (ch.isalnum() or ch == "_"),
                   C.CATEGORY_SPACE: ch.isspace(), C.CATEGORY_NOT_SPACE: not ch.isspace()}.get(av, True)
            if hit:
                return True
    return False


def _patterns(schema: object) -> Iterator[dict]:
    """The dicts holding a string `pattern` (the first MAX_PATTERNS met)."""
    return islice((d for _, d in walk(schema, "") if isinstance(d.get("pattern"), str)), MAX_PATTERNS)


def _int(v: object, default: int) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else default
