"""OpenAI-compatible HTTP gateway and the web page, in the gRPC server's process and event loop.

Routes: one table, `ROUTES` (at the end), from which the gateway registers, guards and logs every
route and /openapi.json lists them: generation (POST /v1/completions, /v1/chat/completions),
GET /v1/models[/{id}], GET /health and GET / (the web page, clients/web/index.html) are handled
here; /tokenize, /detokenize, /version, /metrics (and CORS, the Host check) in extras.py;
/ping and /openapi.json in vllm_routes.py. Requests go to the same engine as gRPC, so both
front doors share one batch. Mapping lives in openai_api.py (requests, errors) and
openai_responses.py (bodies, SSE chunks); this module is transport only: auth and rate limit
(server.guard, shared with gRPC), JSON-only bodies, draining, streaming, and cancelling a
request whose client went away. The request itself goes through server/pipeline.py, like gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import time
import types
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

import structlog
from aiohttp import web

from celeris.engine.errors import EngineError, InvalidRequest, Unavailable
from celeris.engine.events import StepEvent
from celeris.engine.serving import Engine, Prepared
from celeris.server import tools_api
from celeris.server.errors import RequestTimeout
from celeris.server.http.body import read_json
from celeris.server.http.transport import JsonErrorRunner, listening_socket, tls_context
from celeris.server.http import extras, messages_api, openai_api, responses_api, vllm_routes
from celeris.server.guard import Guard
from celeris.server.http.extras import Cors, HostCheck
from celeris.server.pipeline import Call, Pipeline
from celeris.server.http.openai_responses import Responder, merge_finals, sse, usage_chunk
from celeris.server.settings import ServerSettings
from celeris.server.http.api_shapes import Shape, api_key_bearer

log = structlog.get_logger("celeris.http")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ENDING_S = 2.0  # after the shutdown grace: time for handlers to write their endings before they are cut


def web_page_path() -> Path:
    """The page the client distribution ships (`celeris_client/web/index.html`), located without
    importing it (the server never imports client code). Editable or regular, the installed
    `celeris_client` package is where it lives; a checkout without the client installed falls
    back to `clients/` beside `server/`."""
    spec = importlib.util.find_spec("celeris_client")
    roots = list(spec.submodule_search_locations or []) if spec else []
    return Path(roots[0] if roots else Path(__file__).parent.parent / "clients") / "web" / "index.html"


def error_json(exc: BaseException) -> web.Response:
    status, body, headers = openai_api.error_response(exc)
    resp = web.json_response(body, status=status, headers=headers)
    if isinstance(exc, RequestTimeout):  # a slow sender: answer, then drop the connection
        resp.force_close()
    return resp


class HttpGateway:
    def __init__(self, engine: Engine, settings: ServerSettings, pipeline: Pipeline, guard: Guard,
                 health: Any = None):
        """`pipeline` and `guard` are the gRPC door's, so both doors share them; `health`
        (server.health.Health) drives /health."""
        self.engine, self.llm, self.settings, self.health = engine, engine.llm, settings, health
        self.pipeline, self.guard = pipeline, guard
        self.parsers = pipeline.parsers  # tool-call and reasoning parsers, resolved once for both doors
        self.port = 0
        self.draining = False
        self._runner: Optional[web.AppRunner] = None
        self._inflight = 0
        self._handlers: set[asyncio.Task] = set()  # generation handlers in flight
        self._idle = asyncio.Event()
        self._idle.set()
        self._page = b""
        self._created = int(time.time())
        self.model_names: tuple[str, ...] = settings.model_names(engine.llm.name)  # served name, then aliases

    @property
    def inflight(self) -> int:
        """Generation handlers running (reading a body, queued or decoding)."""
        return self._inflight

    # ------------------------------------------------------------------ lifecycle

    def app(self) -> web.Application:
        cors = Cors(self.settings.allowed_origins)
        hosts = HostCheck(self.settings.host, self.settings.allowed_hosts)
        # The Host check comes first (before CORS preflights, auth and any body is read): a
        # rebinding page's requests are refused whatever they carry.
        middlewares = [self._access_log, *([hosts.middleware] if hosts.active else []),
                       *([cors.middleware] if cors.allowed else []), self._guard]
        app = web.Application(middlewares=middlewares, client_max_size=self.settings.max_request_bytes)
        if cors.allowed:
            app.on_response_prepare.append(cors.on_prepare)
        for r in self.routes():
            add = app.router.add_get if r.method == "GET" else app.router.add_post  # add_get answers HEAD too
            add(r.path, types.MethodType(r.handler, self))
        return app

    def routes(self) -> tuple["Route", ...]:
        """The routes this gateway serves: the table less those a setting turns off."""
        return tuple(r for r in ROUTES if r.served is None or r.served(self.settings))

    async def start(self, port: int) -> None:
        self._page = web_page_path().read_bytes()
        # handler_cancellation: a client that disconnects cancels its handler, hence its request.
        # keepalive_timeout: aiohttp closes a connection that has not sent a whole request line and
        # headers this long after it opened or after its last response (slow senders included).
        # auto_decompress off: bodies are inflated off the loop, under the size limit (http/body.py).
        s = self.settings
        self._runner = JsonErrorRunner(self.app(), handler_cancellation=True, shutdown_timeout=0.25, access_log=None,
                                       keepalive_timeout=s.header_timeout_s, auto_decompress=False)
        await self._runner.setup()
        try:
            sock = listening_socket(s.host, port)
        except BaseException:
            await self._runner.cleanup()
            raise
        tls = tls_context(s.ssl_certfile, s.ssl_keyfile) if s.ssl_certfile else None
        await web.SockSite(self._runner, sock, ssl_context=tls).start()
        self.port = sock.getsockname()[1]
        log.info("http.started", port=self.port, **self.parsers.names)

    async def stop(self, grace: float) -> None:
        """Refuse new generations (503), give in-flight ones `grace` seconds, then cancel what is
        left and close: one grace period, not one plus aiohttp's own shutdown wait."""
        self.draining = True
        if not await self._settled(grace):
            # Every stream still running gets an ending: its handler writes an SSE error event and
            # [DONE], or a JSON 503. Only handlers still stuck after that (a client that does not
            # read) are cancelled, which drops their connections.
            log.warning("http.grace_expired", inflight=self._inflight)
            self.engine.interrupt(Unavailable("the server stopped before this request finished (shutdown "
                                                 "grace period over); retry on another replica"))
            if not await self._settled(ENDING_S):
                for task in list(self._handlers):
                    task.cancel()
                await self._settled(1.0)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _settled(self, timeout: float) -> bool:
        if self._idle.is_set():  # wait_for with a timeout of 0 times out even on a set event
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    # ------------------------------------------------------------------ middleware

    @web.middleware
    async def _access_log(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        t0, status = time.perf_counter(), 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as e:  # no such route (404), another method (405): JSON saying which
            status = e.status
            return vllm_routes.http_error(request, e)
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        finally:
            emit = log.debug if request.path in PROBE_PATHS else log.info  # probes come every few seconds
            emit("http", method=request.method, path=request.path, status=status, peer=request.remote,
                 duration_ms=round(1e3 * (time.perf_counter() - t0), 2))

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Auth, rate limit and draining, before any work; engine errors become OpenAI errors."""
        if request.path in PUBLIC_PATHS:
            return await handler(request)
        try:
            auth = next((v for k, v in request.raw_headers if k.lower() == b"authorization"), None)
            auth = auth if auth is not None else api_key_bearer(request.raw_headers)  # Anthropic's x-api-key
            self.guard.check(auth, request.remote or "", request.headers.get("X-Forwarded-For"))
            if request.method == "POST" and (self.draining or not self.engine.accepting):
                raise Unavailable("server is draining; retry on another replica")
            return await handler(request)
        except EngineError as e:
            return error_json(e)
        except web.HTTPException:
            raise
        except Exception as e:  # a bug: still answer in OpenAI's error shape, and log it loudly
            log.exception("http.internal_error", path=request.path)
            return error_json(e)

    # ------------------------------------------------------------------ routes

    async def page(self, request: web.Request) -> web.Response:
        return web.Response(body=self._page, content_type="text/html", charset="utf-8")

    async def healthz(self, request: web.Request) -> web.Response:
        serving = (self.health.serving if self.health is not None else True) and not self.draining
        body = {"status": "serving" if serving else "not_serving", "model": self.model_names[0],
                "running": self.engine.running, "queued": self.engine.queued}
        return web.json_response(body, status=200 if serving else 503)

    def _model_card(self, name: str) -> dict[str, Any]:
        fam = self.llm.family
        return {"id": name, "object": "model", "created": self._created, "owned_by": "celeris",
                "root": self.llm.name, "parent": None, "max_model_len": self.llm.max_model_len,
                # which knobs apply (the page shows only those): the family's decoding kind and arch
                "celeris": {"architecture": fam.arch, "family": fam.kind, "token_editing": fam.edits,
                            "decoding_modes": list(fam.modes)}}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card(n) for n in self.model_names]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name not in self.model_names:
            return error_json(openai_api.model_not_found(name, self.model_names))
        return web.json_response(self._model_card(name))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.complete(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.complete(request, chat=True)

    async def read_json(self, request: web.Request) -> Any:
        """The request's JSON body (server/http/body.py: media type, size, encoding, timeout)."""
        return await read_json(request, self.settings.max_request_bytes, self.settings.body_timeout_s)

    async def _parse(self, body: Any, chat: bool) -> openai_api.GatewayRequest:
        """The body as an engine-bound request. Tools' shapes, sizes and nesting are walked here (up to
        the body's size; their schemas compile later, on the engine's lanes), so a body with tools is
        read on a worker thread, never the loop."""
        def parse() -> openai_api.GatewayRequest:
            req = openai_api.parse_request(body, self.llm.defaults, chat, self.model_names)
            return replace(req, structured=tools_api.plan(req.tools, self.parsers, req.structured))

        return await asyncio.to_thread(parse) if isinstance(body, dict) and body.get("tools") else parse()

    async def complete(self, request: web.Request, chat: bool, shape: Optional[Shape] = None) -> web.StreamResponse:
        """One generation request. `shape` (server/http/api_shapes.py): another API's body mapped onto this
        chat path and its answers mapped back (/v1/responses, /v1/messages); None: OpenAI's own."""
        fail = shape.error_json if shape is not None else error_json
        carrier = {k.lower(): v for k, v in request.headers.items() if k.lower() in ("traceparent", "tracestate")}
        async with self._tracked() as task, self.pipeline.call("http", f"POST {request.path}", carrier,
                                                                request.remote or "") as call:
            req = None
            try:
                body = await self.read_json(request)
                req = await self._parse(shape.request(body) if shape is not None else body, chat)
                responders: list[Responder] = []
                reqs = openai_api.engine_requests(req, request.headers.get("X-Request-Id", ""))
                await call.open(reqs, [functools.partial(self._responder, req, chat, responders, shape)] * len(reqs))
            except EngineError as e:
                return fail(call.fail(self._renamed(e, req, shape)))
            call.on_abandon(task.cancel if task is not None else None)  # a client that stopped reading: drop it
            extra = {"X-Celeris-Structure-Path": call.structure_path} if call.structure_path else {}
            if req.stream:
                return await self._stream(request, responders, call, req.n if req.include_usage else 0, extra, shape)
            try:
                finals = await call.finals()
                if any(ev is None for ev in finals):
                    raise call.fail(Unavailable("the request was dropped before its first step (server stopping)"))
            except EngineError as e:
                return fail(e)
            out = merge_finals([r.final(ev) for r, ev in zip(responders, finals)], req.n)
            out = shape.final(out, finals[0]) if shape is not None else out
            return web.json_response(out, headers={"X-Request-Id": call.streams[0].request_id, **extra})

    @staticmethod
    def _renamed(e: EngineError, req: Optional[openai_api.GatewayRequest], shape: Optional[Shape]) -> EngineError:
        """A refusal named by the fields the client sent (OpenAI's, then the other API's)."""
        if isinstance(e, InvalidRequest):
            e = openai_api.rename_fields(e, req)
            e = shape.rename(e) if shape is not None else e
        return e

    def _responder(self, req: openai_api.GatewayRequest, chat: bool, responders: list[Responder],
                   shape: Optional[Shape], prepared: Prepared) -> Optional[Callable[[StepEvent], Optional[bytes]]]:
        """Choice k's Responder, made as it is admitted (choices in order; all share the first choice's
        id); a streaming request's choices get its formatter, run in the formatter thread (`shape`:
        another API's events)."""
        k = len(responders)
        rid = responders[0].request_id if responders else prepared.request_id
        reader = tools_api.reader(req.tools, self.parsers) if chat else None
        responders.append(Responder(chat, rid, req.model, self.llm.tokenizer, req.params.stop, index=k,
                                    echo=self._echo(req, k), provisional=req.params.provisional, reader=reader))
        if not req.stream:
            return None
        encode = shape.encoder(rid) if shape is not None else None
        return responders[-1].stream_formatter(req.diffusing_format if req.diffusing else "", encode)

    @contextlib.asynccontextmanager
    async def _tracked(self) -> AsyncIterator[Optional[asyncio.Task]]:
        """A generation handler in flight (its task): stopping waits for them, then cancels what is stuck."""
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        self._inflight += 1
        self._idle.clear()
        try:
            yield task
        finally:
            self._handlers.discard(task)
            self._inflight -= 1
            if not self._inflight:
                self._idle.set()

    def _echo(self, req: openai_api.GatewayRequest, k: int) -> str:
        if not req.echo:
            return ""
        prompt = req.prompts[k // req.n]
        return prompt if isinstance(prompt, str) else self.llm.tokenizer.decode(prompt)

    async def _stream(self, request: web.Request, responders: list[Responder], call: Call, usage_n: int = 0,
                      extra: Optional[dict[str, str]] = None, shape: Optional[Shape] = None) -> web.StreamResponse:
        """Server-sent events of every choice as they come (each chunk names its choice index),
        already built by each choice's formatter in the formatter thread; `usage_n` (the request's
        n) > 0: OpenAI's include_usage chunk (empty choices) before [DONE]. `shape`: another API's
        events (its errors, its ending instead of [DONE])."""
        error_event = shape.error_event if shape is not None else (lambda e: sse(openai_api.error_response(e)[1]))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no", "X-Request-Id": responders[0].request_id,
                                           **(extra or {})})
        await resp.prepare(request)
        try:
            try:
                async for message in call.messages():
                    await resp.write(message)
                if usage_n and (last := usage_chunk(responders, usage_n)) is not None:
                    await resp.write(sse(last))
            except ConnectionError:
                raise
            except Exception as e:  # a failed step or a formatting bug; headers are sent: the error is the last event
                await resp.write(error_event(e))
            await resp.write(shape.done if shape is not None else sse("[DONE]"))
            await resp.write_eof()
        except ConnectionError:  # the client went away mid-stream; the caller's finally cancels
            log.info("http.client_gone", request_id=responders[0].request_id)
        return resp


