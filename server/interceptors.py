"""Server interceptors: bearer-token auth, per-client rate limit, one access-log line per RPC.

Health checks and reflection are exempt from auth and rate limits so probes and grpcurl work.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import time
from typing import Callable, Optional

import grpc
import structlog

from engine.errors import Overloaded
from server.errors import status_for_code, to_status

EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

Behavior = Callable


def _rewrap(handler: grpc.RpcMethodHandler, wrap: Callable[[Behavior, bool], Behavior]) -> grpc.RpcMethodHandler:
    """The same handler with its behavior wrapped; `wrap(fn, streaming_response)`."""
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary, False),
                                                   handler.request_deserializer, handler.response_serializer)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream, True),
                                                    handler.request_deserializer, handler.response_serializer)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary, False),
                                                    handler.request_deserializer, handler.response_serializer)
    return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream, True),
                                                 handler.request_deserializer, handler.response_serializer)


def _rejecting(handler: grpc.RpcMethodHandler, status: grpc.Status) -> grpc.RpcMethodHandler:
    def wrap(fn: Behavior, streaming: bool) -> Behavior:
        if streaming:
            async def reject_stream(request, context):
                await context.abort_with_status(status)
                yield  # pragma: no cover - makes this an async generator
            return reject_stream

        async def reject(request, context):
            await context.abort_with_status(status)
        return reject
    return _rewrap(handler, wrap)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(EXEMPT_PREFIXES):
            return handler
        got = dict(details.invocation_metadata or ()).get("authorization", "")
        if isinstance(got, str) and hmac.compare_digest(got.encode(), self._expected):
            return handler
        return _rejecting(handler, status_for_code(grpc.StatusCode.UNAUTHENTICATED,
                                                   "missing or invalid bearer token (metadata 'authorization')"))


class RateLimitInterceptor(grpc.aio.ServerInterceptor):
    """Token bucket per client: the bearer token if any, else the peer's address."""

    def __init__(self, rate_per_s: float, burst: int, clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self.clock = rate_per_s, burst, clock
        self._buckets: dict[str, tuple[float, float]] = {}

    def allow(self, key: str) -> Optional[float]:
        """None if allowed, else seconds until the next token."""
        now = self.clock()
        tokens, last = self._buckets.get(key, (float(self.burst), now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        if tokens >= 1:
            self._buckets[key] = (tokens - 1, now)
            return None
        self._buckets[key] = (tokens, now)
        return (1 - tokens) / self.rate

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(EXEMPT_PREFIXES):
            return handler
        md = dict(details.invocation_metadata or ())
        key = md.get("authorization") or md.get("x-forwarded-for") or "anonymous"
        wait = self.allow(str(key))
        if wait is None:
            return handler
        return _rejecting(handler, to_status(Overloaded(f"rate limit of {self.rate:g} requests/s exceeded", wait)))


class AccessLogInterceptor(grpc.aio.ServerInterceptor):
    """One structured line per RPC: method, peer, status code, duration, messages sent."""

    def __init__(self):
        self.log = structlog.get_logger("celeris.access")

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return handler
        method, log = details.method, self.log

        def wrap(fn: Behavior, streaming: bool) -> Behavior:
            # The peer is read up front: touching the context of a cancelled call is unsafe.
            if streaming and inspect.isasyncgenfunction(fn):
                async def logged_stream(request, context):
                    t0, sent, code, peer = time.perf_counter(), 0, "OK", context.peer()
                    try:
                        async for msg in fn(request, context):
                            sent += 1
                            yield msg
                    except BaseException as e:
                        code = _code_of(context, e)
                        raise
                    finally:
                        log.info("rpc", method=method, peer=peer, code=code, messages=sent,
                                 duration_ms=round(1e3 * (time.perf_counter() - t0), 2))
                return logged_stream

            async def logged(request, context):  # unary, or streaming through context.write
                t0, code, peer = time.perf_counter(), "OK", context.peer()
                try:
                    return await fn(request, context)
                except BaseException as e:
                    code = _code_of(context, e)
                    raise
                finally:
                    log.info("rpc", method=method, peer=peer, code=code,
                             duration_ms=round(1e3 * (time.perf_counter() - t0), 2))
            return logged
        return _rewrap(handler, wrap)


def _code_of(context, exc: BaseException) -> str:
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):  # the call is gone: don't touch it
        return "CANCELLED"
    code = context.code()  # set by abort(); the handler is still running here
    return code.name if code is not None and code != grpc.StatusCode.OK else "UNKNOWN"
