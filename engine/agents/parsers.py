"""Tool-call parsers, one per chat format (vLLM's `--tool-call-parser`): a table by name.

A parser reads a finished generation's text (`extract`: the content left over and the calls; a
call that does not parse stays in the content as text, nothing raises) and writes the structure
that enforces a call (`enforced`: the family's call syntax around arguments valid under the
function's parameters schema, as an llguidance lark grammar with `%json {schema}` arguments, served
on the structured-outputs whole-document path).

- "hermes": Qwen2.5/Qwen3 templates (SDAR and Dream ship them) and celeris-tiny's own template:
  `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`, several separated by "\\n".
- "llada2": LLaDA2.x inherits Ling-2.0's (BailingMoeV2) template: turns `<role>HUMAN</role>...
  <|role_end|>`, calls in the same `<tool_call>` JSON form, results as `<role>OBSERVATION</role>`
  `<tool_response>` blocks. Ling-3's `<tool_call>NAME\\n<arg_key>k</arg_key>\\n<arg_value>v
  </arg_value>\\n</tool_call>` form is read too; enforcement writes the JSON form.
- "gemma": DiffusionGemma (Gemma 4): `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>`
  (gemma_format.py); arguments are converted to JSON text.
"""

from __future__ import annotations

import json
import re
from typing import Callable, Mapping, Optional, Sequence

from celeris.engine.agents import gemma_format
from celeris.engine.agents.tools import Tool, ToolCall, ToolChoice, args_schema, new_call_id
from celeris.engine.structured.constraint import GRAMMAR, Structured

MAX_CALLS = 64  # calls read from one generation; the rest stay in the content


def _lit(text: str) -> str:
    """A lark string literal of `text` (JSON escapes, which llguidance's lark reads)."""
    return json.dumps(text)


def literal(text: str, specials: Mapping[str, int]) -> str:
    """The lark expression of fixed text whose markers may be special tokens (`specials`: a
    special token's text -> its id): those are written as llguidance token references `<[id]>`
    (a text literal never matches a special token), the rest as string literals."""
    if not specials:
        return _lit(text)
    hits = sorted((m for m in specials if m and m in text), key=len, reverse=True)
    if not hits:
        return _lit(text)
    parts = re.split("(" + "|".join(re.escape(m) for m in hits) + ")", text)
    return " ".join(f"<[{specials[p]}]>" if p in specials else _lit(p) for p in parts if p)


