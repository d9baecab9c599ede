"""The HTTP gateway's handlers beyond generation, and CORS (the routes are in gateway.ROUTES).

- `POST /tokenize`, `POST /detokenize` in vLLM's shapes: `{"prompt": ...}` (`add_special_tokens:
  false` leaves out the BOS) or chat `{"messages": [...]}` -> `{"tokens", "count", "max_model_len", "token_strs"}`; `{"tokens": [...]}`
  -> `{"prompt": "..."}`. The same size limits as generation (a prompt that Generate would refuse
  untokenized is refused here too), tokenized off the event loop.
- `GET /version`.
- `GET /metrics` (Prometheus text, vLLM's `vllm:` names beside Celeris' own), as vLLM serves it on
  its API port, unless `--no-metrics-on-http-port`; public like the separate metrics port
  (scrapers carry no token).
- CORS for browsers on other origins, only when `--allowed-origins` names them: an allowed
  origin gets `Access-Control-Allow-Origin` on every response (errors and event streams too)
  and its preflight `OPTIONS` answered, allowing the request headers the preflight asks for; any other origin's preflight is refused with 403.
- The Host allowlist (`HostCheck`) of a gateway bound to loopback: a web page that rebinds its own
  DNS name to 127.0.0.1 reaches the port as same-origin, but its requests still say its name in
  `Host`. So on loopback only localhost, loopback addresses and the names given with
  `--allowed-hosts` are served (421 otherwise). Bound elsewhere, Host is the pod IP or a service
  name Kubernetes probes and meshes pick: no check unless the operator names hosts.
"""

from __future__ import annotations

import importlib.metadata
import ipaddress
from typing import Any, Awaitable, Callable, Optional, Sequence

from aiohttp import web

from celeris.engine.errors import InvalidRequest
from celeris.server.http import openai_api

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ALLOW_METHODS = "GET, POST, OPTIONS"
ALLOW_HEADERS = "Authorization, Content-Type, X-Request-Id, traceparent, tracestate"
MAX_REQUEST_HEADERS = 2048  # longest Access-Control-Request-Headers value echoed back
EXPOSE_HEADERS = "X-Request-Id, Retry-After"


def version() -> str:
    try:
        return importlib.metadata.version("celeris")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


def _without_bos(tokenizer: Any, prompt: Any, ids: list[int]) -> list[int]:
    """A text prompt's ids less the BOS `encode` adds (the only special token it adds: user text
    never becomes special ids); token-id prompts are as given."""
    if isinstance(prompt, str) and tokenizer.add_bos and ids[:1] == [tokenizer.bos_id]:
        return ids[1:]
    return ids


def _error(exc: BaseException) -> web.Response:
    status, body, headers = openai_api.error_response(exc)
    return web.json_response(body, status=status, headers=headers)


def allow_headers(headers) -> str:
    """An allowed origin may send the headers its preflight names (the openai JS SDK sends
    `x-stainless-*`; vLLM allows any): echo them back, our fixed list when it names none."""
    asked = headers.get("Access-Control-Request-Headers", "").strip()
    names = [h.strip() for h in asked.split(",") if h.strip()]
    if not names or len(asked) > MAX_REQUEST_HEADERS or not all(_is_token(h) for h in names):
        return ALLOW_HEADERS
    return ", ".join(names)


def _is_token(name: str) -> bool:
    return all(c.isalnum() or c in "-_" for c in name)


