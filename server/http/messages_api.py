"""POST /v1/messages: Anthropic's Messages API, mapped onto the chat completions path (api_shapes.py).

The request: `messages` (user and assistant turns, content a string or blocks: `text`, an
assistant's `tool_use` {id, name, input}, a user's `tool_result` {tool_use_id, content, is_error}),
`system` (a string or text blocks: a system message first), `tools` ({name, description,
input_schema}), `tool_choice` ({"type": "auto" | "any" | "tool" (with `name`) | "none"},
`disable_parallel_tool_use`), `max_tokens` (the canvas length), `temperature`, `top_p`, `top_k`,
`stop_sequences`, `stream`, and Celeris's own knobs (api_shapes.PASSTHROUGH, `diffusing` for the
live canvas). `metadata`, `service_tier` and `thinking: {"type": "disabled"}` are accepted and
change nothing. The key may come as `x-api-key` (Anthropic's header) or `Authorization: Bearer`.

The answer: a `message` whose `content` holds a `thinking` block (where a reasoning parser is on),
a `text` block, then a `tool_use` block per call (`input` the arguments as an object);
`stop_reason` "end_turn", "stop_sequence" (with `stop_sequence`), "max_tokens" or "tool_use".
Streamed: `message_start`, per block `content_block_start`, `content_block_delta`s (`text_delta`,
`input_json_delta`, `thinking_delta`), `content_block_stop`, then `message_delta` (stop reason,
output tokens) and `message_stop`; with `diffusing`, `celeris.canvas` events carry the live
canvas beside them (Anthropic's SDKs skip events they do not know). Errors come in Anthropic's
shape: `{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}`.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional

from aiohttp import web

from celeris.engine.errors import FieldViolation, InvalidRequest, clip
from celeris.engine.events import StepEvent
from celeris.server.http.api_shapes import (PASSTHROUGH, Folded, Piece, Shape, check_fields, event, final_pieces, pieces,
                                       text_of, usage_of)

KNOWN = frozenset(("model", "messages", "system", "tools", "tool_choice", "max_tokens", "temperature", "top_p",
                   "top_k", "stop_sequences", "stream", "metadata", "service_tier", *PASSTHROUGH))
NEUTRAL = {"thinking": ({"type": "disabled"},)}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
STOP = {"tool_calls": "tool_use", "length": "max_tokens"}


def _tool(i: int, t: Any, v: list[FieldViolation]) -> dict:
    """An Anthropic tool as chat's `{"type": "function", "function": {...}}`."""
    if not isinstance(t, dict) or t.get("type", "custom") != "custom":
        got = t.get("type") if isinstance(t, dict) else t
        v.append(FieldViolation(f"tools[{i}]", f"only client tools ({{name, description, input_schema}}) are "
                                               f"served here, got {clip(got)}"))
        return {"type": "function", "function": {"name": "_"}}
    fn = {"name": t.get("name"), "parameters": t.get("input_schema")}
    if t.get("description") is not None:
        fn["description"] = t["description"]
    return {"type": "function", "function": fn}