class ToolParser:
    """One chat format's tool calls. Subclasses set `name`, `_call` (a regex whose match is one
    call, groups read by `_read`) and `_syntax` (the lark body of one call of a tool)."""

    name = ""
    separator = "\n"  # between parallel calls
    preamble = ""  # text an enforced generation may start with before its calls
    marker = "<tool_call>"  # the text a call opens with (a special token in some vocabularies)
    _call: re.Pattern

    def extract(self, text: str, names: Optional[set] = None) -> tuple[str, list[ToolCall]]:
        """(content, calls): every well-formed call (naming a tool in `names` when given) taken out
        of the text; anything else, malformed calls included, stays in the content."""
        calls: list[ToolCall] = []
        kept, last = [], 0
        for m in self._call.finditer(text):
            if len(calls) >= MAX_CALLS:
                break
            read = self._read(m)
            if read is None or (names is not None and read[0] not in names):
                continue
            calls.append(ToolCall(new_call_id(), read[0], json.dumps(read[1], ensure_ascii=False)))
            kept.append(text[last:m.start()])
            last = m.end()
        kept.append(text[last:])
        return "".join(kept).strip() if calls else text, calls

    def _read(self, m: re.Match) -> Optional[tuple[str, dict]]:  # pragma: no cover - abstract
        raise NotImplementedError

    def render(self, name: str, arguments: dict) -> str:  # pragma: no cover - abstract
        """One call as the family's template writes it (tests, docs)."""
        raise NotImplementedError

    def _syntax(self, tool: Tool, rule: str, lit: Callable[[str], str]) -> tuple[str, list[str]]:  # pragma: no cover
        """(the lark expression of one call of `tool`, the extra rules it needs), rules named from
        `rule`, fixed text written by `lit`."""
        raise NotImplementedError

    def grammar(self, tools: Sequence[Tool], choice: ToolChoice, parallel: bool,
                specials: Mapping[str, int] = {}) -> str:
        """The lark grammar of what `choice` allows: a call of the named tool, or (required) of
        any one of them; with `parallel` under required, one or more calls. `specials` (a special
        token's text -> id, `Tokenizer.special_markers`) makes markers that are special tokens
        in the model's vocabulary match those tokens."""
        if choice.mode == "function":
            pick = [t for t in tools if t.name == choice.name]
        elif choice.mode == "required":
            pick = list(tools)
        else:
            raise ValueError(f"tool_choice {choice.mode!r} is not enforced")
        calls, preamble, lines = self._calls(pick, parallel and choice.mode == "required", specials)
        return "\n".join([f"start: {preamble}{calls}", *lines])

    def _calls(self, pick: Sequence[Tool], many: bool, specials: Mapping[str, int]) -> tuple[str, str, list[str]]:
        """(the expression of the calls, of the optional preamble before them or "", the rules
        they use) for calls of the tools in `pick`: one call, or with `many` one or more."""
        if not pick:
            raise ValueError("no tool to enforce")
        lit = lambda text: literal(text, specials)  # noqa: E731
        lines, alts = [], []
        for i, tool in enumerate(pick):
            body, extra = self._syntax(tool, f"t{i}", lit)
            lines.append(f"call_t{i}: {body}")
            lines += extra
            alts.append(f"call_t{i}")
        sep = f"{lit(self.separator)} " if self.separator else ""
        calls = f"call ({sep}call)*" if many else "call"
        # e.g. Gemma's empty thinking channel, written even with thinking off
        preamble = f"({lit(self.preamble)})? " if self.preamble else ""
        return calls, preamble, ["call: " + " | ".join(alts), *lines]

    def lazy(self, tools: Sequence[Tool], parallel: bool, specials: Mapping[str, int] = {},
             field: str = "tools") -> Structured:
        """tool_choice "auto" as a structure the model may decline (llama.cpp's lazy grammar): the
        answer is either text that never holds the call marker, or one call (with `parallel`, one
        or more) of the listed tools under their schemas. Decoded from the front, the first
        position decides between the two: the model's own choice of the marker's first token
        against every other token (the stop token included: an empty answer); once the marker
        is chosen the rest is the enforced call. So no call under "auto" is malformed, and no call
        hides in the text. `room_text`: two calls (one without `parallel`) of the longest tool,
        the canvas a request that set no length is fitted to."""
        calls, preamble, lines = self._calls(list(tools), parallel, specials)
        marker = re.escape(self.marker).replace("/", "\\/")
        # Text: at least one character, never the marker anywhere (llguidance's regex `&` and `~`).
        text = f"TEXT: /(.|\\n)+/ & ~/(.|\\n)*{marker}(.|\\n)*/"
        grammar = "\n".join([f"start: {preamble}(TEXT | calls)?", f"calls: {calls}", *lines, text])
        args = {t.name: self.render(t.name, _sample_args(t.parameters)) for t in tools}
        one = max(args.values(), key=len)
        return Structured(GRAMMAR, grammar, field, lazy=True,
                          room_text=self.separator.join([one] * (2 if parallel else 1)))

    def enforced(self, tools: Sequence[Tool], choice: ToolChoice, parallel: bool,
                 field: str = "tools", specials: Mapping[str, int] = {}) -> Structured:
        """The structured output that makes the generation exactly a call (or calls) per `choice`
        (`specials`: see `grammar`; pass the model tokenizer's `special_markers`)."""
        where = field
        if choice.mode == "function":
            where = f"{field}[{[t.name for t in tools].index(choice.name)}].function.parameters"
        return Structured(GRAMMAR, self.grammar(tools, choice, parallel, specials), where)


