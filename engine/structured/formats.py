"""String formats on the whole-document path: every value served validates under jsonschema's
format checker (issue 42).

llguidance knows a few `format`s (date-time, date, time, duration, email, hostname, ipv4, ipv6,
uri, uuid) and writes each as its own regex. Three of them admit values that do not exist: year
0000, February 29 of any year (1900, 2021), second 60 (a leap second, which RFC 3339's
validators and Python's datetime reject). Those three are replaced here, before llguidance
compiles the schema, by exact patterns of our own: years 0001-9999, the days each month has
(February 29 in leap years only), hours 00-23, seconds 00-59, at most 9 fraction digits, `T` and
`Z` upper case, an offset within +-23:59. A draft-3 schema's `time` is `HH:MM:SS` (that draft's
meaning, what its checker parses). The others are llguidance's: tests/unit/structured/
test_structured_formats.py holds each against jsonschema's checker (see docs/structured-outputs.md
for which ones the checker can test here).

The pattern replaces the keyword (`format` is dropped, so llguidance's regex plays no part);
a schema that already has a `pattern` gets ours as one more `allOf` branch, which llguidance
intersects. Values inside `const`, `enum`, `default` and examples are data, never rewritten.
"""

from __future__ import annotations

import copy

_YEAR = r"(000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"
# Leap years: divisible by 4 but not by 100 (last two digits 04..96), or by 400 (0400, ..., 2000, ...).
_LEAP = r"([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
DATE = (rf"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
        rf"|02-(0[1-9]|1[0-9]|2[0-8]))|{_LEAP}-02-29)")
_HMS = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]"
TIME = _HMS + r"(\.[0-9]{1,9})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
PATTERNS = {"date-time": f"^{DATE}T{TIME}$", "date": f"^{DATE}$", "time": f"^{TIME}$"}
DRAFT3 = {**PATTERNS, "time": f"^{_HMS}$"}
# Keywords whose values are JSON data, not schemas: nothing under them is rewritten.
_DATA = ("const", "enum", "default", "examples", "example")
# Keywords whose values map names to schemas (a property may be called `default` or `format`).
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")


def exact_formats(schema: object) -> object:
    """The schema with every `format` in PATTERNS replaced by its exact pattern (a copy; the
    schema itself is left as it is); the schema itself when it has none."""
    if not isinstance(schema, dict):
        return schema
    table = DRAFT3 if "draft-03" in str(schema.get("$schema", "")) else PATTERNS
    hits = list(_formats(schema, table))
    if not hits:
        return schema
    schema = copy.deepcopy(schema)
    for d in _formats(schema, table):
        pattern = table[d.pop("format")]
        if "pattern" not in d:
            d["pattern"] = pattern
        else:  # (an allOf that is not a list stays, and llguidance refuses the schema as before)
            d["allOf"] = [*d.get("allOf", []), {"pattern": pattern}]
    return schema


def _formats(schema: dict, table: dict) -> list[dict]:
    """Every schema dict whose `format` is in `table`, found without recursion (the schema's
    nesting was bounded before this runs) and without entering data keywords."""
    found: list[dict] = []
    stack: list[tuple[object, bool]] = [(schema, False)]  # (value, whether it is a name -> schema map)
    while stack:
        v, names = stack.pop()
        if isinstance(v, dict) and names:
            stack += [(x, False) for x in v.values()]
        elif isinstance(v, dict):
            f = v.get("format")
            if isinstance(f, str) and f in table and (
                    "pattern" not in v or isinstance(v.get("allOf", []), list)):
                found.append(v)
            stack += [(x, k in _MAPS) for k, x in v.items() if k not in _DATA and isinstance(x, (dict, list))]
        elif isinstance(v, list):
            stack += [(x, False) for x in v]
    return found
