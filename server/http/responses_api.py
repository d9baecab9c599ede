"""POST /v1/responses: OpenAI's Responses API, mapped onto the chat completions path (api_shapes.py).

The request: `input` (a string, or items: messages of role user, system, developer or assistant
with text parts; `function_call` items, the model's earlier calls; `function_call_output` items,
their results), `instructions` (a system message first), function `tools` (flat:
`{"type": "function", "name", "description", "parameters", "strict"}`), `tool_choice`,
`parallel_tool_calls`, `max_output_tokens` (the canvas length, as chat's `max_tokens`),
`temperature`, `top_p`, `text.format` (`text`, `json_object`, `json_schema`: chat's
`response_format`), `stream`, and Celeris's own knobs (api_shapes.PASSTHROUGH: `seed`, `steps`,
`diffusing` for the live canvas, ...). Nothing is stored: `previous_response_id` and
`conversation` are refused by field (send the whole conversation as input items, as the Agents
SDK does by default); `store`, `metadata`, `user`, `reasoning`, `prompt_cache_key`,
`safety_identifier`, `service_tier` are accepted and change nothing.

The answer: a `response` object whose `output` holds a `reasoning` item (where a reasoning parser
is on), a `message` item with one `output_text` part, then a `function_call` item per call;
`status` "incomplete" (`incomplete_details.reason: "max_output_tokens"`) when the canvas ran out.
Streamed: `response.created`, `response.in_progress`, then per item `response.output_item.added`,
its text (`response.content_part.added`, `response.output_text.delta`s, `..._text.done`,
`response.content_part.done`) or arguments (`response.function_call_arguments.delta`s, `.done`),
`response.output_item.done`, and `response.completed` (or `response.incomplete`) with the whole
response; every event numbered (`sequence_number`). With `diffusing`, `celeris.canvas` events
carry the chat stream's `celeris` objects (the live canvas) beside them.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from aiohttp import web

from celeris.engine.errors import FieldViolation, InvalidRequest, clip
from celeris.engine.events import StepEvent
from celeris.server.http.api_shapes import (PASSTHROUGH, Folded, Piece, Shape, check_fields, event, final_pieces, pieces,
                                       text_of, usage_of)

KNOWN = frozenset(("model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
                   "max_output_tokens", "temperature", "top_p", "stream", "text", "store", "metadata", "user",
                   "include", "reasoning", "prompt_cache_key", "safety_identifier", "service_tier", *PASSTHROUGH))
NEUTRAL = {"truncation": ("disabled",), "top_logprobs": (0,), "background": (False,), "stream_options": ({},),
           "max_tool_calls": ()}
NOT_STORED = ("previous_response_id", "conversation", "prompt")
TEXT_PARTS = ("input_text", "output_text", "text")
IGNORED_INCLUDES = ("reasoning.encrypted_content",)  # nothing is encrypted here: asking for it adds nothing


def _tool(i: int, t: Any, v: list[FieldViolation]) -> dict:
    """A Responses function tool (flat) as chat's `{"type": "function", "function": {...}}`."""
    if not isinstance(t, dict) or t.get("type") != "function":
        got = t.get("type") if isinstance(t, dict) else t
        v.append(FieldViolation(f"tools[{i}].type", f"only function tools are served here, got {clip(got)}"))
        return {"type": "function", "function": {"name": "_"}}
    fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
    return {"type": "function", "function": fn}


def _tool_choice(x: Any, v: list[FieldViolation]) -> Any:
    if x is None or isinstance(x, str):
        return x
    if isinstance(x, dict) and x.get("type") == "function":
        return {"type": "function", "function": {"name": x.get("name")}}
    v.append(FieldViolation("tool_choice", f"must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                                           f"\"name\": ...}}, got {clip(x)}"))
    return None