class HermesParser(ToolParser):
    """Enforced arguments are written with ", " and ": " as the templates' `tojson` writes them
    (what the model saw in its history), no other whitespace."""

    name = "hermes"
    _call = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def _read(self, m: re.Match) -> Optional[tuple[str, dict]]:
        return _json_call(m.group(1))

    def render(self, name: str, arguments: dict) -> str:
        args = json.dumps(arguments, ensure_ascii=False)
        return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'

    def _syntax(self, tool: Tool, rule: str, lit: Callable[[str], str]) -> tuple[str, list[str]]:
        head = lit(f'<tool_call>\n{{"name": "{tool.name}", "arguments": ')
        return f"{head} args_{rule} {lit(chr(125) + chr(10) + '</tool_call>')}", \
            [f"args_{rule}: %json {json.dumps(args_schema(tool.parameters, (', ', ': ')))}"]


def _sample_args(schema: dict) -> dict:
    """Arguments of a typical length for `schema`: each required property a 12-letter string
    (how long a call usually is, for sizing a canvas; never decoded)."""
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = [k for k in schema.get("required", []) if isinstance(k, str)] or list(props)[:1]
    return {k: "Abcdefghijkl" for k in required}


def _json_call(body: str) -> Optional[tuple[str, dict]]:
    """(name, arguments) of a `{"name": ..., "arguments": {...}}` body, or None."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None


class LLaDA2Parser(HermesParser):
    name = "llada2"
    _pair = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
    _fname = re.compile(r"[a-zA-Z0-9_-]{1,64}")

    def _read(self, m: re.Match) -> Optional[tuple[str, dict]]:
        body = m.group(1)
        if body.startswith("{"):
            return _json_call(body)
        name, _, rest = body.partition("\n")  # Ling-3: NAME then <arg_key>/<arg_value> pairs
        if not self._fname.fullmatch(name.strip()) or self._pair.sub("", rest).strip():
            return None
        args = {}
        for k, v in self._pair.findall(rest):
            try:
                args[k.strip()] = json.loads(v)
            except ValueError:
                args[k.strip()] = v
        return name.strip(), args


class GemmaParser(ToolParser):
    name = "gemma"
    separator = ""  # Gemma 4 writes calls back to back
    marker = "<|tool_call>"
    preamble = "<|channel>thought\n<channel|>"  # the empty thinking channel (reasoning.py splits it off)
    _call = re.compile(r"<\|tool_call>call:([a-zA-Z0-9_-]{1,64})(.*?)<tool_call\|>", re.DOTALL)

    def _read(self, m: re.Match) -> Optional[tuple[str, dict]]:
        args = gemma_format.parse(m.group(2))
        return (m.group(1), args) if isinstance(args, dict) else None

    def render(self, name: str, arguments: dict) -> str:
        return f"<|tool_call>call:{name}{gemma_format.dump(arguments)}<tool_call|>"

    def _syntax(self, tool: Tool, rule: str, lit: Callable[[str], str]) -> tuple[str, list[str]]:
        rules = gemma_format.Rules(tool.parameters, rule, lit)
        top = rules.value(tool.parameters)
        return f"{lit('<|tool_call>call:' + tool.name)} {top} {lit('<tool_call|>')}", rules.lines


TOOL_PARSERS: dict[str, ToolParser] = {p.name: p for p in (HermesParser(), LLaDA2Parser(), GemmaParser())}

# Markers a chat template's text holds, most specific first: (marker test, parser name).
_DETECT: list[tuple[Callable[[str], bool], str]] = [
    (lambda t: "<|tool_call>" in t or "<|turn>" in t, "gemma"),
    (lambda t: "<role>ASSISTANT</role>" in t or "<|role_end|>" in t, "llada2"),
    (lambda t: "<tool_call>" in t, "hermes"),
]


def detect_tool_parser(chat_template: str) -> Optional[str]:
    """The parser a chat template's own markup implies, or None (no tool-call format found)."""
    if not isinstance(chat_template, str):
        return None
    return next((name for test, name in _DETECT if test(chat_template)), None)


__all__ = ["literal", "ToolParser", "TOOL_PARSERS", "detect_tool_parser", "HermesParser", "LLaDA2Parser", "GemmaParser"]
