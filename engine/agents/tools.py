"""Tools and tool choice as a door hands them over (OpenAI's shapes), checked once, by field.

`parse_tools` reads `[{"type": "function", "function": {"name", "description", "parameters",
"strict"}}]` and `parse_tool_choice` reads "none" | "auto" | "required" | {"type": "function",
"function": {"name": ...}}; both raise InvalidRequest naming the exact field (e.g.
`tools[2].function.parameters.properties.a.uniqueItems`). A door's parse checks only what costs
nothing: the list's length, names (matched whole), each schema's size and nesting. The engine
compiles the schemas (`compile_problems`) after the prompt's length is known, on the compile
lanes, in the verdicts' child process (engine/structured/lanes.py, verdicts.py), the way
enforcement compiles them (llguidance's JSON-schema compiler with the structured-outputs
overrides, engine/structured/document.py), so a tool that is accepted can be enforced later.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import time
from dataclasses import dataclass, field as dc_field
from typing import Optional, Sequence

import llguidance

from celeris.engine.errors import FieldViolation, InvalidRequest, clip
from celeris.engine.structured.spec import LIMITS, MAX_SCHEMA_NESTING, StructureError, read_schema, value_depth
from celeris.engine.structured.document import OPTIONS, locate
from celeris.engine.structured.verdicts import Verdicts, VerdictTimeout

MAX_TOOLS = 128
MAX_TOOLS_CHARS = 262_144  # all tools' JSON text together (each schema is also held to MAX_SCHEMA_CHARS)
MAX_DESCRIPTION_CHARS = 8_192
TOOLS_COMPILE_S = 20.0  # one request's tools compile within this (compile_problems), else refused
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's function-name rule, matched whole (fullmatch: no "\n")
CHOICE_MODES = ("none", "auto", "required", "function")
_ID_CHARS = string.ascii_letters + string.digits


@dataclass(frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict = dc_field(default_factory=lambda: {"type": "object"})  # a JSON schema
    strict: bool = False

    def openai(self) -> dict:
        """The OpenAI-shaped dict a chat template's `tools` argument gets (as transformers passes it)."""
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "function"
    name: Optional[str] = None  # the function's name when mode == "function"


def new_call_id() -> str:
    """A tool call id as OpenAI writes them: "call_" and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


def _bad(field: str, reason: str) -> InvalidRequest:
    return InvalidRequest([FieldViolation(field, reason)])


def parse_tools(value: object, field: str = "tools") -> tuple[Tool, ...]:
    """The tools of a request (None or [] -> ()), every limit checked before any schema compiles."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise _bad(field, f"must be a list of tools, got {clip(value)}")
    if len(value) > MAX_TOOLS:
        raise _bad(field, f"{len(value)} tools; the limit is {MAX_TOOLS}")
    v: list[FieldViolation] = []
    shapes: list[tuple[str, str, object, object, bool]] = []
    seen: dict[str, int] = {}
    for i, t in enumerate(value):
        f = f"{field}[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            v.append(FieldViolation(f"{f}.type", "each tool must be {\"type\": \"function\", \"function\": {...}}"))
            continue
        fn = t.get("function")
        if not isinstance(fn, dict):
            v.append(FieldViolation(f"{f}.function", "must be an object with a name"))
            continue
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            v.append(FieldViolation(f"{f}.function.name", f"must match ^[a-zA-Z0-9_-]{{1,64}}$, got {clip(name)}"))
            continue
        if name in seen:
            v.append(FieldViolation(f"{f}.function.name", f"duplicates tools[{seen[name]}]'s name {name!r}"))
            continue
        seen[name] = i
        desc = fn.get("description", "")
        if desc is None:
            desc = ""
        if not isinstance(desc, str) or len(desc) > MAX_DESCRIPTION_CHARS:
            v.append(FieldViolation(f"{f}.function.description",
                                    f"a string of at most {MAX_DESCRIPTION_CHARS} characters"))
        strict = fn.get("strict", False)
        if strict is not None and not isinstance(strict, bool):
            v.append(FieldViolation(f"{f}.function.strict", "must be a boolean"))
        shapes.append((f, name, desc, fn.get("parameters"), bool(strict)))
    deep = f"nests arrays and objects more than {MAX_SCHEMA_NESTING} deep"
    v += [FieldViolation(f"{f}.function.parameters", deep) for f, _, _, params, _ in shapes
          if value_depth(params, MAX_SCHEMA_NESTING) > MAX_SCHEMA_NESTING]  # before anything recurses into it
    if v:
        raise InvalidRequest(v)
    if value_depth(list(value), MAX_SCHEMA_NESTING + 3) > MAX_SCHEMA_NESTING + 3:  # the list, a tool, its function
        raise _bad(field, f"a tool {deep} in its other fields")
    try:
        total = len(json.dumps(list(value)))
    except (TypeError, ValueError):
        total = None
    if total is None or total > MAX_TOOLS_CHARS:
        raise _bad(field, f"at most {MAX_TOOLS_CHARS} characters of JSON in all" if total else "must be JSON values")
    tools = []
    for f, name, desc, params, strict in shapes:
        try:
            schema = check_parameters(params, f"{f}.function.parameters")
        except InvalidRequest as e:
            v += e.violations
            continue
        tools.append(Tool(name, desc if isinstance(desc, str) else "", schema, strict))
    if v:
        raise InvalidRequest(v)
    return tuple(tools)


