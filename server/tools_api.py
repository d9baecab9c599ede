"""Tools on the HTTP door: OpenAI's `tools`, `tool_choice`, `parallel_tool_calls` and the history
an agent loop sends back (assistant `tool_calls`, `tool` messages), read into the engine's agent
types (engine/agents); and which tool-call and reasoning parsers read this model's answers.

The parsers: `--tool-call-parser NAME` and `--reasoning-parser NAME` (vLLM's flags and names), by
default detected from the loaded chat template; "none" turns one off. A request with tools and
tool_choice "auto" is rendered with its tools (the checkpoint's template) and decoded under the
parser's lazy grammar (text, or calls under their schemas, decided at the first position) where
the engine serves it, else its answer is parsed after the fact; "required" or a named function decodes the call under the function's schema (the parser's
`enforced` structured output), so it always parses. "none" renders the tools and parses nothing.
The deprecated `functions` / `function_call` are refused, naming `tools` / `tool_choice`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from celeris.engine.errors import EngineError, FieldViolation, InvalidRequest, clip

CHAT_ONLY = ("tools", "tool_choice", "parallel_tool_calls")
NEUTRAL = {"tools": ([],), "tool_choice": ("none", "auto"), "parallel_tool_calls": (True, False)}
DEPRECATED = {"functions": "tools", "function_call": "tool_choice"}
ENFORCED = ("required", "function")  # tool_choice modes decoded under the function's schema
OFF = "none"  # --tool-call-parser none / --reasoning-parser none: no parsing


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools: what the template renders and how the answer is read."""

    tools: tuple  # engine.agents.tools.Tool, in the client's order
    choice: Any  # engine.agents.tools.ToolChoice
    parallel: bool = True  # parallel_tool_calls: false keeps the first call only

    @property
    def enforced(self) -> bool:
        return self.choice.mode in ENFORCED

    @property
    def parsed(self) -> bool:
        """The answer is read for calls ("auto", "required", a named function)."""
        return bool(self.tools) and self.choice.mode != "none"

    def template_tools(self) -> list[dict]:
        """The tools as chat templates take them (transformers' `tools` argument: OpenAI's shape)."""
        return [t.openai() for t in self.tools]


@dataclass(frozen=True)
class Parsers:
    """The parsers this server reads answers with (None: that kind of parsing is off)."""

    tool: Any = None  # engine.agents.parsers.ToolParser
    reasoning: Any = None  # engine.agents.reasoning.ReasoningParser
    # The tokenizer's added tokens (text -> id): an enforced call writes the format's markers as
    # these tokens, as the model saw them in training, not spelled out in ordinary text tokens.
    specials: dict = field(default_factory=dict)

    @property
    def names(self) -> dict[str, Optional[str]]:
        return {"tool_call_parser": getattr(self.tool, "name", None),
                "reasoning_parser": getattr(self.reasoning, "name", None)}


def check_names(tool: Optional[str], reasoning: Optional[str]) -> None:
    """Start-up check of the two flags (before the model loads): unknown names fail at once."""
    from celeris.engine.requests import REASONING_PARSERS, TOOL_PARSERS

    for flag, name, table in (("--tool-call-parser", tool, TOOL_PARSERS),
                              ("--reasoning-parser", reasoning, REASONING_PARSERS)):
        if name is not None and name != OFF and name not in table:
            known = ", ".join(sorted(table))
            raise EngineError(f"{flag} {name!r}: not a known parser; one of {known} (or none; unset: detected "
                              f"from the model's chat template)")


