"""Gemma 4's tool-call value syntax (DiffusionGemma inherits it): JSON-like, but object keys are
bare identifiers and strings are delimited by `<|"|>` on both sides:

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,units:[<|"|>c<|"|>]}<tool_call|>

`dump` writes a value that way, `parse` reads it back (None if it does not parse: never raises),
and `Rules` writes an llguidance lark grammar of the values a JSON schema allows, in this syntax.

What the grammar enforces: the call markers and the function's name; for an object with
`properties`, exactly those keys in the schema's order, each required one present, no others; per
value its type (string, integer, number, boolean, null, array with `items`, nested object), `enum`
and `const` values, `anyOf`/`oneOf` alternatives, `$ref` into `$defs`/`definitions` (recursion
included). Not enforced (the value's type still is): numeric bounds, string lengths, `pattern`,
`format`, array lengths, `allOf`, `additionalProperties` schemas (an object without `properties`
takes any bare keys and values). Strings cannot hold "<" (that is how a string's end is found).
"""

from __future__ import annotations

import json
import re
from typing import Callable, Optional

QUOTE = '<|"|>'
MAX_DEPTH = 32
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_LITERALS = {"true": True, "false": False, "null": None}


def dump(value: object) -> str:
    """A JSON value in Gemma 4's call syntax."""
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{dump(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(dump(v) for v in value) + "]"
    return json.dumps(value)


def parse(text: str) -> Optional[object]:
    """The value `text` writes (all of it), or None where it is not one."""
    try:
        value, end = _value(text.strip(), 0, 0)
    except (ValueError, IndexError, RecursionError):
        return None
    return value if end == len(text.strip()) else None


def _value(s: str, i: int, depth: int) -> tuple[object, int]:
    if depth > MAX_DEPTH:
        raise ValueError("too deep")
    if s.startswith(QUOTE, i):
        end = s.index(QUOTE, i + len(QUOTE))
        return s[i + len(QUOTE):end], end + len(QUOTE)
    if s[i] == "{":
        out, i = {}, i + 1
        while s[i] != "}":
            m = _KEY.match(s, i)
            if not m or s[m.end()] != ":":
                raise ValueError("a key")
            out[m.group()], i = _value(s, m.end() + 1, depth + 1)
            i = _comma(s, i, "}")
        return out, i + 1
    if s[i] == "[":
        items, i = [], i + 1
        while s[i] != "]":
            v, i = _value(s, i, depth + 1)
            items.append(v)
            i = _comma(s, i, "]")
        return items, i + 1
    for word, v in _LITERALS.items():
        if s.startswith(word, i):
            return v, i + len(word)
    m = _NUMBER.match(s, i)
    if not m:
        raise ValueError("a value")
    return json.loads(m.group()), m.end()


def _comma(s: str, i: int, close: str) -> int:
    if s[i] == ",":
        if s[i + 1] == close:
            raise ValueError("a trailing comma")
        return i + 1
    if s[i] != close:
        raise ValueError("a separator")
    return i


def _lit(text: str) -> str:
    return json.dumps(text)


def _base(lit: Callable[[str], str]) -> dict[str, str]:
    """The rules every gemma grammar shares (a string's delimiters written by `lit`)."""
    return {"g_str": f"{lit(QUOTE)} /[^<]*/ {lit(QUOTE)}", **_BASE}


_BASE = {
    "g_int": r'/-?(0|[1-9][0-9]{0,15})/',
    "g_num": r'/-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?([eE][+-]?[0-9]{1,3})?/',
    "g_bool": '"true" | "false"',
    "g_any": 'g_str | g_num | g_bool | "null" | g_obj | g_arr',
    "g_obj": '"{" (g_pair ("," g_pair)*)? "}"',
    "g_pair": '/[A-Za-z_][A-Za-z0-9_]*/ ":" g_any',
    "g_arr": '"[" (g_any ("," g_any)*)? "]"',
}


class Rules:
    """The lark rules of a schema's values in this syntax, named from `prefix`; `value(schema)`
    returns the expression of one value and leaves the rules it needs in `lines`."""

    def __init__(self, root: dict, prefix: str, lit: Callable[[str], str] = _lit):
        self.root, self.prefix, self.lit = root, prefix, lit
        self.lines: list[str] = [f"{k}: {v}" for k, v in _base(lit).items()] if prefix == "t0" else []
        self._n = 0
        self._refs: dict[str, str] = {}

    def _rule(self, body: str) -> str:
        self._n += 1
        name = f"{self.prefix}_{self._n}"
        self.lines.append(f"{name}: {body}")
        return name

    def value(self, schema: object, depth: int = 0) -> str:
        if not isinstance(schema, dict) or depth > MAX_DEPTH:
            return "g_any"
        if "$ref" in schema:
            return self._ref(schema["$ref"], depth)
        for key in ("const", "enum"):
            if key in schema:
                options = [schema[key]] if key == "const" else schema[key]
                if isinstance(options, list) and options:
                    return "(" + " | ".join(self.lit(dump(v)) for v in options) + ")"
        alts = schema.get("anyOf") or schema.get("oneOf")
        if isinstance(alts, list) and alts:
            return "(" + " | ".join(self.value(a, depth + 1) for a in alts) + ")"
        kind = schema.get("type")
        if isinstance(kind, list):
            return "(" + " | ".join(self.value({**schema, "type": k}, depth + 1) for k in kind) + ")"
        if kind == "object" or (kind is None and "properties" in schema):
            return self._object(schema, depth)
        if kind == "array":
            item = self.value(schema.get("items", {}), depth + 1) if isinstance(schema.get("items"), dict) else "g_any"
            return self._rule(f'"[" ({item} ("," {item})*)? "]"')
        return {"string": "g_str", "integer": "g_int", "number": "g_num", "boolean": "g_bool",
                "null": '"null"'}.get(kind, "g_any")

    def _ref(self, ref: object, depth: int) -> str:
        if not isinstance(ref, str) or not ref.startswith("#/"):
            return "g_any"
        if ref in self._refs:
            return self._refs[ref]
        node: object = self.root
        for part in ref[2:].split("/"):
            node = node.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(node, dict) else None
        self._n += 1
        name = f"{self.prefix}_{self._n}"
        self._refs[ref] = name  # named before its body: a recursive $ref refers to itself
        self.lines.append(f"{name}: {self.value(node, depth + 1) if node is not None else 'g_any'}")
        return name

    def _object(self, schema: dict, depth: int) -> str:
        props = schema.get("properties")
        if not isinstance(props, dict) or not props:
            return "g_obj"
        required = set(schema.get("required") or [])
        keys = [k for k in props if _KEY.fullmatch(k)]  # a key the syntax cannot write is left out
        pairs = [f'{self.lit(k + ":")} {self.value(props[k], depth + 1)}' for k in keys]
        memo: dict[tuple[int, bool], Optional[str]] = {}

        def rest(k: int, first: bool) -> Optional[str]:  # keys k.. after `first` (no comma yet) or not
            if k == len(keys):
                return None
            if (k, first) not in memo:
                after = rest(k + 1, False)
                take = ("" if first else '"," ') + pairs[k] + (f" {after}" if after else "")
                if keys[k] in required:
                    body = take
                else:
                    skip = rest(k + 1, first)
                    body = f"({take}) | {skip}" if skip else f"({take})?"
                memo[(k, first)] = self._rule(body)
            return memo[(k, first)]

        inner = rest(0, True)
        return self._rule(f'"{{" {inner} "}}"' if inner else '"{" "}"')


__all__ = ["dump", "parse", "Rules", "QUOTE"]
