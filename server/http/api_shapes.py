"""Other APIs over the chat completions path: what /v1/responses (server/http/responses_api.py) and
/v1/messages (server/http/messages_api.py) share.

Neither API has a pipeline of its own. A `Shape` maps its request body into a chat completions
body, which then takes the one path every HTTP generation takes (`HttpGateway.complete`: the same
parser, limits, tool planning, lifecycle, scheduler and rate limit as /v1/chat/completions), and
maps back what that path builds: the final `chat.completion` body into its API's body, each stream
chunk into its API's events, an error into its API's error shape. Field names in a 400 are the
client's own (`rename`: `max_tokens` back to `max_output_tokens`, `messages[3]` back to the input
item it came from).

The stream side reads chat chunks as `Piece`s (text, a call's start, a call's argument fragment,
the live canvas, the end), so each API's encoder is a small state machine over pieces, and its
final body is built by folding the final chat body's pieces through the same `Folded` record.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from aiohttp import web

from celeris.engine.errors import FieldViolation, InvalidRequest, clip
from celeris.engine.events import StepEvent
from celeris.server.errors import to_openai

# Celeris's own body fields a shaped request may carry too (the diffusion knobs, seeds, the live canvas).
PASSTHROUGH = ("seed", "top_k", "min_p", "steps", "block_length", "threshold", "factor", "factor_rule", "schedule",
               "eps", "kv_cache", "cfg_scale", "remasking", "diffusing", "provisional", "ignore_eos", "min_tokens",
               "stop_token_ids", "cache_salt")
_MESSAGE_INDEX = re.compile(r"^messages\[(\d+)\]")


def api_key_bearer(raw_headers: Any) -> Optional[bytes]:
    """Anthropic's `x-api-key: KEY` as the `Authorization: Bearer KEY` the guard reads (None: absent)."""
    key = next((v for k, v in raw_headers if k.lower() == b"x-api-key"), None)
    return None if key is None else b"Bearer " + key


def event(name: str, data: dict) -> bytes:
    """One server-sent event with its name (both APIs name their events)."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


def text_of(content: Any, where: str, kinds: tuple[str, ...], v: list[FieldViolation]) -> str:
    """A content field as text: a string, or a list of text parts of the given `type`s, joined.
    Other parts (images, files, audio) are refused by field: this server reads text only."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        v.append(FieldViolation(where, f"must be a string or a list of text parts, got {clip(content)}"))
        return ""
    out = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            v.append(FieldViolation(f"{where}[{k}]", f"only text parts ({', '.join(kinds)}) are served here, "
                                                     f"got {clip(kind if kind is not None else part)}"))
            continue
        out.append(part["text"])
    return "".join(out)


def check_fields(body: dict, known: frozenset, neutral: dict[str, tuple], v: list[FieldViolation]) -> None:
    """Unknown keys are refused by name (a typo is named, not ignored); keys this server cannot
    honour are refused unless they carry a value that asks for nothing (`neutral`)."""
    for name in body:
        if name in neutral:
            if body[name] is not None and not any(type(body[name]) is type(n) and body[name] == n
                                                  for n in neutral[name]):
                v.append(FieldViolation(name, f"is not served here (got {clip(body[name])})"))
        elif name not in known:
            v.append(FieldViolation(name, "is not a field of this API that Celeris reads"))


@dataclass(frozen=True)
class Piece:
    """One thing a chat chunk says, in stream order."""

    kind: str  # "text" | "reasoning" | "call" (a call starts) | "args" (an argument fragment) | "canvas" | "end"
    text: str = ""  # text, reasoning, args: the fragment; call: the function's name
    index: int = 0  # call, args: the call's index
    call_id: str = ""  # call
    data: Any = None  # canvas: the `celeris` object; end: the finish reason