def resolve(chat_template: str, tool_call_parser: Optional[str] = None,
            reasoning_parser: Optional[str] = None, specials: Optional[dict] = None) -> Parsers:
    """The parsers for a loaded model: the named ones, else the ones its chat template shows
    (`specials`: its tokenizer's `special_markers`)."""
    from celeris.engine.requests import REASONING_PARSERS, TOOL_PARSERS, detect_reasoning_parser, detect_tool_parser

    tool, reasoning = tool_call_parser, reasoning_parser
    check_names(tool, reasoning)
    tool = detect_tool_parser(chat_template or "") if tool is None else tool
    reasoning = detect_reasoning_parser(chat_template or "") if reasoning is None else reasoning
    return Parsers(TOOL_PARSERS.get(tool) if tool and tool != OFF else None,
                   REASONING_PARSERS.get(reasoning) if reasoning and reasoning != OFF else None, dict(specials or {}))


def _neutral(name: str, x: Any) -> bool:
    return any(type(x) is type(n) and x == n for n in NEUTRAL[name])


def from_body(body: dict, chat: bool, v: list[FieldViolation]) -> Optional[ToolRequest]:
    """The tool fields of a body (None: no tools); problems to `v`, each naming its field."""
    for old, new in DEPRECATED.items():
        x = body.get(old)
        if x is not None and x not in ([], "none", "auto"):
            v.append(FieldViolation(old, f"is deprecated and not served here; use `{new}`"))
    if not chat:
        for name in CHAT_ONLY:
            if body.get(name) is not None and not _neutral(name, body[name]):
                v.append(FieldViolation(name, "is a chat completions field (POST /v1/chat/completions)"))
        return None
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        v.append(FieldViolation("parallel_tool_calls", f"must be a boolean, got {clip(parallel)}"))
    from celeris.engine.requests import parse_tool_choice, parse_tools

    raw, choice_raw = body.get("tools"), body.get("tool_choice")
    if raw is None or raw == []:
        if choice_raw is not None and choice_raw not in ("none", "auto"):
            v.append(FieldViolation("tool_choice", f"{clip(choice_raw)} needs `tools` (none were given)"))
        return None
    try:
        tools = parse_tools(raw, "tools")
    except InvalidRequest as e:
        v += e.violations
        return None
    try:
        choice = parse_tool_choice(choice_raw, tools, "tool_choice")
    except InvalidRequest as e:
        v += e.violations
        return None
    return ToolRequest(tools, choice, parallel is not False)


def check_structured(tools: Optional[ToolRequest], structured: Any, body: dict, v: list[FieldViolation]) -> None:
    """tool_choice "required" or a named function decodes the call under its own schema: a
    response_format or structured_outputs beside it asks for two structures."""
    if tools is not None and tools.enforced and structured is not None:
        given = "response_format" if body.get("response_format") is not None else "structured_outputs"
        v.append(FieldViolation("tool_choice", f"{clip(body.get('tool_choice'))} decodes the call under the "
                                               f"function's schema; it cannot be combined with {given}"))


def plan(tools: Optional[ToolRequest], parsers: Parsers, structured: Any) -> Any:
    """The structured output a request decodes under: the parser's enforced call for "required"
    or a named function, its lazy grammar for "auto" (the request's own structure, or a
    reasoning parser, keeps "auto" parsed after the fact), else the request's own. A request whose tools this model cannot call
    (no tool-call parser) is refused naming `tools`."""
    if tools is None or not tools.parsed:
        return structured
    if parsers.tool is None:
        raise InvalidRequest([FieldViolation("tools", "this model's chat template shows no tool-call format this "
                                                      "server reads; start it with --tool-call-parser NAME "
                                                      "(docs/tools.md), or send tool_choice \"none\"")])
    if not tools.enforced:
        if tools.choice.mode != "auto" or structured is not None or parsers.reasoning is not None:
            return structured  # a thinking channel comes first: parsed after the fact (docs/tools.md)
        return parsers.tool.lazy(tools.tools, tools.parallel, specials=parsers.specials)
    for i, t in enumerate(tools.tools):  # an enforced call must read back as a call: else a 200 without calls
        picked = tools.choice.mode == "required" or t.name == tools.choice.name
        if picked and [c.name for c in parsers.tool.extract(parsers.tool.render(t.name, {}))[1]] != [t.name]:
            raise InvalidRequest([FieldViolation(f"tools[{i}].function.name", f"{clip(t.name)}: a call of it in this "
                                                 f"model's format ({parsers.tool.name}) would not read back as a call")])
    return parsers.tool.enforced(tools.tools, tools.choice, tools.parallel, specials=parsers.specials)


