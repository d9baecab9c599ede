"""One error table for both front doors: engine (and transport) errors -> gRPC status with
google.rpc details, and -> OpenAI-shaped JSON with an HTTP status."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Optional

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from celeris.engine.errors import (EngineError, InvalidRequest, ModelLoadError, Overloaded, StepFailed, StreamAbandoned,
                                   Unavailable)

MAX_MESSAGE = 1024  # characters of an error message or a violation's description sent back (or logged)
# A refusal's delay is the engine's estimate times a random factor in [1, 1 + RETRY_JITTER): never
# sooner than estimated, and callers refused together come back spread out rather than in a wave.
RETRY_JITTER = 0.5


class Unauthenticated(EngineError):
    """Missing or wrong bearer token (raised by the transport's guard, not the engine)."""


class UnsupportedMediaType(InvalidRequest):
    """An HTTP body that is not JSON (form posts and text/plain, as browsers send cross-site)."""


class ModelNotFound(InvalidRequest):
    """An HTTP request naming a model this server does not serve (OpenAI's and vLLM's 404)."""


class RequestTooLarge(InvalidRequest):
    """A body over the size limit (gRPC refuses such messages itself, with RESOURCE_EXHAUSTED)."""


class RequestTimeout(InvalidRequest):
    """An HTTP request whose body did not arrive within the body read timeout."""


class PortInUse(EngineError):
    """A door's port is taken by another process, or asked for by two doors of this one (ports are
    never silently shared)."""


def bounded(text: str, limit: int = MAX_MESSAGE) -> str:
    """`text` cut to `limit` characters: an error never grows with what a client sent."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


@dataclass(frozen=True)
class Kind:
    grpc: grpc.StatusCode
    http: int
    type: str  # OpenAI error type
    code: str  # OpenAI error code


INTERNAL = Kind(grpc.StatusCode.INTERNAL, 500, "server_error", "internal_error")
# Most specific first: the first matching row wins.
TABLE: tuple[tuple[type, Kind], ...] = (
    (UnsupportedMediaType, Kind(grpc.StatusCode.INVALID_ARGUMENT, 415, "invalid_request_error", "unsupported_media_type")),
    (ModelNotFound, Kind(grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error", "model_not_found")),
    (RequestTimeout, Kind(grpc.StatusCode.DEADLINE_EXCEEDED, 408, "invalid_request_error", "request_timeout")),
    (RequestTooLarge, Kind(grpc.StatusCode.RESOURCE_EXHAUSTED, 413, "invalid_request_error", "request_too_large")),
    (InvalidRequest, Kind(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error", "invalid_value")),
    (Unauthenticated, Kind(grpc.StatusCode.UNAUTHENTICATED, 401, "invalid_request_error", "invalid_api_key")),
    (Overloaded, Kind(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error", "rate_limit_exceeded")),
    (Unavailable, Kind(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable", "unavailable")),
    (StreamAbandoned, Kind(grpc.StatusCode.DEADLINE_EXCEEDED, 408, "invalid_request_error", "stream_not_read")),
    (ModelLoadError, Kind(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable", "unavailable")),
    (StepFailed, INTERNAL),
)


def kind_of(exc: BaseException) -> Kind:
    """The row for an error; INTERNAL for anything not in the table (a bug)."""
    return next((k for t, k in TABLE if isinstance(exc, t)), INTERNAL)


def code_name(exc: BaseException) -> str:
    """The gRPC code name, used by both doors' metrics and logs."""
    return kind_of(exc).grpc.name


def retry_delay_s(exc: Overloaded, rng: Optional[random.Random] = None) -> float:
    """The delay this one refusal advertises (RetryInfo, Retry-After): jittered, drawn per refusal."""
    return exc.retry_after_s * (rng or random).uniform(1.0, 1.0 + RETRY_JITTER)


def _pack(msg) -> any_pb2.Any:
    a = any_pb2.Any()
    a.Pack(msg)
    return a


def to_status(exc: BaseException) -> grpc.Status:
    """The rich gRPC status for an error."""
    code = kind_of(exc).grpc
    details = []
    if isinstance(exc, InvalidRequest):
        details.append(_pack(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=bounded(v.field, 256), description=bounded(v.description))
            for v in exc.violations])))
    if isinstance(exc, Overloaded):
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(retry_delay_s(exc) * 1e9))
        details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
    message = bounded(str(exc)) if isinstance(exc, EngineError) else f"internal error: {type(exc).__name__}"
    return rpc_status.to_status(status_pb2.Status(code=getattr(code_pb2, code.name), message=message,
                                                  details=details))


async def abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Abort the RPC with the error's status; raises, like context.abort."""
    await context.abort_with_status(to_status(exc))


def error_body(message: str, type_: str, param: Optional[str] = None, code: Optional[str] = None,
               **extra: Any) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code, **extra}}


def to_openai(exc: BaseException) -> tuple[int, dict, dict[str, str]]:
    """(HTTP status, OpenAI error body, extra headers) for an error."""
    k = kind_of(exc)
    headers: dict[str, str] = {}
    extra: dict[str, Any] = {}
    param = None
    if isinstance(exc, InvalidRequest):
        param = exc.violations[0].field if exc.violations else None
        param = bounded(param, 256) if param else param
        extra["field_violations"] = [{"field": bounded(f.field, 256), "description": bounded(f.description)}
                                     for f in exc.violations]
    if isinstance(exc, Overloaded):  # whole seconds by RFC 9110; the OpenAI SDKs read retry-after-ms first
        delay = retry_delay_s(exc)
        headers["Retry-After"] = str(max(1, math.ceil(delay)))
        headers["retry-after-ms"] = str(max(1, round(delay * 1000)))
    elif isinstance(exc, (Unavailable, ModelLoadError)):
        headers["Retry-After"] = "1"
    elif isinstance(exc, Unauthenticated):
        headers["WWW-Authenticate"] = "Bearer"
    if k is INTERNAL:
        kind = "engine error" if isinstance(exc, EngineError) else "internal error"
        message = f"{kind}: {bounded(str(exc))}" if isinstance(exc, EngineError) else f"{kind}: {type(exc).__name__}"
    else:
        message = bounded(str(exc))
    return k.http, error_body(message, k.type, param, k.code, **extra), headers
