"""vLLM's side endpoints on the HTTP gateway: `/ping` (SageMaker's health path, GET and POST, as
vLLM serves it) and `/openapi.json`, an OpenAPI 3.1 description of the routes whose request
schema is generated from the knob table (engine/sampling/knobs.py), so it cannot drift from what
the parser accepts."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from celeris.engine.sampling.knobs import BOOL, CHOICE, FLOAT, IDS, INT, STRINGS, Knob, on

PATHS = ("/ping", "/openapi.json")  # public, like /health: probes and tools carry no token
_TYPES = {INT: {"type": "integer"}, FLOAT: {"type": "number"}, BOOL: {"type": "boolean"},
          CHOICE: {"type": "string"}, STRINGS: {"type": "array", "items": {"type": "string"}},
          IDS: {"type": "array", "items": {"type": "integer"}}}
_MESSAGES = {"type": "array", "items": {"type": "object", "required": ["role", "content"],
                                        "properties": {"role": {"type": "string"}, "content": {}}}}


def knob_schema(k: Knob) -> dict[str, Any]:
    """One body field: its JSON type, choices, default and help from the knob table."""
    out = dict(_TYPES[k.kind], description=k.help)
    if k.choices:
        out["enum"] = list(k.choices)
    if k.default is not None and not isinstance(k.default, tuple):
        out["default"] = k.default
    if k.optional:  # None is a value ("off", or "the server decides")
        out = {"anyOf": [out, {"type": "null"}], "description": k.help}
    return out


def request_schema(chat: bool) -> dict[str, Any]:
    props = {k.http: knob_schema(k) for k in on("http")}
    props["model"] = {"type": "string", "description": "a served name (--served-model-name); may be left out"}
    props["stream"] = {"type": "boolean", "default": False}
    props["n"] = {"type": "integer", "default": 1}
    if chat:
        props["messages"] = _MESSAGES
    else:
        props["prompt"] = {"anyOf": [{"type": "string"}, {"type": "array"}]}
    return {"type": "object", "required": ["messages" if chat else "prompt"], "properties": props,
            "additionalProperties": False}


def openapi(title: str, version: str) -> dict[str, Any]:
    """The document: every route of the gateway; the two generation bodies in full."""
    def post(schema_name: str, summary: str) -> dict[str, Any]:
        return {"post": {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{schema_name}"}}}},
            "responses": {"200": {"description": "JSON, or server-sent events with stream: true"}}}}

    def get(summary: str) -> dict[str, Any]:
        return {"get": {"summary": summary, "responses": {"200": {"description": "OK"}}}}

    paths = {"/v1/completions": post("CompletionRequest", "text completion (OpenAI)"),
             "/v1/chat/completions": post("ChatCompletionRequest", "chat completion (OpenAI)"),
             "/v1/models": get("the served model names"), "/health": get("200 while serving"),
             "/ping": get("200 while serving (vLLM, SageMaker)") | {"post": get("")["get"]},
             "/version": get("the server's version"), "/tokenize": {"post": get("prompt -> token ids (vLLM)")["get"]},
             "/detokenize": {"post": get("token ids -> text (vLLM)")["get"]}, "/": get("the web page")}
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
            "components": {"schemas": {"CompletionRequest": request_schema(chat=False),
                                       "ChatCompletionRequest": request_schema(chat=True)}}}


class VllmRoutes:
    def __init__(self, gateway: Any):
        self.gateway = gateway

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/ping", self.ping)
        app.router.add_post("/ping", self.ping)
        app.router.add_get("/openapi.json", self.openapi)

    async def ping(self, request: web.Request) -> web.StreamResponse:
        """/health's answer (200 serving, 503 loading or draining), at vLLM's path."""
        return await self.gateway.healthz(request)

    async def openapi(self, request: web.Request) -> web.Response:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("celeris")
        except PackageNotFoundError:
            v = "0"
        return web.json_response(openapi("Celeris (OpenAI-compatible HTTP API)", v))
