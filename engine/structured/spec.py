"""What a door asks for and the limits checked before anything compiles.

`Structured` is a request's structured output as a door hands it over (a JSON schema,
`json_object`, a regex, a choice list, or the engine's own lark grammar); `StructureError` names
the field or schema path that cannot be served. The size and nesting limits here are checked
before any parser recurses into a client's JSON: `json_text_depth` scans text's brackets,
`value_depth` walks parsed values with an explicit stack, so JSON nested thousands deep is refused
by name, never by a RecursionError (both doors' other JSON fields use them too).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import llguidance

MAX_SCHEMA_CHARS = 393_216  # a schema's JSON text, checked before parsing (JSONSchemaBench's largest served: 236 KB)
# A schema over this many characters compiles on a lane of its own (engine/requests.py), one at a
# time and at most LARGE_SCHEMAS_WAITING waiting: its compile can take seconds (one 99 KB schema
# in JSON Schema Store takes 18 s, a cost llguidance's fuel limits do not bound), and it must not
# delay the small schemas most requests send.
LARGE_SCHEMA_CHARS = 32_768
LARGE_SCHEMAS_WAITING = 4
MAX_SCHEMA_NESTING = 32  # arrays/objects nested in a schema's JSON, checked before parsing (no recursion)
GRAMMAR_CACHE = 256  # slot grammars remembered with their verdicts, per tokenizer
MAX_CHOICES, MAX_CHOICE_CHARS = 256, 256
KINDS = ("json_schema", "json_object", "regex", "choice")
# The engine's own kind, never a door's: an llguidance lark grammar the engine wrote (engine/agents
# writes a tool call's syntax around `%json {schema}` arguments), served on the whole-document path.
GRAMMAR = "grammar"
MAX_GRAMMAR_CHARS = 524_288
# llguidance's own work bounds (lexer states, parser items, mask-computation fuel), checked as it
# compiles a grammar and per token: a hostile regex fails instead of stalling a thread.
LIMITS = llguidance.LLParserLimits(max_lexer_states=50_000, step_lexer_fuel=2_000_000)


class StructureError(ValueError):
    """A structure that cannot be served: `path` names the field (or schema path)."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


@dataclass(frozen=True)
class Structured:
    """What a door asks for: kind in KINDS; value the schema (a dict or its JSON text), the
    regex, or the list of choices; field is the value's path in the door's own spelling, the
    root of every path an error names (e.g. response_format.json_schema.schema)."""

    kind: str
    value: object = None
    field: str = "structured_output"
    # A structure the model may decline (tool_choice "auto"'s lazy grammar: text or calls, decided
    # at the first position): served where the family serves whole documents and nothing the
    # request sets could cut it, else the request decodes free (its answer parsed after the fact).
    lazy: bool = False
    # Text whose length in tokens (and one stop token) a canvas fitted to the structure gets when
    # the request set no length (engine/requests.py `fit_canvas`): e.g. two typical calls.
    room_text: str = ""

    @property
    def large(self) -> bool:
        """A schema over LARGE_SCHEMA_CHARS of JSON (the parsed value measured by re-encoding it)."""
        if self.kind not in ("json_schema", "grammar") or self.value is None:
            return False
        n = len(self.value) if isinstance(self.value, str) else len(json.dumps(self.value))
        return n > LARGE_SCHEMA_CHARS



def read_schema(value: object, f: str) -> object:
    """The schema as Python values, its size and nesting checked first: JSON text by a scan of its
    brackets, parsed values by an explicit walk (neither recurses), so a schema nested thousands
    deep is refused by name, not by a RecursionError."""
    if isinstance(value, str):
        if len(value) > MAX_SCHEMA_CHARS:
            raise StructureError(f, f"at most {MAX_SCHEMA_CHARS} characters of JSON")
        if json_text_depth(value) > MAX_SCHEMA_NESTING:
            raise StructureError(f, f"nests arrays and objects more than {MAX_SCHEMA_NESTING} deep")
        try:
            return json.loads(value)
        except ValueError as e:
            raise StructureError(f, f"not valid JSON: {e}") from None
    if value_depth(value, MAX_SCHEMA_NESTING) > MAX_SCHEMA_NESTING:
        raise StructureError(f, f"nests arrays and objects more than {MAX_SCHEMA_NESTING} deep")
    if len(json.dumps(value)) > MAX_SCHEMA_CHARS:
        raise StructureError(f, f"at most {MAX_SCHEMA_CHARS} characters of JSON")
    return value


def json_text_depth(text: str) -> int:
    """How deep arrays and objects nest in JSON text (brackets inside strings not counted): one
    linear scan, before any parser recurses into it."""
    depth = deepest = 0
    for m in _BRACKETS.finditer(text):
        token = m.group()
        if token in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif token in "]}":
            depth -= 1
    return deepest


_BRACKETS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')  # a string (skipped whole), or a bracket


def value_depth(value: object, limit: int) -> int:
    """How deep lists and dicts nest in `value`, walked without recursion and stopping past
    `limit` (returns limit + 1 there)."""
    stack, deepest = [(value, 1)], 0
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list, tuple)):
            if d > limit:
                return d
            deepest = max(deepest, d)
            stack += [(x, d + 1) for x in (v.values() if isinstance(v, dict) else v)]
    return deepest