def _tool_choice(x: Any, out: dict, v: list[FieldViolation]) -> None:
    """Anthropic's tool_choice as chat's `tool_choice` and `parallel_tool_calls`."""
    if x is None:
        return
    kind = x.get("type") if isinstance(x, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        v.append(FieldViolation("tool_choice", f"must be {{\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}}, "
                                               f"got {clip(x)}"))
        return
    out["tool_choice"] = ({"type": "function", "function": {"name": x.get("name")}} if kind == "tool"
                          else {"any": "required"}.get(kind, kind))
    if x.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False


class MessagesShape(Shape):
    def __init__(self) -> None:
        super().__init__()
        self.model: Optional[str] = None
        self.renames = [(r"^tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"),
                        (r"^tools\[(\d+)\]\.function", r"tools[\1]"), (r"^stop$", "stop_sequences"),
                        (r"^tool_choice\.function", "tool_choice")]

    # ------------------------------------------------------------------ the request

    def request(self, body: Any) -> dict:
        if not isinstance(body, dict):
            raise InvalidRequest([FieldViolation("body", "must be a JSON object")])
        v: list[FieldViolation] = []
        check_fields(body, KNOWN, NEUTRAL, v)
        out: dict[str, Any] = {"messages": self._messages(body, v)}
        for name in ("model", "max_tokens", "temperature", "top_p", "top_k", "stream", *PASSTHROUGH):
            if body.get(name) is not None:
                out[name] = body[name]
        if body.get("stop_sequences") is not None:
            out["stop"] = body["stop_sequences"]
        tools = body.get("tools")
        if tools is not None:
            if isinstance(tools, list):
                out["tools"] = [_tool(i, t, v) for i, t in enumerate(tools)]
            else:
                v.append(FieldViolation("tools", f"must be a list of tools, got {clip(tools)}"))
        _tool_choice(body.get("tool_choice"), out, v)
        if v:
            raise InvalidRequest(v)
        self.model = body.get("model")
        return out

    def _messages(self, body: dict, v: list[FieldViolation]) -> list[dict]:
        out: list[dict] = []
        if body.get("system") is not None:
            out.append({"role": "system", "content": text_of(body["system"], "system", ("text",), v)})
            self.origin.append("system")
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            v.append(FieldViolation("messages", f"must be a non-empty list of messages, got {clip(msgs)}"))
            return out
        for i, m in enumerate(msgs):
            for msg in self._turn(f"messages[{i}]", m, v):
                out.append(msg)
                self.origin.append(f"messages[{i}]")
        return out

    @staticmethod
    def _turn(where: str, m: Any, v: list[FieldViolation]) -> list[dict]:
        """One Anthropic turn as chat messages: a user turn's tool results become `tool` messages
        (first, as they answer the calls before them), an assistant's tool_use blocks its tool_calls."""
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            v.append(FieldViolation(f"{where}.role", f"must be user or assistant, got {clip(role)}"))
            return []
        content = m.get("content")
        if isinstance(content, str):
            return [{"role": role, "content": content}]
        if not isinstance(content, list):
            v.append(FieldViolation(f"{where}.content", f"must be a string or a list of blocks, got {clip(content)}"))
            return []
        texts, calls, results = [], [], []
        for k, b in enumerate(content):
            kind, at = b.get("type") if isinstance(b, dict) else None, f"{where}.content[{k}]"
            if kind == "text" and isinstance(b.get("text"), str):
                texts.append(b["text"])
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": b.get("id"), "type": "function",
                              "function": {"name": b.get("name"), "arguments": b.get("input", {})}})
            elif kind == "tool_result" and role == "user":
                text = text_of(b.get("content", ""), f"{at}.content", ("text",), v)
                text = "Error: " + text if b.get("is_error") is True else text
                results.append({"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": text})
            elif kind not in ("thinking", "redacted_thinking"):  # earlier thinking is not shown again
                v.append(FieldViolation(f"{at}.type", f"{clip(kind)}: a {role} turn here takes text"
                                        f"{', tool_use' if role == 'assistant' else ', tool_result'} blocks"))
        if role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
            return [msg | {"tool_calls": calls}] if calls else [msg]
        return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])

    # ------------------------------------------------------------------ the answer

    def message(self, rid: str, model: str, folded: Folded, ev: StepEvent, celeris: Any = None) -> dict:
        content: list[dict] = []
        if folded.reasoning:
            content.append({"type": "thinking", "thinking": folded.reasoning, "signature": ""})
        if folded.text or not folded.calls:
            content.append({"type": "text", "text": folded.text})
        content += [tool_use(c) for c in folded.calls]
        reason, sequence = stop_reason(folded.finish, ev)
        prompt, gen, cached = usage_of(ev)
        out = {"id": "msg_" + rid, "type": "message", "role": "assistant", "model": self.model or model,
               "content": content, "stop_reason": reason, "stop_sequence": sequence,
               "usage": {"input_tokens": prompt, "output_tokens": gen, "cache_read_input_tokens": cached,
                         "cache_creation_input_tokens": 0}}
        return out | ({"celeris": celeris} if celeris is not None else {})

    def final(self, chat: dict, ev: StepEvent) -> dict:
        folded = Folded()
        for p in final_pieces(chat):
            folded.add(p)
        return self.message(chat["id"].removeprefix("chatcmpl-"), chat["model"], folded, ev, chat.get("celeris"))

    def encoder(self, request_id: str) -> Callable[[dict, StepEvent], bytes]:
        return MessagesStream(self, request_id).encode

    def error_body(self, status: int, body: dict) -> dict:
        err = body["error"]
        return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": err["message"],
                                           **({"param": err["param"]} if err.get("param") else {})}}

    def error_event(self, exc: BaseException) -> bytes:
        from celeris.server.errors import to_openai

        status, body, _ = to_openai(exc)
        return event("error", self.error_body(status, body))


