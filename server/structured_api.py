"""Structured-output fields of both doors, read into the engine's `Structured`.

HTTP: OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema"}, with
`json_schema.schema` and `strict`) and vLLM's `structured_outputs` ({"json": schema} | {"regex":
str} | {"choice": [str]}), at most one of them. gRPC: `GenerateRequest.structured_output`, a
oneof of the same four. Only shapes are checked here; the engine refuses what it cannot serve
(engine/structured), naming the path under the field the client used. Sizes are bounded before
any JSON is re-encoded, and compiling happens on the engine's worker threads.
"""

from __future__ import annotations

from typing import Any, Optional

from celeris.engine.errors import FieldViolation, clip
from celeris.engine.requests import MAX_SCHEMA_CHARS, Structured

FIELDS = ("response_format", "structured_outputs")
VLLM_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice"}


def from_body(body: dict, v: list[FieldViolation]) -> Optional[Structured]:
    """The structured output an OpenAI-style body asks for (None: free text); problems to `v`."""
    given = [f for f in FIELDS if body.get(f) is not None]
    if len(given) > 1:
        v.append(FieldViolation("structured_outputs", "set response_format or structured_outputs, not both"))
        return None
    if "response_format" in given:
        return _response_format(body["response_format"], v)
    if "structured_outputs" in given:
        return _vllm(body["structured_outputs"], v)
    return None


def _response_format(rf: Any, v: list[FieldViolation]) -> Optional[Structured]:
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Structured("json_object", None, "response_format")
    if kind != "json_schema":
        v.append(FieldViolation("response_format.type", f"{clip(kind)} is not one of text, json_object, json_schema"))
        return None
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema"), (dict, str)):
        v.append(FieldViolation("response_format.json_schema.schema", "is required: a JSON schema object"))
        return None
    if not isinstance(js.get("strict", True), (bool, type(None))):
        v.append(FieldViolation("response_format.json_schema.strict", "must be a boolean"))
    # strict or not, the output always follows the schema: a schema outside the subset is refused.
    return Structured("json_schema", js["schema"], "response_format.json_schema.schema")


def _vllm(so: Any, v: list[FieldViolation]) -> Optional[Structured]:
    keys = [k for k in VLLM_KINDS if isinstance(so, dict) and so.get(k) is not None]
    if len(keys) != 1:
        v.append(FieldViolation("structured_outputs", "set exactly one of json, regex or choice"))
        return None
    key = keys[0]
    others = [k for k in so if k not in VLLM_KINDS and so[k] not in (None, False)]
    if others:
        v.append(FieldViolation(f"structured_outputs.{clip(others[0], 40)}", "is not supported"))
        return None
    return Structured(VLLM_KINDS[key], so[key], f"structured_outputs.{key}")


def from_fields(kind: str, value: Any) -> Optional[Structured]:
    """gRPC: the oneof's set field (`json_schema`, `regex`, `choice`, `json_object`) and value."""
    field = f"structured_output.{kind}"
    if kind == "json_object":
        return Structured("json_object", None, field) if value else None
    if kind == "choice":
        value = list(value)
    return Structured(kind, value, field)


__all__ = ["from_body", "from_fields", "MAX_SCHEMA_CHARS"]