def pieces(chunk: dict) -> Iterator[Piece]:
    """The pieces of one `chat.completion.chunk` (one choice: these APIs have no `n`)."""
    choice = (chunk.get("choices") or [{}])[0]
    delta = choice.get("delta") or {}
    if chunk.get("celeris") is not None:
        yield Piece("canvas", data=chunk["celeris"])
    if delta.get("reasoning_content"):
        yield Piece("reasoning", delta["reasoning_content"])
    if delta.get("content"):
        yield Piece("text", delta["content"])
    for c in delta.get("tool_calls") or ():
        fn = c.get("function") or {}
        if c.get("id"):
            yield Piece("call", fn.get("name") or "", c["index"], c["id"])
        if fn.get("arguments"):
            yield Piece("args", fn["arguments"], c["index"])
    if choice.get("finish_reason") is not None:
        yield Piece("end", data=choice["finish_reason"])


def final_pieces(body: dict) -> Iterator[Piece]:
    """The pieces of a final `chat.completion` body, as its stream would say them."""
    choice = body["choices"][0]
    msg = choice["message"]
    if msg.get("reasoning_content"):
        yield Piece("reasoning", msg["reasoning_content"])
    if msg.get("content"):
        yield Piece("text", msg["content"])
    for k, c in enumerate(msg.get("tool_calls") or ()):
        yield Piece("call", c["function"]["name"], k, c["id"])
        yield Piece("args", c["function"]["arguments"], k)
    yield Piece("end", data=choice["finish_reason"])


@dataclass
class Folded:
    """An answer as the pieces build it: text, reasoning, calls ([id, name, arguments]), the end."""

    text: str = ""
    reasoning: str = ""
    calls: list = field(default_factory=list)
    finish: Optional[str] = None

    def add(self, p: Piece) -> None:
        if p.kind == "text":
            self.text += p.text
        elif p.kind == "reasoning":
            self.reasoning += p.text
        elif p.kind == "call":
            self.calls.append([p.call_id, p.text, ""])
        elif p.kind == "args":
            self.calls[p.index][2] += p.text
        elif p.kind == "end":
            self.finish = p.data


def usage_of(ev: StepEvent) -> tuple[int, int, int]:
    """(prompt tokens, generated tokens, prompt tokens the prefix cache served)."""
    return ev.prompt_tokens, len(ev.generated), ev.cached_tokens


class Shape:
    """One request of another API over the chat path (a fresh one per request: it keeps the map
    from chat message indices back to the client's own items)."""

    done = b""  # what ends a stream after its last event (chat sends `data: [DONE]`)

    def __init__(self) -> None:
        self.origin: list[str] = []  # chat message k came from the client's field origin[k]
        self.renames: list[tuple[str, str]] = []  # (chat field pattern, this API's field): the first that matches

    def request(self, body: Any) -> dict:
        """The chat completions body this request asks for; InvalidRequest names this API's fields."""
        raise NotImplementedError

    def final(self, chat: dict, ev: StepEvent) -> dict:
        """The non-streamed answer in this API's shape, from the chat path's body."""
        raise NotImplementedError

    def encoder(self, request_id: str) -> Callable[[dict, StepEvent], bytes]:
        """A fresh stream encoder: one chat chunk (and its step's event) -> this API's events."""
        raise NotImplementedError

    def error_body(self, status: int, body: dict) -> dict:
        """An OpenAI error body in this API's shape (OpenAI's own by default)."""
        return body

    def error_json(self, exc: BaseException) -> web.Response:
        status, body, headers = to_openai(exc)
        return web.json_response(self.error_body(status, body), status=status, headers=headers)

    def error_event(self, exc: BaseException) -> bytes:
        """An error after the stream's headers went out: this API's error event."""
        status, body, _ = to_openai(exc)
        return event("error", self.error_body(status, body))

    def rename(self, e: InvalidRequest) -> InvalidRequest:
        """Chat field names in a 400 -> the names this request used."""
        out = []
        for f in e.violations:
            name = f.field
            m = _MESSAGE_INDEX.match(name)
            if m and int(m.group(1)) < len(self.origin):
                name = self.origin[int(m.group(1))] + name[m.end():]
            for pattern, repl in self.renames:
                name, n = re.subn(pattern, repl, name, count=1)
                if n:
                    break
            out.append(FieldViolation(name, f.description))
        return type(e)(out)


__all__ = ["Shape", "Piece", "Folded", "pieces", "final_pieces", "event", "text_of", "check_fields",
           "api_key_bearer", "usage_of", "PASSTHROUGH"]