def _format(text: Any, v: list[FieldViolation]) -> Optional[dict]:
    """`text.format` as chat's `response_format`."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        v.append(FieldViolation("text", f"takes `format` (and `verbosity`), got {clip(text)}"))
        return None
    fmt = text.get("format")
    if fmt is None or not isinstance(fmt, dict):
        return None if fmt is None else v.append(FieldViolation("text.format", f"must be an object, got {clip(fmt)}"))
    if fmt.get("type") == "json_schema":
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    return dict(fmt)


class ResponsesShape(Shape):
    def __init__(self) -> None:
        super().__init__()
        self.created = int(time.time())
        self.echo: dict[str, Any] = {}  # request fields the response object repeats
        self.renames = [(r"^tools\[(\d+)\]\.function", r"tools[\1]"), (r"^max_tokens", "max_output_tokens"),
                        (r"^max_completion_tokens", "max_output_tokens"),
                        (r"^response_format\.json_schema", "text.format"), (r"^response_format", "text.format"),
                        (r"^tool_choice\.function", "tool_choice")]

    # ------------------------------------------------------------------ the request

    def request(self, body: Any) -> dict:
        if not isinstance(body, dict):
            raise InvalidRequest([FieldViolation("body", "must be a JSON object")])
        v: list[FieldViolation] = []
        for name in NOT_STORED:
            if body.get(name) is not None:
                v.append(FieldViolation(name, "this server stores no responses or conversations: send the whole "
                                              "conversation as `input` items"))
        include = body.get("include")
        if include is not None and (not isinstance(include, list) or set(include) - set(IGNORED_INCLUDES)):
            v.append(FieldViolation("include", f"nothing more can be included here, got {clip(include)}"))
        check_fields({k: x for k, x in body.items() if k not in NOT_STORED}, KNOWN, NEUTRAL, v)
        messages = self._messages(body, v)
        out: dict[str, Any] = {"messages": messages}
        for name in ("model", "temperature", "top_p", "stream", "parallel_tool_calls", *PASSTHROUGH):
            if body.get(name) is not None:
                out[name] = body[name]
        if body.get("max_output_tokens") is not None:
            out["max_tokens"] = body["max_output_tokens"]
        tools = body.get("tools")
        if tools is not None:
            if isinstance(tools, list):
                out["tools"] = [_tool(i, t, v) for i, t in enumerate(tools)]
            else:
                v.append(FieldViolation("tools", f"must be a list of function tools, got {clip(tools)}"))
        if (choice := _tool_choice(body.get("tool_choice"), v)) is not None:
            out["tool_choice"] = choice
        # A forced call's answer is the call, with no text for `text.format` to shape: the format
        # applies to the turns that answer in text (the Agents SDK sends both on every turn).
        forced = out.get("tool_choice") == "required" or isinstance(out.get("tool_choice"), dict)
        if (fmt := _format(body.get("text"), v)) is not None and not forced:
            out["response_format"] = fmt
        if v:
            raise InvalidRequest(v)
        self.echo = {k: body.get(k) for k in ("instructions", "tool_choice", "temperature", "top_p",
                                              "max_output_tokens", "metadata")}
        self.echo |= {"tools": tools or [], "parallel_tool_calls": body.get("parallel_tool_calls", True),
                      "text": body.get("text") or {"format": {"type": "text"}}, "model": body.get("model")}
        self.echo["tool_choice"] = self.echo["tool_choice"] or "auto"
        return out

    def _messages(self, body: dict, v: list[FieldViolation]) -> list[dict]:
        """`instructions` and `input` as chat messages; `self.origin` remembers each one's item."""
        out: list[dict] = []
        if body.get("instructions") is not None:
            out.append({"role": "system", "content": text_of(body["instructions"], "instructions", TEXT_PARTS, v)})
            self.origin.append("instructions")
        items = body.get("input")
        if isinstance(items, str):
            items = [{"role": "user", "content": items}]
        elif not isinstance(items, list) or not items:
            v.append(FieldViolation("input", f"must be a string or a non-empty list of items, got {clip(items)}"))
            return out
        for i, item in enumerate(items):
            msg = self._item(f"input[{i}]", item, out, v)
            if msg is not None:
                out.append(msg)
                self.origin.append(f"input[{i}]")
        return out

    @staticmethod
    def _item(where: str, item: Any, out: list[dict], v: list[FieldViolation]) -> Optional[dict]:
        """One input item as a chat message (None: it joined the previous one, or carries nothing)."""
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                v.append(FieldViolation(f"{where}.role", f"must be user, system, developer or assistant, "
                                                         f"got {clip(role)}"))
            content = text_of(item.get("content"), f"{where}.content", TEXT_PARTS, v)
            return {"role": "system" if role == "developer" else role, "content": content}
        if kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # calls after the text they came with
                last.setdefault("tool_calls", []).append(call)
                return None
            return {"role": "assistant", "content": None, "tool_calls": [call]}
        if kind == "function_call_output":
            output = text_of(item.get("output"), f"{where}.output", TEXT_PARTS, v)
            return {"role": "tool", "tool_call_id": item.get("call_id"), "content": output}
        if kind == "reasoning":  # the model's earlier thinking: not shown to it again (as chat templates do)
            return None
        v.append(FieldViolation(f"{where}.type", f"must be message, function_call, function_call_output or "
                                                 f"reasoning, got {clip(kind if kind is not None else item)}"))
        return None

    # ------------------------------------------------------------------ the answer

    def response(self, rid: str, folded: Folded, ev: Optional[StepEvent], celeris: Any = None) -> dict:
        """The `response` object: in progress (no event yet) or finished."""
        status, incomplete = "in_progress", None
        if folded.finish is not None:
            status = {"length": "incomplete", "cancelled": "cancelled"}.get(folded.finish, "completed")
            incomplete = {"reason": "max_output_tokens"} if folded.finish == "length" else None
        out = {"id": "resp_" + rid, "object": "response", "created_at": self.created, "status": status,
               "error": None, "incomplete_details": incomplete, "output": self.items(rid, folded),
               "previous_response_id": None, "reasoning": None, "store": False, "truncation": "disabled",
               "usage": None, **self.echo}
        if ev is not None and folded.finish is not None:
            prompt, gen, cached = usage_of(ev)
            out["usage"] = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                            "output_tokens": gen, "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": prompt + gen}
        if celeris is not None:
            out["celeris"] = celeris
        return out

    @staticmethod
    def items(rid: str, folded: Folded, done: bool = True) -> list[dict]:
        status = "completed" if done else "in_progress"
        out: list[dict] = []
        if folded.reasoning:
            out.append({"type": "reasoning", "id": "rs_" + rid, "summary": [],
                        "content": [{"type": "reasoning_text", "text": folded.reasoning}]})
        if folded.text or not folded.calls:
            out.append(message_item(rid, folded.text, status))
        out += [call_item(c, status) for c in folded.calls]
        return out

    def final(self, chat: dict, ev: StepEvent) -> dict:
        folded = Folded()
        for p in final_pieces(chat):
            folded.add(p)
        return self.response(chat["id"].removeprefix("chatcmpl-"), folded, ev, chat.get("celeris"))

    def encoder(self, request_id: str) -> Callable[[dict, StepEvent], bytes]:
        return ResponsesStream(self, request_id).encode

    def error_event(self, exc: BaseException) -> bytes:
        from celeris.server.errors import to_openai

        err = to_openai(exc)[1]["error"]
        return event("error", {"type": "error", "code": err.get("code"), "message": err["message"],
                               "param": err.get("param"), "sequence_number": 0})