class Cors:
    """`allowed`: exact origins (scheme://host[:port]) or "*"; empty = CORS off."""

    def __init__(self, allowed: Sequence[str]):
        self.allowed = frozenset(o.rstrip("/") for o in allowed)

    def allows(self, origin: Optional[str]) -> bool:
        return bool(origin) and ("*" in self.allowed or origin in self.allowed)

    def _allow_origin(self, origin: str) -> str:
        return "*" if self.allowed == {"*"} else origin

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Preflights are answered here, before auth: a browser sends no credentials with them."""
        origin = request.headers.get("Origin")
        if request.method == "OPTIONS" and origin and "Access-Control-Request-Method" in request.headers:
            if not self.allows(origin):
                body = openai_api.error_body(f"origin {origin[:100]!r} is not allowed (--allowed-origins)",
                                             "invalid_request_error", "Origin", "origin_not_allowed")
                return web.json_response(body, status=403)
            return web.Response(status=204, headers={
                "Access-Control-Allow-Origin": self._allow_origin(origin),
                "Access-Control-Allow-Methods": ALLOW_METHODS,
                "Access-Control-Allow-Headers": allow_headers(request.headers),
                "Access-Control-Max-Age": "600",
                "Vary": "Origin, Access-Control-Request-Headers"})
        return await handler(request)

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """Every response to an allowed origin, event streams included, carries the CORS headers
        (aiohttp's on_response_prepare runs before the headers go out)."""
        origin = request.headers.get("Origin")
        if self.allows(origin):
            response.headers["Access-Control-Allow-Origin"] = self._allow_origin(origin)
            response.headers["Access-Control-Expose-Headers"] = EXPOSE_HEADERS
            if "Origin" not in response.headers.getall("Vary", ()):
                response.headers.add("Vary", "Origin")


def is_loopback(host: str) -> bool:
    """A loopback address or localhost (a Host header's name, or a bind address; brackets and a
    trailing dot allowed)."""
    name = host.strip("[]").rstrip(".").lower()
    if name == "localhost" or name.endswith(".localhost"):  # browsers resolve these themselves (RFC 6761)
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """A Host header's name without its port: "[::1]:8080" -> "::1", "Example.COM." -> "example.com"."""
    header = header.strip()
    if header.startswith("["):
        name = header[1:header.find("]")] if "]" in header else header[1:]
    else:
        name = header.rsplit(":", 1)[0] if header.count(":") == 1 else header
    return name.rstrip(".").lower()


class HostCheck:
    """Which Host headers the gateway serves. `bind_host`: the address it listens on; `allowed`:
    the operator's names (`--allowed-hosts`; "*" turns the check off)."""

    def __init__(self, bind_host: str, allowed: Sequence[str] = ()):
        self.names = frozenset(host_name(h) for h in allowed if h.strip())
        self.active = "*" not in self.names and (is_loopback(bind_host) or bool(self.names))

    def allows(self, header: Optional[str]) -> bool:
        # No Host at all: not a browser (every browser sends one), so not a rebinding page.
        if header is None:
            return True
        name = host_name(header)
        return is_loopback(name) or name in self.names

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        host = request.headers.get("Host")
        if self.allows(host):
            return await handler(request)
        body = openai_api.error_body(f"Host {host[:100]!r} is not served here: add it with --allowed-hosts",
                                     "invalid_request_error", "Host", "host_not_allowed")
        return web.json_response(body, status=421)


# Handlers: (gateway, request) -> response; the gateway's route table (gateway.ROUTES) serves them.

async def metrics(gw: Any, request: web.Request) -> web.Response:
    """Prometheus /metrics on the HTTP gateway's own port (the server's CollectorRegistry)."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    registry = gw.pipeline.lifecycle.telemetry.metrics.registry
    return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def tokenize(gw: Any, request: web.Request) -> web.Response:
    llm = gw.llm
    try:
        req = openai_api.parse_tokenize(await gw.read_json(request), gw.model_names)
        if req.messages is not None:
            ids = await llm.encode_prompt_async(messages=req.messages)
        else:
            ids = await llm.encode_prompt_async(req.prompt)
            ids = ids if req.add_special_tokens else _without_bos(llm.tokenizer, req.prompt, ids)
    except InvalidRequest as e:
        return _error(openai_api.rename_fields(e, None))
    body = {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids,
            "token_strs": llm.tokenizer.tokens(ids) if req.return_token_strs else None}
    return web.json_response(body)


async def detokenize(gw: Any, request: web.Request) -> web.Response:
    try:
        ids = openai_api.parse_detokenize(await gw.read_json(request), gw.model_names)
        text = await gw.llm.detokenize_async(ids)
    except InvalidRequest as e:
        return _error(e)
    return web.json_response({"prompt": text})


async def get_version(gw: Any, request: web.Request) -> web.Response:
    return web.json_response({"version": version()})
