"""A chat answer read with this model's parsers: reasoning split out, tool calls parsed, in the
OpenAI shapes (non-streamed `message`, streamed `delta` chunks).

Only final text is read: the whole answer once the canvas has stopped. A diffusion canvas revises
until then, so no standard field ever carries provisional text; a stream sends the answer's
pieces as chunks at the end (`delta.reasoning_content`, `delta.content`, then each call as an
OpenAI `delta.tool_calls` chunk with its index, id, type and name, followed by its arguments in
pieces), and the live canvas rides beside them on the `diffusing` extension stream.

Call ids are derived from the request id, the choice and the call's index, so the streamed and
the non-streamed shapes of one answer carry the same ids by construction. A parser that fails on
what the model wrote leaves the text as content (an answer is never a 5xx).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Optional

import structlog

log = structlog.get_logger("celeris.http")
ARGUMENT_PIECE = 48  # characters of a call's arguments per streamed chunk


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    arguments: str  # JSON text

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Answer:
    content: Optional[str]  # None: the answer is its calls alone
    reasoning: Optional[str] = None
    calls: tuple[Call, ...] = field(default_factory=tuple)


def call_id(request_id: str, choice: int, k: int) -> str:
    """The id of call k of a choice: the same wherever the answer is shaped (stream or not)."""
    return "call_" + hashlib.sha256(f"{request_id}\0{choice}\0{k}".encode()).hexdigest()[:24]


def answer_text(tok: Any, generated: Any, stop_text: str = "") -> str:
    """The finished answer as the parsers read it, on both doors: its text with the chat format's
    markers kept (a tool-call or channel marker may be a special token), cut where a stop string
    begins."""
    text = tok.decode_markup(generated)
    return text[:text.find(stop_text)] if stop_text and stop_text in text else text


@dataclass(frozen=True)
class AnswerReader:
    """How one request's answers are read: its parsers (None: off) and parallel_tool_calls."""

    tool: Any = None  # engine.agents.parsers.ToolParser, only when the request's tools are parsed
    reasoning: Any = None  # engine.agents.reasoning.ReasoningParser
    parallel: bool = True
    reports_reasoning: bool = False  # message.reasoning_content is always present (null when none)
    names: Optional[frozenset] = None  # the request's tool names: a call of another name stays text

    def read(self, text: str, request_id: str, choice: int) -> Answer:
        reasoning, content = None, text
        if self.reasoning is not None:
            try:
                reasoning, content = self.reasoning.split(text)
            except Exception:  # noqa: BLE001 - a parser's failure leaves the text as it was
                log.warning("http.reasoning_parser_failed", request_id=request_id, exc_info=True)
                reasoning, content = None, text
        calls: list = []
        if self.tool is not None:
            try:
                content, calls = self.tool.extract(content, self.names)
            except Exception:  # noqa: BLE001 - malformed or unexpected: the text comes back as content
                log.warning("http.tool_parser_failed", request_id=request_id, exc_info=True)
                calls = []
        if not self.parallel:
            calls = calls[:1]
        out = tuple(Call(call_id(request_id, choice, k), c.name, c.arguments) for k, c in enumerate(calls))
        if out and content is not None and not content.strip():
            content = None
        return Answer(content, reasoning, out)


def message(answer: Answer, reader: AnswerReader) -> dict[str, Any]:
    """The non-streamed `message` of an answer."""
    msg: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if reader.reports_reasoning:
        msg["reasoning_content"] = answer.reasoning
    if answer.calls:
        msg["tool_calls"] = [c.openai() for c in answer.calls]
    return msg


def deltas(answer: Answer) -> list[dict[str, Any]]:
    """The streamed deltas of a final answer, in order (without the role, added by the caller)."""
    out: list[dict[str, Any]] = []
    if answer.reasoning:
        out.append({"reasoning_content": answer.reasoning})
    if answer.content:
        out.append({"content": answer.content})
    for k, c in enumerate(answer.calls):
        out.append({"tool_calls": [{"index": k, "id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": ""}}]})
        args = c.arguments
        for at in range(0, len(args), ARGUMENT_PIECE):
            out.append({"tool_calls": [{"index": k, "function": {"arguments": args[at:at + ARGUMENT_PIECE]}}]})
    return out


def finish_reason(answer: Answer, finish: Optional[str]) -> Optional[str]:
    """OpenAI's "tool_calls" when the answer called a tool (it ended by its own stop)."""
    return "tool_calls" if answer.calls and finish == "stop" else finish