def message_item(rid: str, text: str, status: str) -> dict:
    return {"type": "message", "id": "msg_" + rid, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call: list, status: str) -> dict:
    cid, name, args = call
    return {"type": "function_call", "id": "fc_" + cid.removeprefix("call_"), "call_id": cid, "name": name,
            "arguments": args, "status": status}


class ResponsesStream:
    """The events of one streamed response, built from its chat chunks in order."""

    def __init__(self, shape: ResponsesShape, rid: str):
        self.shape, self.rid = shape, rid
        self.folded = Folded()
        self.seq = 0
        self.open: Optional[str] = None  # "text" or "call": the item being written
        self.index = -1  # its output_index
        self.started = False

    def emit(self, kind: str, **data: Any) -> bytes:
        self.seq += 1
        return event(kind, {"type": kind, "sequence_number": self.seq - 1, **data})

    def encode(self, chunk: dict, ev: StepEvent) -> bytes:
        out: list[bytes] = []
        if not self.started:
            self.started = True
            first = self.shape.response(self.rid, Folded(), None)
            out += [self.emit("response.created", response=first), self.emit("response.in_progress", response=first)]
        for p in pieces(chunk):
            out += self.piece(p, ev, chunk)
        return b"".join(out)

    def piece(self, p: Piece, ev: StepEvent, chunk: dict) -> list[bytes]:
        out: list[bytes] = []
        item_id = "msg_" + self.rid
        if p.kind == "canvas":
            return [self.emit("celeris.canvas", celeris=p.data)]
        if p.kind in ("call", "end", "reasoning") or (p.kind == "text" and self.open == "call"):
            out += self.close()
        if p.kind == "reasoning":
            self.folded.add(p)
            self.index += 1
            item = ResponsesShape.items(self.rid, Folded(reasoning=p.text))[0]
            out += [self.emit("response.output_item.added", output_index=self.index, item=item),
                    self.emit("response.output_item.done", output_index=self.index, item=item)]
        elif p.kind == "text":
            if self.open != "text":
                self.open, self.index = "text", self.index + 1
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                out += [self.emit("response.output_item.added", output_index=self.index,
                                  item=message_item(self.rid, "", "in_progress") | {"content": []}),
                        self.emit("response.content_part.added", item_id=item_id, output_index=self.index,
                                  content_index=0, part=part)]
            self.folded.add(p)
            out.append(self.emit("response.output_text.delta", item_id=item_id, output_index=self.index,
                                 content_index=0, delta=p.text, logprobs=[]))
        elif p.kind == "call":
            self.folded.add(p)
            self.open, self.index = "call", self.index + 1
            out.append(self.emit("response.output_item.added", output_index=self.index,
                                 item=call_item(self.folded.calls[-1], "in_progress")))
        elif p.kind == "args":
            self.folded.add(p)
            out.append(self.emit("response.function_call_arguments.delta", output_index=self.index,
                                 item_id=call_item(self.folded.calls[p.index], "")["id"], delta=p.text))
        elif p.kind == "end":
            self.folded.add(p)
            final = self.shape.response(self.rid, self.folded, ev, chunk.get("celeris"))
            name = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
                final["status"], "response.failed")
            out.append(self.emit(name, response=final))
        return out

    def close(self) -> list[bytes]:
        """The open item's closing events."""
        opened, self.open = self.open, None
        if opened == "text":
            item_id, text = "msg_" + self.rid, self.folded.text
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            return [self.emit("response.output_text.done", item_id=item_id, output_index=self.index,
                              content_index=0, text=text, logprobs=[]),
                    self.emit("response.content_part.done", item_id=item_id, output_index=self.index,
                              content_index=0, part=part),
                    self.emit("response.output_item.done", output_index=self.index,
                              item=message_item(self.rid, text, "completed"))]
        if opened == "call":
            item = call_item(self.folded.calls[-1], "completed")
            return [self.emit("response.function_call_arguments.done", item_id=item["id"], output_index=self.index,
                              name=item["name"], arguments=item["arguments"]),
                    self.emit("response.output_item.done", output_index=self.index, item=item)]
        return []


async def create(gw: Any, request: web.Request) -> web.StreamResponse:
    """POST /v1/responses: the chat path with this API's shape."""
    return await gw.complete(request, chat=True, shape=ResponsesShape())


# Its request body in /openapi.json (components.schemas.ResponsesRequest); Celeris's knobs ride beside it.
SCHEMA = {"type": "object", "required": ["input"], "properties": {
    "model": {"type": "string"}, "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
    "instructions": {"type": "string"}, "tools": {"type": "array", "items": {"type": "object", "required": ["type", "name"]}},
    "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]}, {"type": "object"}]},
    "parallel_tool_calls": {"type": "boolean", "default": True}, "max_output_tokens": {"type": "integer"},
    "temperature": {"type": "number"}, "top_p": {"type": "number"}, "stream": {"type": "boolean", "default": False},
    "text": {"type": "object", "properties": {"format": {"type": "object"}}}}}
