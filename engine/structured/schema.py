"""A JSON schema (the supported subset) to a canvas layout: fixed text and bounded value slots.

The layout is a list of parts: `Text` (the skeleton: braces, keys, colons, commas, placed on the
canvas as committed tokens) and `Slot` (a value: a regex over its bytes and the most bytes it
can take). Every slot regex here matches only ASCII strings of bounded length, so a slot of
`max_bytes` positions always has room to finish (each token covers at least one byte).

Supported (see docs/structured-outputs.md): objects whose properties are all required
(`additionalProperties` false or absent), strings with maxLength/minLength/pattern/enum,
integers and numbers with bounds (inclusive or exclusive), booleans, null, `enum`/`const` of
scalars (of the schema's `type` when one is given), arrays of scalars with maxItems, nesting to
MAX_DEPTH objects. Anything else raises SchemaError with its schema path (a combinator such as
anyOf or $ref by its own name): the chooser (constraint.Compiler) then serves the schema as one
whole-document grammar (engine/structured/document.py) or refuses it, never relaxed. A string
with neither maxLength nor pattern is unbounded, so it is not a skeleton slot (no silent cap).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Optional, Union

from celeris.engine.structured.regexes import int_range, literal, max_width

MAX_DEPTH = 4  # objects nested inside objects
MAX_PROPERTIES = 64  # across the whole schema
MAX_STRING = 256
MAX_DIGITS = 15  # integer digits (JSON numbers past 2^53 lose precision in most parsers)
MAX_ITEMS = 32
# JSON string characters a slot may use: printable ASCII but the quote and the backslash.
STRING_CHAR = r'[ !#-\[\]-~]'
_SCALAR_KEYS = {"type", "title", "description", "default", "examples", "$comment", "$schema"}
# Keywords that make a value one of several shapes, or point elsewhere: refused by name.
_COMBINATORS = ("anyOf", "oneOf", "allOf", "not", "if", "then", "else", "$ref", "$defs", "definitions",
                "$dynamicRef")
_JSON_TYPES = {"string": str, "boolean": bool, "null": type(None)}


class SchemaError(ValueError):
    """A schema outside the subset: `path` names where (e.g. schema.properties.tags.items)."""

    def __init__(self, path: str, reason: str, empty: bool = False):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason
        self.empty = empty  # no value satisfies it: refused on every path, not handed to the document path


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Slot:
    regex: str
    max_bytes: int
    path: str
    within: Optional[str] = None  # a second regex every match must also match (intersection)


Part = Union[Text, Slot]


def compile_schema(schema: object, path: str = "schema") -> list[Part]:
    """The layout of a schema, adjacent texts merged."""
    parts: list[Part] = []
    _value(schema, path, 0, parts, [0])
    merged: list[Part] = []
    for p in parts:
        if isinstance(p, Text) and merged and isinstance(merged[-1], Text):
            merged[-1] = Text(merged[-1].text + p.text)
        else:
            merged.append(p)
    return merged


def _value(s: object, path: str, depth: int, out: list[Part], count: list[int]) -> None:
    if not isinstance(s, dict):
        raise SchemaError(path, "must be an object (a schema)")
    for k in _COMBINATORS:
        if k in s:
            raise SchemaError(f"{path}.{k}", "not supported: a value has one type here (no anyOf, oneOf, allOf, not, "
                                             "if/then/else, $ref or $defs)")
    if "enum" in s or "const" in s:
        out.append(_enum_slot(s, path))
        return
    kind = s.get("type")
    if kind == "object":
        _object(s, path, depth, out, count)
    elif kind == "array":
        out.append(_array_slot(s, path))
    elif kind in ("string", "integer", "number", "boolean", "null"):
        out.append(scalar_slot(s, path))
    else:
        raise SchemaError(f"{path}.type", f"unsupported type {json.dumps(kind)[:40]}: use object, array, string, "
                                          "integer, number, boolean or null (one type, no anyOf/oneOf/$ref)")


def _object(s: dict, path: str, depth: int, out: list[Part], count: list[int]) -> None:
    if depth >= MAX_DEPTH:
        raise SchemaError(path, f"objects nest at most {MAX_DEPTH} deep")
    _only(s, path, _SCALAR_KEYS | {"properties", "required", "additionalProperties"})
    if s.get("additionalProperties", False) is not False:
        raise SchemaError(f"{path}.additionalProperties", "must be false (or absent): only listed keys are written")
    props = s.get("properties", {})
    if not isinstance(props, dict):
        raise SchemaError(f"{path}.properties", "must be an object")
    required = s.get("required", list(props))
    if not isinstance(required, list) or set(required) != set(props):
        raise SchemaError(f"{path}.required", "every property must be required (optional keys are not supported)")
    count[0] += len(props)
    if count[0] > MAX_PROPERTIES:
        raise SchemaError(f"{path}.properties", f"at most {MAX_PROPERTIES} properties in a schema")
    out.append(Text("{"))
    for i, (key, sub) in enumerate(props.items()):
        if not isinstance(key, str) or not key or len(key) > 64 or not all(" " <= c <= "~" and c not in '"\\' for c in key):
            raise SchemaError(f"{path}.properties", f"key {json.dumps(key)[:70]}: keys are 1-64 printable ASCII "
                                                    "characters without quotes or backslashes")
        out.append(Text(("," if i else "") + json.dumps(key) + ":"))
        _value(sub, f"{path}.properties.{key}", depth + 1, out, count)
    out.append(Text("}"))


def _only(s: dict, path: str, allowed: set) -> None:
    for k in s:
        if k not in allowed:
            raise SchemaError(f"{path}.{k}", "keyword not supported here")


def _enum_slot(s: dict, path: str) -> Slot:
    _only(s, path, _SCALAR_KEYS | {"enum", "const"})
    values = [s["const"]] if "const" in s else s["enum"]
    where = f"{path}.{'const' if 'const' in s else 'enum'}"
    if not isinstance(values, list) or not 1 <= len(values) <= 256:
        raise SchemaError(where, "must list 1 to 256 values")
    texts = []
    for v in values:
        if isinstance(v, (dict, list)) or (isinstance(v, float) and not math.isfinite(v)):
            raise SchemaError(where, "values must be strings, numbers, booleans or null")
        text = json.dumps(v, ensure_ascii=True)
        if len(text) > MAX_STRING:
            raise SchemaError(where, f"values are at most {MAX_STRING} characters")
        if not _of_type(v, s.get("type")):
            raise SchemaError(where, f"value {text[:40]} is not of the schema's type {json.dumps(s.get('type'))[:40]}")
        texts.append(text)
    return Slot("(" + "|".join(literal(t) for t in texts) + ")", max(len(t) for t in texts), path)


def _of_type(v: object, kind: object) -> bool:
    """Whether an enum/const value is of the schema's `type` (no type: any)."""
    if kind is None:
        return True
    if kind in ("integer", "number"):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and (
            kind == "number" or isinstance(v, int) or float(v).is_integer())
    return isinstance(kind, str) and kind in _JSON_TYPES and isinstance(v, _JSON_TYPES[kind])


