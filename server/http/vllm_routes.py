"""vLLM's side endpoints on the HTTP gateway: `/ping` (SageMaker's health path, GET and POST, as
vLLM serves it) and `/openapi.json`, an OpenAPI 3.1 description of the routes the gateway serves
(its route table, gateway.ROUTES), whose request schema is generated from the knob table
(engine/sampling/knobs.py), so it cannot drift from what the parser accepts. And the answer to a
route the gateway does not serve: 404 in OpenAI's error shape, saying so (and what to use where
Celeris has one), never a bare "Not Found"."""

from __future__ import annotations

import re
from typing import Any, Iterable

from aiohttp import web

from celeris.engine.errors import FieldViolation, clip
from celeris.engine.requests import BOOL, CHOICE, FLOAT, IDS, INT, Knob, STRINGS, on
from celeris.server.errors import UnsupportedMediaType, error_body
from celeris.server.http.body import json_media
from celeris.server.http import messages_api, responses_api

_TYPES = {INT: {"type": "integer"}, FLOAT: {"type": "number"}, BOOL: {"type": "boolean"},
          CHOICE: {"type": "string"}, STRINGS: {"type": "array", "items": {"type": "string"}},
          IDS: {"type": "array", "items": {"type": "integer"}}}
_MESSAGES = {"type": "array", "items": {"type": "object", "required": ["role"], "properties": {
    "role": {"type": "string"}, "content": {}, "tool_calls": {"type": "array"}, "tool_call_id": {"type": "string"}}}}
# Chat's tool fields (server/tools_api.py; docs/tools.md).
_TOOLS = {"tools": {"type": "array", "items": {"type": "object"}},
          "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]}, {"type": "object"}]},
          "parallel_tool_calls": {"type": "boolean", "default": True}}


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
        props |= _TOOLS
    else:
        props["prompt"] = {"anyOf": [{"type": "string"}, {"type": "array"}]}
    return {"type": "object", "required": ["messages" if chat else "prompt"], "properties": props,
            "additionalProperties": False}


def _path(route: Any) -> str:
    """aiohttp's path as OpenAPI writes it: "/v1/models/{model:.+}" -> "/v1/models/{model}"."""
    return re.sub(r"\{(\w+):[^}]*\}", r"{\1}", route.path)


def _operation(route: Any) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": route.summary, "responses": {"200": {"description": "OK"}}}
    if params := re.findall(r"\{(\w+)", _path(route)):
        op["parameters"] = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}} for p in params]
    if route.body:
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{route.body}"}}}}
        op["responses"] = {"200": {"description": "JSON, or server-sent events with stream: true"}}
    return op


def openapi(title: str, version: str, routes: Iterable[Any]) -> dict[str, Any]:
    """The document: every route the gateway serves (`gateway.Route`s); the two generation
    bodies in full."""
    paths: dict[str, dict[str, Any]] = {}
    for r in routes:
        paths.setdefault(_path(r), {})[r.method.lower()] = _operation(r)
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
            "components": {"schemas": {"CompletionRequest": request_schema(chat=False),
                                       "ChatCompletionRequest": request_schema(chat=True),
                                       "ResponsesRequest": responses_api.SCHEMA, "MessagesRequest": messages_api.SCHEMA}}}


# Handlers: (gateway, request) -> response; the gateway's route table (gateway.ROUTES) serves them.

async def ping(gw: Any, request: web.Request) -> web.StreamResponse:
    """/health's answer (200 serving, 503 loading or draining), at vLLM's path. A POST is held to
    every POST's rule (a JSON Content-Type, server/http/body.py): 415 without one, as a cross-site
    form or Blob post would come."""
    if request.method == "POST" and (request.headers.get("Content-Type") is None or
                                     not json_media(request.content_type)):
        from celeris.server.http.gateway import error_json

        got = "none" if request.headers.get("Content-Type") is None else clip(request.content_type)
        return error_json(UnsupportedMediaType([FieldViolation("Content-Type", f"must be application/json, got {got}")]))
    return await gw.healthz(request)


async def openapi_json(gw: Any, request: web.Request) -> web.Response:
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("celeris")
    except PackageNotFoundError:
        v = "0"
    return web.json_response(openapi("Celeris (OpenAI-compatible HTTP API)", v, gw.routes()))


# Routes of OpenAI's and vLLM's servers that a client may try here, and what Celeris offers instead.
UNSERVED = {
    "/v1/embeddings": "Celeris serves generative diffusion models: there is no embedding model to ask",
    "/pooling": "Celeris serves generative diffusion models: there is no pooling model to ask",
    "/score": "Celeris serves generative diffusion models: there is no scoring model to ask",
    "/rerank": "Celeris serves generative diffusion models: there is no reranking model to ask",
    "/v1/rerank": "Celeris serves generative diffusion models: there is no reranking model to ask",
    "/metrics": "/metrics is off on this port (--no-metrics-on-http-port): scrape --metrics-port",
}


def http_error(request: web.Request, exc: web.HTTPException) -> web.Response:
    """aiohttp's own 404 (no such route) and 405 (the route takes another method) as JSON that
    says which, in OpenAI's error shape; other statuses keep aiohttp's reason."""
    where = f"{request.method} {request.path[:200]}"
    if exc.status == 404:
        why = UNSERVED.get(request.path.rstrip("/"), "GET /openapi.json lists the routes it serves")
        body = error_body(f"{where}: not a route Celeris serves; {why}", "invalid_request_error", None, "not_found")
    elif exc.status == 405:
        allowed = sorted(getattr(exc, "allowed_methods", ()) or ())
        body = error_body(f"{where}: this route takes {' or '.join(allowed) or 'another method'}",
                          "invalid_request_error", None, "method_not_allowed")
    else:
        body = error_body(exc.reason, "invalid_request_error", None, None)
    headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
    return web.json_response(body, status=exc.status, headers=headers)
