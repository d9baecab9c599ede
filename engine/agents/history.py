"""What a chat holds besides its contents, measured before anything renders or tokenizes it.

A chat template writes more than the messages' contents: an assistant's tool calls (names and
arguments), a tool result's call id and name, any other field a message carries (a reasoning
text), and the request's tools (names, descriptions, parameter schemas). All of it becomes prompt
tokens, so all of it counts in the prompt's size limit with the contents (engine/requests.py),
and none of it may nest deeper than MAX_JSON_NESTING: the template's renderer, `json.loads` of
a call's arguments and `json.dumps` all recurse, and JSON nested thousands deep would end in a
RecursionError. Every walk here is iterative (an explicit stack), and arguments sent as JSON text
are scanned for their nesting before anything parses them.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from celeris.engine.errors import FieldViolation, clip
from celeris.engine.structured.spec import json_text_depth

# Arrays and objects nested in a call's arguments, a tool's schema or any other JSON a chat
# holds. Generous for real arguments (a schema is held to 32, engine/structured/spec.py), far
# under the ~1,000 frames Python's recursive parsers and the template renderer have.
MAX_JSON_NESTING = 64
CHAT_ROLES = ("system", "user", "assistant", "tool")  # "tool": a tool's result


def text_size(value: Any, field: str, v: list[FieldViolation], limit: int = MAX_JSON_NESTING) -> int:
    """Characters of text in `value` (strings, keys, numbers as written), walked without recursion;
    a violation naming `field` if lists and dicts nest deeper than `limit` (the walk stops there)."""
    total, stack = 0, [(value, 1)]
    while stack:
        x, depth = stack.pop()
        if isinstance(x, str):
            total += len(x)
        elif isinstance(x, (dict, list, tuple)):
            if depth > limit:
                v.append(FieldViolation(field, f"nests arrays and objects more than {limit} deep"))
                return total
            items = x.items() if isinstance(x, dict) else ((None, y) for y in x)
            for k, y in items:
                total += len(k) if isinstance(k, str) else 0
                stack.append((y, depth + 1))
        elif x is not None:
            total += len(str(x)) if isinstance(x, (int, float, bool)) else 0
    return total


def message_extras(m: dict, i: int, v: list[FieldViolation]) -> int:
    """Characters of message i's text besides its role and content (tool calls, name, call id,
    any other field a template may write); arguments sent as JSON text are checked for nesting."""
    extra = {k: x for k, x in m.items() if k not in ("role", "content")}
    total = text_size(extra, f"messages[{i}]", v)
    calls = m.get("tool_calls")
    for k, c in enumerate(calls if isinstance(calls, (list, tuple)) else ()):
        fn = c.get("function") if isinstance(c, dict) else None
        args = fn.get("arguments") if isinstance(fn, dict) else None
        if isinstance(args, str) and json_text_depth(args) > MAX_JSON_NESTING:
            v.append(FieldViolation(f"messages[{i}].tool_calls[{k}].function.arguments",
                                    f"nests arrays and objects more than {MAX_JSON_NESTING} deep"))
    return total


def tools_size(tools: Optional[Sequence[dict]], v: list[FieldViolation]) -> int:
    """Characters of the request's tools as the template gets them (OpenAI-shaped dicts)."""
    return 0 if not tools else text_size(list(tools), "tools", v)


__all__ = ["MAX_JSON_NESTING", "text_size", "message_extras", "tools_size"]


def check_messages(messages: Sequence[dict], tools: Optional[Sequence[dict]], limits: tuple[int, int],
                   too_long: Callable[[str, str, int], FieldViolation]) -> list[FieldViolation]:
    """Each message's shape; then everything the template will write (contents, tool calls,
    names, any other field, the tools) against the prompt's size limits, `limits` = (tokens,
    characters) (`too_long` states a refusal), and its nesting, before anything renders or
    tokenizes it. Every turn costs at least one token."""
    max_tokens, max_chars = limits
    if not messages:
        return [FieldViolation("messages", "must not be empty")]
    if len(messages) > max_tokens:
        return [FieldViolation("messages", f"{len(messages)} messages; the limit is {max_tokens}")]
    v: list[FieldViolation] = []
    total = extras = 0
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        content = m.get("content") if isinstance(m, dict) else None
        if role not in CHAT_ROLES:
            v.append(FieldViolation(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}, got {clip(role)}"))
        if not isinstance(content, str):
            v.append(FieldViolation(f"messages[{i}].content", f"must be a string, got {clip(content)}"))
        else:
            total += len(content)
        if isinstance(m, dict):
            extras += message_extras(m, i, v)
    extras += tools_size(tools, v)
    if total + extras > max_chars:
        what = "content is" if not extras else "text (contents, tool calls, names, tools) is"
        v.append(too_long("messages", what, total + extras))
    return v