def scalar_slot(s: dict, path: str) -> Slot:
    """A string, integer, number, boolean or null value's slot."""
    kind = s["type"]
    if kind == "string":
        return _string(s, path)
    if kind in ("integer", "number"):
        return _numeric(s, path)
    _only(s, path, _SCALAR_KEYS)
    return Slot("(true|false)", 5, path) if kind == "boolean" else Slot("null", 4, path)


def _string(s: dict, path: str) -> Slot:
    _only(s, path, _SCALAR_KEYS | {"maxLength", "minLength", "pattern"})
    hi, lo = s.get("maxLength", MAX_STRING), s.get("minLength", 0)
    for key, v in (("maxLength", hi), ("minLength", lo)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_STRING:
            raise SchemaError(f"{path}.{key}", f"must be an integer in [0, {MAX_STRING}]")
    if lo > hi:
        raise SchemaError(f"{path}.minLength", "must not exceed maxLength", empty=True)
    if "pattern" not in s:
        if "maxLength" not in s:  # unbounded: the whole-document path serves it, never a silent cap
            raise SchemaError(f"{path}.maxLength", "a string without maxLength or pattern is unbounded")
        return Slot(f'"{STRING_CHAR}{{{lo},{hi}}}"', hi + 2, path)
    pattern = s["pattern"]
    if not isinstance(pattern, str) or len(pattern) > 256:
        raise SchemaError(f"{path}.pattern", "must be a regex of at most 256 characters")
    width = max_width(pattern, f"{path}.pattern", ascii_only=True)
    bounded = "maxLength" in s or "minLength" in s
    if width > MAX_STRING and "maxLength" not in s:
        raise SchemaError(f"{path}.pattern", f"may match {width} characters; bound it to {MAX_STRING}")
    if width < lo:  # cheap, before anything compiles: no match of the pattern is long enough
        raise SchemaError(f"{path}.minLength", f"the pattern's matches have at most {width} characters: "
                                               "no string satisfies both", empty=True)
    # Anchored (JSON schema patterns search; the slot must match as a whole), and within the
    # characters a JSON string may hold unescaped, and the length bounds when given: every
    # served string satisfies pattern and lengths together (an empty intersection is refused
    # when the slot compiles: constraint.Compiler).
    body = pattern.removeprefix("^").removesuffix("$")
    if not bounded:
        return Slot(f'"({body})"', width + 2, path, within=f'"{STRING_CHAR}*"')
    hi = min(hi, width) if "maxLength" in s else width
    return Slot(f'"({body})"', hi + 2, path, within=f'"{STRING_CHAR}{{{lo},{hi}}}"')


def _bound(s: dict, path: str, key: str):
    v = s.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or abs(v) >= 10 ** MAX_DIGITS:
        raise SchemaError(f"{path}.{key}", f"must be a finite number below 1e{MAX_DIGITS} in size")
    return v


def _numeric(s: dict, path: str) -> Slot:
    _only(s, path, _SCALAR_KEYS | {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
    lo, hi = _bound(s, path, "minimum"), _bound(s, path, "maximum")
    xlo, xhi = _bound(s, path, "exclusiveMinimum"), _bound(s, path, "exclusiveMaximum")
    if lo is not None and hi is not None and lo > hi:
        raise SchemaError(f"{path}.minimum", "must not exceed maximum")
    big = 10 ** MAX_DIGITS - 1
    # The values served lie in an integer range [ilo, ihi] (numbers: with fractions below ihi),
    # so exclusive bounds become the nearest integers strictly inside them.
    ilo = max(-big if lo is None else math.ceil(lo), -big if xlo is None else math.floor(xlo) + 1)
    ihi = min(big if hi is None else math.floor(hi), big if xhi is None else math.ceil(xhi) - 1)
    if ilo > ihi:
        raise SchemaError(path, "no integer lies within the bounds (fractions-only ranges are not supported)")
    if s["type"] == "integer" or ilo == ihi:
        regex = int_range(ilo, ihi)
        return Slot(regex, max(len(str(ilo)), len(str(ihi))), path)
    # A number: an integer part in [ilo, ihi - 1] with an optional fraction of up to 6 digits
    # (stays below ihi, at or above ilo when ilo >= 0) or exactly ihi. Negative parts grow
    # away from zero with a fraction, so they are taken from [ilo + 1, ihi - 1].
    parts = [int_range(ihi, ihi)]
    if ihi - 1 >= max(ilo, 0):
        parts.append(int_range(max(ilo, 0), ihi - 1) + r"(\.[0-9]{1,6})?")
    if min(ihi - 1, -1) >= ilo + 1:
        parts.append(int_range(ilo + 1, min(ihi - 1, -1)) + r"(\.[0-9]{1,6})?")
    if ilo < 0 and ilo <= min(ihi, -1):
        parts.append(int_range(ilo, min(ihi, -1)))
    width = max(len(str(ilo)), len(str(ihi))) + 7
    return Slot("(" + "|".join(parts) + ")", width, path)


def _array_slot(s: dict, path: str) -> Slot:
    _only(s, path, _SCALAR_KEYS | {"items", "maxItems", "minItems"})
    items = s.get("items")
    if not isinstance(items, dict) or items.get("type") in ("object", "array") or not (
            "enum" in items or "const" in items or items.get("type") in ("string", "integer", "number", "boolean")):
        raise SchemaError(f"{path}.items", "array items must be scalars (string, integer, number, boolean, enum)")
    hi, lo = s.get("maxItems"), s.get("minItems", 0)
    if isinstance(hi, bool) or not isinstance(hi, int) or not 0 <= hi <= MAX_ITEMS:
        raise SchemaError(f"{path}.maxItems", f"is required, an integer in [0, {MAX_ITEMS}]")
    if isinstance(lo, bool) or not isinstance(lo, int) or not 0 <= lo <= hi:
        raise SchemaError(f"{path}.minItems", "must be an integer in [0, maxItems]")
    item = _enum_slot(items, f"{path}.items") if "enum" in items or "const" in items else scalar_slot(items, f"{path}.items")
    if item.within is not None:
        raise SchemaError(f"{path}.items.pattern", "patterns are not supported inside arrays")
    if hi == 0:
        return Slot(r"\[\]", 2, path)
    more = f"(,{item.regex}){{{max(lo - 1, 0)},{hi - 1}}}"
    regex = rf"\[{item.regex}{more}\]" if lo else rf"\[({item.regex}{more})?\]"
    return Slot(regex, 2 + hi * (item.max_bytes + 1), path)


def json_object_slot(max_bytes: int) -> Slot:
    """`json_object` with no schema: a flat object of short keys and scalar values, as many
    members as fit in max_bytes."""
    key = '"[a-zA-Z_][a-zA-Z0-9_]{0,15}"'
    value = f'(-?[0-9]{{1,9}}|"{STRING_CHAR}{{0,24}}"|true|false|null)'
    member_bytes = 18 + 1 + 26 + 1
    n = max(0, (max_bytes - 2) // member_bytes)
    if n == 0:
        return Slot(r"\{\}", 2, "response_format")
    return Slot(rf"\{{({key}:{value}(,{key}:{value}){{0,{n - 1}}})?\}}", 2 + n * member_bytes, "response_format")