@dataclass(frozen=True)
class Route:
    """One HTTP route: what the gateway registers, guards and logs, and /openapi.json lists."""

    method: str  # GET or POST
    path: str  # aiohttp's pattern
    handler: Callable[[Any, web.Request], Awaitable[web.StreamResponse]]  # (gateway, request)
    summary: str  # its line in /openapi.json
    public: bool = False  # no token needed: the page asks for one, probes, tools and scrapers have none
    probe: bool = False  # logged at debug level: probes come every few seconds
    body: Optional[str] = None  # its JSON body's schema in /openapi.json (components.schemas)
    # Whether the settings serve it (False: not served, not listed); None: always served.
    served: Optional[Callable[[ServerSettings], bool]] = None


_G = HttpGateway
ROUTES: tuple[Route, ...] = (
    Route("GET", "/", _G.page, "the web page", public=True),
    Route("GET", "/health", _G.healthz, "200 while serving", public=True, probe=True),
    Route("GET", "/v1/models", _G.models, "the served model names"),
    Route("GET", "/v1/models/{model:.+}", _G.model, "one served model name"),
    Route("POST", "/v1/completions", _G.completions, "text completion (OpenAI)", body="CompletionRequest"),
    Route("POST", "/v1/chat/completions", _G.chat_completions, "chat completion (OpenAI)",
          body="ChatCompletionRequest"),
    Route("POST", "/v1/responses", responses_api.create, "a response (OpenAI Responses API)", body="ResponsesRequest"),
    Route("POST", "/v1/messages", messages_api.create, "a message (Anthropic Messages API)", body="MessagesRequest"),
    Route("POST", "/tokenize", extras.tokenize, "prompt -> token ids (vLLM)"),
    Route("POST", "/detokenize", extras.detokenize, "token ids -> text (vLLM)"),
    Route("GET", "/version", extras.get_version, "the server's version", public=True),
    Route("GET", "/metrics", extras.metrics, "Prometheus metrics (vLLM's and Celeris' names)", public=True,
          served=lambda s: s.metrics_on_http),
    Route("GET", "/ping", vllm_routes.ping, "200 while serving (vLLM, SageMaker)", public=True, probe=True),
    Route("POST", "/ping", vllm_routes.ping, "200 while serving (vLLM, SageMaker)", public=True, probe=True),
    Route("GET", "/openapi.json", vllm_routes.openapi_json, "this document (OpenAPI 3.1)", public=True),
)
PUBLIC_PATHS = frozenset(r.path for r in ROUTES if r.public)
PROBE_PATHS = frozenset(r.path for r in ROUTES if r.probe)
