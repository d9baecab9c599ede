"""Reading an HTTP request's JSON body without letting a client stall the event loop or the server.

- Only JSON media types, and the header must be there (a browser may post text/plain, form,
  multipart or an untyped body cross-site without a preflight: none of those are accepted).
- aiohttp's own decompression is off (it inflates on the event loop, however far past the size
  limit a body expands): a gzip or deflate body is read compressed, at most the size limit, and
  inflated in a worker thread, the limit applied to the inflated bytes as they come out. Any other
  Content-Encoding is refused (415).
- The whole body must arrive within `timeout` seconds (a slow sender gets 408 and loses the
  connection); the request line and headers are bounded by the gateway's header timeout.
- Parsing happens off the loop for large bodies; any string holding a lone surrogate (JSON's
  "\\ud800", which no tokenizer can encode) is a 400 naming where it is, never a 500.
"""

from __future__ import annotations

import asyncio
import json
import zlib
from typing import Any, Optional

from aiohttp import web

from celeris.engine.errors import FieldViolation, InvalidRequest, clip
from celeris.server.errors import RequestTimeout, RequestTooLarge, UnsupportedMediaType

PARSE_OFF_LOOP = 64 << 10  # bodies larger than this (read or inflated) are parsed in a worker thread
WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def json_media(content_type: Optional[str]) -> bool:
    """application/json or any +json type."""
    mime = (content_type or "").split(";")[0].strip().lower()
    return mime == "application/json" or mime.endswith("+json")


def _too_large(limit: int) -> RequestTooLarge:
    return RequestTooLarge([FieldViolation("body", f"larger than {limit} bytes")])


def inflate(raw: bytes, encoding: str, limit: int) -> bytes:
    """`raw` decompressed, refusing past `limit` inflated bytes: at most limit + 1 bytes are ever
    produced, whatever the ratio. Runs in a worker thread."""
    wbits = WBITS[encoding]
    d = zlib.decompressobj(wbits)
    try:
        out = d.decompress(raw, limit + 1)
        if wbits == zlib.MAX_WBITS and not out and raw:  # "deflate" sent raw, without the zlib header
            d = zlib.decompressobj(-zlib.MAX_WBITS)
            out = d.decompress(raw, limit + 1)
    except zlib.error as e:
        raise InvalidRequest([FieldViolation("body", f"not valid {encoding} data: {str(e)[:80]}")]) from None
    if len(out) > limit or d.unconsumed_tail:
        raise _too_large(limit)
    return out


def _surrogate_at(value: Any) -> Optional[str]:
    """Where the first string holding a lone surrogate is (a path like messages[0].content), if any.
    Iterative: a deeply nested body cannot exhaust the stack here."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(node, dict):
            for k, v in node.items():
                stack.append((k, path or "body"))
                stack.append((v, f"{path}.{k}" if path else str(k)))
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node))
    return None


def parse_json(raw: bytes) -> Any:
    try:
        body = json.loads(raw)
    except RecursionError:
        raise InvalidRequest([FieldViolation("body", "JSON nested too deeply")]) from None
    except ValueError as e:  # JSONDecodeError, undecodable bytes, an integer too long to convert
        raise InvalidRequest([FieldViolation("body", f"not valid JSON: {str(e)[:120]}")]) from None
    where = _surrogate_at(body)
    if where is not None:
        field = clip(where, 120).strip("'\"")
        raise InvalidRequest([FieldViolation(field, "not valid Unicode: a lone surrogate (\\ud800-\\udfff) "
                                                    "that is not half of a pair")])
    return body


async def _read(request: web.Request, limit: int) -> bytes:
    """The raw body, at most `limit` bytes (aiohttp's client_max_size is the same limit)."""
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(limit) from None


async def read_json(request: web.Request, limit: int, timeout: float) -> Any:
    """The request's JSON body: media type checked, read within `timeout`, inflated and parsed
    off the loop when large; raises InvalidRequest subclasses (415, 413, 408, 400)."""
    # The header is required, not only checked when present: a cross-site POST with no Content-Type
    # (a Blob body) is a "simple" request too, sent without a preflight.
    given = request.headers.get("Content-Type")
    if given is None or not json_media(request.content_type):
        got = "none" if given is None else clip(request.content_type)
        raise UnsupportedMediaType([FieldViolation("Content-Type", f"must be application/json, got {got}")])
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("identity", "", *WBITS):
        raise UnsupportedMediaType([FieldViolation(
            "Content-Encoding", f"must be gzip, deflate or identity, got {clip(encoding)}")])
    try:
        raw = await asyncio.wait_for(_read(request, limit), timeout) if timeout > 0 else await _read(request, limit)
    except asyncio.TimeoutError:  # the gateway answers 408 and closes the connection
        raise RequestTimeout([FieldViolation("body", f"not received within {timeout:g} s")]) from None
    loop = asyncio.get_running_loop()
    if encoding in WBITS:
        raw = await loop.run_in_executor(None, inflate, raw, encoding, limit)
    if len(raw) > PARSE_OFF_LOOP:
        return await loop.run_in_executor(None, parse_json, raw)
    return parse_json(raw)