def stop_reason(finish: Optional[str], ev: StepEvent) -> tuple[str, Optional[str]]:
    """Anthropic's (stop_reason, stop_sequence) of a chat finish reason."""
    if finish == "stop" and ev.stop_text:
        return "stop_sequence", ev.stop_text
    return STOP.get(finish or "", "end_turn"), None


def tool_use(call: list) -> dict:
    cid, name, args = call
    try:
        value = json.loads(args)
    except ValueError:  # a parsed call's arguments are JSON; kept whole if ever not
        value = {"arguments": args}
    return {"type": "tool_use", "id": "toolu_" + cid.removeprefix("call_"), "name": name,
            "input": value if isinstance(value, dict) else {"value": value}}


class MessagesStream:
    """The events of one streamed message, built from its chat chunks in order."""

    def __init__(self, shape: MessagesShape, rid: str):
        self.shape, self.rid = shape, rid
        self.folded = Folded()
        self.open: Optional[str] = None  # the kind of the block being written
        self.index = -1
        self.started = False

    def encode(self, chunk: dict, ev: StepEvent) -> bytes:
        out: list[bytes] = []
        if not self.started:
            self.started = True
            start = self.shape.message(self.rid, chunk.get("model", ""), Folded(), ev) | {
                "content": [], "stop_reason": None, "stop_sequence": None}
            start["usage"]["output_tokens"] = 0
            out.append(event("message_start", {"type": "message_start", "message": start}))
        for p in pieces(chunk):
            out += self.piece(p, ev, chunk)
        return b"".join(out)

    def block(self, kind: str, start: dict) -> list[bytes]:
        out = self.close()
        self.open, self.index = kind, self.index + 1
        return out + [event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                     "content_block": start})]

    def delta(self, delta: dict) -> bytes:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def piece(self, p: Piece, ev: StepEvent, chunk: dict) -> list[bytes]:
        out: list[bytes] = []
        self.folded.add(p)
        if p.kind == "canvas":
            out.append(event("celeris.canvas", {"type": "celeris.canvas", "celeris": p.data}))
        elif p.kind == "reasoning":
            if self.open != "thinking":
                out += self.block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self.delta({"type": "thinking_delta", "thinking": p.text}))
        elif p.kind == "text":
            if self.open != "text":
                out += self.block("text", {"type": "text", "text": ""})
            out.append(self.delta({"type": "text_delta", "text": p.text}))
        elif p.kind == "call":
            out += self.block("tool_use", tool_use([p.call_id, p.text, "{}"]))
        elif p.kind == "args":
            out.append(self.delta({"type": "input_json_delta", "partial_json": p.text}))
        elif p.kind == "end":
            out += self.close()
            reason, sequence = stop_reason(p.data, ev)
            out += [event("message_delta", {"type": "message_delta",
                                            "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                            "usage": {"output_tokens": len(ev.generated)}}),
                    event("message_stop", {"type": "message_stop"})]
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"type": "content_block_stop", "index": self.index})]


async def create(gw: Any, request: web.Request) -> web.StreamResponse:
    """POST /v1/messages: the chat path with this API's shape."""
    return await gw.complete(request, chat=True, shape=MessagesShape())


# Its request body in /openapi.json (components.schemas.MessagesRequest); Celeris's knobs ride beside it.
SCHEMA = {"type": "object", "required": ["messages"], "properties": {
    "model": {"type": "string"}, "messages": {"type": "array", "items": {"type": "object", "required": ["role"]}},
    "system": {"anyOf": [{"type": "string"}, {"type": "array"}]}, "max_tokens": {"type": "integer"},
    "tools": {"type": "array", "items": {"type": "object", "required": ["name"]}},
    "tool_choice": {"type": "object", "properties": {"type": {"enum": ["auto", "any", "tool", "none"]}}},
    "temperature": {"type": "number"}, "top_p": {"type": "number"}, "top_k": {"type": "integer"},
    "stop_sequences": {"type": "array", "items": {"type": "string"}}, "stream": {"type": "boolean", "default": False}}}
