"""Twenty JSON schemas written for the tests of the whole-document path on every family: each uses
`$ref`/`$defs` (or `definitions`), optional keys or an array of objects, so none fits the skeleton's
subset (each is checked to take the document path where it is used). Every shortest document is
short (a few tokens of celeris-tiny's tokenizer), so a 96-token canvas holds each."""

from __future__ import annotations

_NAME = {"type": "string", "maxLength": 8}
_AGE = {"type": "integer", "minimum": 0, "maximum": 120}
_PET = {"type": "object", "required": ["name"], "additionalProperties": False,
        "properties": {"name": _NAME, "age": _AGE}}


def _obj(required: list[str], **properties) -> dict:
    return {"type": "object", "required": required, "additionalProperties": False, "properties": properties}


DOCUMENT_SCHEMAS: dict[str, dict] = {
    # $ref / $defs / definitions
    "ref_pet": {"$defs": {"pet": _PET}, **_obj(["owner"], owner={"$ref": "#/$defs/pet"})},
    "ref_definitions": {"definitions": {"id": {"type": "integer", "minimum": 1, "maximum": 999}},
                        **_obj(["a", "b"], a={"$ref": "#/definitions/id"}, b={"$ref": "#/definitions/id"})},
    "ref_recursive_tree": {"$ref": "#/$defs/node", "$defs": {"node": _obj(
        ["v"], v={"type": "integer", "minimum": 0, "maximum": 9},
        kids={"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/node"}})}},
    "ref_enum": {"$defs": {"color": {"enum": ["red", "green", "blue"]}},
                 **_obj(["fg", "bg"], fg={"$ref": "#/$defs/color"}, bg={"$ref": "#/$defs/color"})},
    "ref_nested_chain": {"$defs": {"inner": _obj(["ok"], ok={"type": "boolean"}),
                                   "outer": _obj(["in"], **{"in": {"$ref": "#/$defs/inner"}})},
                         **_obj(["x"], x={"$ref": "#/$defs/outer"})},
    "ref_list": {"$defs": {"tag": {"type": "string", "maxLength": 5}},
                 **_obj(["tags"], tags={"type": "array", "maxItems": 3, "items": {"$ref": "#/$defs/tag"}})},
    "ref_anyof": {"$defs": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 4}},
                  **_obj(["v"], v={"anyOf": [{"$ref": "#/$defs/n"}, {"$ref": "#/$defs/s"}]})},
    # optional keys
    "optional_one": _obj(["id"], id={"type": "integer"}, note={"type": "string", "maxLength": 6}),
    "optional_all": _obj([], a={"type": "boolean"}, b={"type": "integer", "minimum": 0, "maximum": 5}),
    "optional_mixed": _obj(["name"], name=_NAME, age=_AGE, email={"type": "string", "maxLength": 12},
                           admin={"type": "boolean"}),
    "optional_nested": _obj(["user"], user=_obj(["id"], id={"type": "integer"}, nick=_NAME)),
    "optional_null": _obj(["k"], k={"type": ["string", "null"], "maxLength": 4}, extra={"type": "null"}),
    "optional_number": _obj(["lo"], lo={"type": "number", "minimum": -5, "maximum": 5},
                            hi={"type": "number", "minimum": 0, "maximum": 100}),
    "optional_open": {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"},
                                                                         "b": {"type": "boolean"}}},
    # arrays of objects
    "rows": {"type": "array", "maxItems": 3, "items": _obj(["k", "on"], k=_NAME, on={"type": "boolean"})},
    "rows_in_object": _obj(["items"], items={"type": "array", "maxItems": 2, "items": _obj(
        ["sku", "qty"], sku={"type": "string", "maxLength": 6}, qty={"type": "integer", "minimum": 1, "maximum": 9})}),
    "rows_min_one": {"type": "array", "minItems": 1, "maxItems": 2, "items": _obj(["x"], x={"type": "integer"})},
    "rows_of_pets": _obj(["pets"], pets={"type": "array", "maxItems": 2, "items": _PET}),
    "rows_nested": {"type": "array", "maxItems": 2, "items": _obj(
        ["p"], p=_obj(["q"], q={"type": "boolean"}))},
    "rows_enum": _obj(["moves"], moves={"type": "array", "maxItems": 3, "items": _obj(
        ["dir"], dir={"enum": ["up", "down"]}, n={"type": "integer", "minimum": 1, "maximum": 3})}),
}

assert len(DOCUMENT_SCHEMAS) == 20