# ------------------------------------------------------------------ the history an agent loop sends


def message(i: int, m: dict, content: Any, role: Any, v: list[FieldViolation]) -> dict:
    """One chat message for the engine: role and content, plus an assistant's `tool_calls` and a
    tool result's `tool_call_id` (and `name`), checked for shape; a call's arguments stay the
    JSON text the client sent (the engine renders them as the template wants)."""
    out: dict[str, Any] = {"role": role, "content": content}
    calls = m.get("tool_calls")
    if calls is not None and calls != []:
        if role != "assistant":
            v.append(FieldViolation(f"messages[{i}].tool_calls", "only an assistant message carries tool_calls"))
        elif not isinstance(calls, list):
            v.append(FieldViolation(f"messages[{i}].tool_calls", "must be a list of tool calls"))
        else:
            out["tool_calls"] = [_call(f"messages[{i}].tool_calls[{k}]", c, v) for k, c in enumerate(calls)]
    if role == "tool":
        cid = m.get("tool_call_id")
        if not isinstance(cid, str) or not cid:
            v.append(FieldViolation(f"messages[{i}].tool_call_id", "a tool message names the call it answers"))
        out["tool_call_id"] = cid
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out


def name_results(messages: list[dict]) -> list[dict]:
    """A tool message without a `name` gets its call's function name, from the assistant message
    that made the call (templates such as Gemma 4's write the function's name beside a result)."""
    names: dict[str, str] = {}
    for m in messages:
        for c in m.get("tool_calls") or ():
            if c.get("id") and isinstance(c["function"].get("name"), str):
                names[c["id"]] = c["function"]["name"]
        if m.get("role") == "tool" and "name" not in m and m.get("tool_call_id") in names:
            m["name"] = names[m["tool_call_id"]]
    return messages


def _call(field: str, c: Any, v: list[FieldViolation]) -> dict:
    fn = c.get("function") if isinstance(c, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    args = fn.get("arguments", "{}") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        v.append(FieldViolation(f"{field}.function.name", "must be the called function's name"))
    if isinstance(args, dict):  # some clients send the object itself: measured before it is written out
        import json

        from celeris.engine.requests import MAX_JSON_NESTING, value_depth

        if value_depth(args, MAX_JSON_NESTING) > MAX_JSON_NESTING:
            v.append(FieldViolation(f"{field}.function.arguments",
                                    f"nests arrays and objects more than {MAX_JSON_NESTING} deep"))
            args = "{}"
        else:
            args = json.dumps(args, ensure_ascii=False)
    if not isinstance(args, str):
        v.append(FieldViolation(f"{field}.function.arguments", "must be a JSON string"))
    if isinstance(c, dict) and c.get("type", "function") != "function":
        v.append(FieldViolation(f"{field}.type", f"must be \"function\", got {clip(c.get('type'))}"))
    cid = c.get("id") if isinstance(c, dict) else None
    return {"id": cid if isinstance(cid, str) else "", "type": "function",
            "function": {"name": name, "arguments": args}}




def reader(tools: Optional[ToolRequest], parsers: Parsers):
    """How a chat request's answers are read: its tool calls when its tools are parsed, its
    reasoning whenever this server has a reasoning parser."""
    from celeris.server.tool_answers import AnswerReader

    parsed = tools is not None and tools.parsed
    return AnswerReader(parsers.tool if parsed else None, parsers.reasoning,
                        tools.parallel if tools is not None else True, parsers.reasoning is not None,
                        frozenset(t.name for t in tools.tools) if parsed else None)


__all__ = ["ToolRequest", "Parsers", "check_names", "resolve", "from_body", "check_structured", "plan", "message",
           "reader"]