def check_parameters(params: object, field: str) -> dict:
    """A function's parameters schema, shape only: missing -> {"type": "object"}; its size and
    nesting checked. Whether llguidance compiles it is the engine's to find out, on the
    structured-output lanes (`compile_problems`, engine/requests.py), after the prompt's length."""
    if params is None:
        return {"type": "object"}
    if not isinstance(params, dict):
        raise _bad(field, f"must be a JSON schema object, got {clip(params)}")
    if "type" in params and params["type"] != "object":
        raise _bad(f"{field}.type", "a function's parameters must be an object schema (\"type\": \"object\")")
    try:
        return read_schema(params, field)
    except StructureError as e:
        raise _bad(e.path, e.reason) from None


def args_schema(schema: dict, separators: tuple[str, str] = (",", ":")) -> dict:
    """The schema as enforcement compiles it: OpenAI's strict reading of objects (`strict_objects`),
    the client's own x-guidance (if any) overridden by the structured-outputs options, so nothing a
    client sends relaxes what is served; `separators` (item, key) as the family's template writes
    arguments (`tojson`: ", ", ": ")."""
    schema = strict_objects(schema)
    own = schema.get("x-guidance") if isinstance(schema.get("x-guidance"), dict) else {}
    item, key = separators
    return {**schema, "x-guidance": {**own, **OPTIONS, "item_separator": item, "key_separator": key}}


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
_SCHEMA_LISTS = ("prefixItems",)
_SCHEMA_ONE = ("items", "additionalProperties", "not", "contains", "propertyNames")
# Alternatives for the same instance: inside an allOf member they name only part of its keys too.
_SAME_LISTS, _SAME_ONE = ("anyOf", "oneOf"), ("if", "then", "else")


def strict_objects(schema: object, strict: bool = True) -> object:
    """A copy of `schema` where an object that lists `properties` and says nothing about other
    keys (no `additionalProperties`, `patternProperties` or `unevaluatedProperties`) takes no
    others: OpenAI's strict reading, so a forced call carries only the keys its function names (JSON
    Schema's own default would let a small model add any). A schema that says otherwise is kept.
    `allOf` members are left open (each names only part of the object's keys), and so are their
    alternatives (`anyOf`, `oneOf`, `if`/`then`/`else`: the same object); their properties' own
    objects are read strictly again."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _SCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: strict_objects(sub) for name, sub in out[k].items()}
    for k in _SCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [strict_objects(sub) for sub in out[k]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [strict_objects(sub, strict=False) for sub in out["allOf"]]
    for k in _SCHEMA_ONE:
        if isinstance(out.get(k), dict):
            out[k] = strict_objects(out[k])
    for k in _SAME_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [strict_objects(sub, strict) for sub in out[k]]
    for k in _SAME_ONE:
        if isinstance(out.get(k), dict):
            out[k] = strict_objects(out[k], strict)
    open_ = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf")
    if strict and isinstance(out.get("properties"), dict) and not any(k in out for k in open_):
        out["additionalProperties"] = False
    return out


def compile_problems(tools: Sequence[dict], verdicts: Verdicts, budget_s: float = TOOLS_COMPILE_S,
                     field: str = "tools") -> list[FieldViolation]:
    """Why each tool's parameters cannot be enforced, as llguidance compiles them (in the
    verdicts' child process), by the schema path its error names; all of a request's tools
    together within `budget_s`, past which the rest are refused by name (a bound in time: the
    library's compile has none of its own). `tools`: OpenAI-shaped dicts (`Tool.openai`)."""
    v: list[FieldViolation] = []
    deadline = time.monotonic() + budget_s
    for i, t in enumerate(tools):
        schema = t["function"].get("parameters") or {"type": "object"}
        where = f"{field}[{i}].function.parameters"
        try:
            problem = verdicts.problem(arguments_grammar(schema), deadline - time.monotonic())
        except VerdictTimeout:
            v.append(FieldViolation(where, f"the request's tools did not compile within {budget_s:g} s (the "
                                           f"server's bound for one request's tools): send fewer or simpler schemas"))
            break
        if problem:
            problem = f"the constraint library refuses it: {problem}"
            v.append(FieldViolation(locate(schema, problem, where) or where, problem))
    return v


def arguments_grammar(schema: dict) -> str:
    """The lark grammar of a call's arguments under `schema`, as enforcement compiles it."""
    return "start: %json " + json.dumps(args_schema(schema))


def schema_problem(text: str) -> str:
    """Why llguidance will not compile this schema text (as an arguments document), or "" (in
    this process: tests and offline callers; the server asks `compile_problems`)."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(arguments_grammar(json.loads(text)))
        msg = llguidance.LLMatcher.validate_grammar(grammar, None, limits=LIMITS)
    except ValueError as e:  # pragma: no cover - the library's own refusal of the text
        msg = str(e)
    msg = msg.strip().split("\n")[0]  # its first line; the rest echoes the grammar text
    return f"the constraint library refuses it: {msg[:200]}" if msg else ""


def parse_tool_choice(value: object, tools: tuple[Tool, ...], field: str = "tool_choice") -> ToolChoice:
    """The request's tool choice; None -> "auto" with tools, "none" without."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise _bad(field, f"must be \"none\", \"auto\", \"required\" or a named function, got {clip(value)}")
        if value == "required" and not tools:
            raise _bad(field, "\"required\" needs at least one tool in tools")
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function":
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise _bad(f"{field}.function.name", "must name a function")
        if not tools:
            raise _bad(field, "names a function but tools is empty")
        if name not in {t.name for t in tools}:
            raise _bad(f"{field}.function.name", f"names no tool in tools: {clip(name)}")
        return ToolChoice("function", name)
    raise _bad(field, f"must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", \"function\": "
                      f"{{\"name\": ...}}}}, got {clip(value)}")


__all__ = ["Tool", "ToolCall", "ToolChoice", "parse_tools", "parse_tool_choice", "new_call_id", "MAX_TOOLS",
           "check_parameters", "args_schema", "compile_problems", "schema_problem", "CHOICE_MODES"]
