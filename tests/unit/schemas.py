"""JSON schemas written for the tests (shared by the structured-output tests of each family)."""

from __future__ import annotations

PERSON = {"type": "object", "required": ["name", "age", "ok", "tags", "score", "color", "addr"], "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    "score": {"type": "number", "minimum": -1.5, "maximum": 9}, "color": {"enum": ["red", "green", 3, None]},
    "addr": {"type": "object", "required": ["zip"], "properties": {
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
