"""Server interceptors: auth and rate limit (server.guard), one access-log line per RPC.

Health checks and reflection are exempt from auth and rate limits so probes and grpcurl work.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Callable

import grpc
import structlog

from celeris.engine.errors import EngineError
from celeris.server.errors import abort
from celeris.server.guard import Guard

EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
PROBE_PREFIX = "/grpc.health.v1.Health/"  # Check and Watch: logged at debug, probes come every few seconds

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


class GuardInterceptor(grpc.aio.ServerInterceptor):
    """Auth and rate limit (server.guard, shared with the HTTP gateway), checked when the call
    starts: the peer address is only known there, on the call's context."""

    def __init__(self, guard: Guard):
        self.guard = guard

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(EXEMPT_PREFIXES):
            return handler
        md = details.invocation_metadata or ()
        auth = next((v for k, v in md if k == "authorization"), None)
        fwd = next((v for k, v in md if k == "x-forwarded-for"), None)
        guard = self.guard

        def check(context) -> None:
            guard.check(auth, context.peer(), fwd if isinstance(fwd, str) else None)

        def wrap(fn: Behavior, streaming: bool) -> Behavior:
            if streaming and inspect.isasyncgenfunction(fn):
                async def guarded_stream(request, context):
                    try:
                        check(context)
                    except EngineError as e:
                        await abort(context, e)
                    async for msg in fn(request, context):
                        yield msg
                # An outer AccessLogInterceptor runs the check and iterates fn itself: one
                # async-generator layer per message instead of two.
                guarded_stream.guard_parts = (check, fn)
                return guarded_stream

            async def guarded(request, context):
                try:
                    guard.check(auth, context.peer(), fwd if isinstance(fwd, str) else None)
                except EngineError as e:
                    await abort(context, e)
                return await fn(request, context)
            return guarded
        return _rewrap(handler, wrap)


class AccessLogInterceptor(grpc.aio.ServerInterceptor):
    """One structured line per RPC: method, peer, status code, duration, messages sent."""

    def __init__(self):
        self.log = structlog.get_logger("celeris.access")

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return handler
        method, log = details.method, self.log
        emit = log.debug if method.startswith(PROBE_PREFIX) else log.info

        def wrap(fn: Behavior, streaming: bool) -> Behavior:
            # The peer is read up front: touching the context of a cancelled call is unsafe.
            if streaming and inspect.isasyncgenfunction(fn):
                check, inner = getattr(fn, "guard_parts", (None, fn))

                async def logged_stream(request, context):
                    t0, sent, code, peer = time.perf_counter(), 0, "OK", context.peer()
                    try:
                        if check is not None:  # a GuardInterceptor's, inside this one
                            try:
                                check(context)
                            except EngineError as e:
                                await abort(context, e)
                        async for msg in inner(request, context):
                            sent += 1
                            yield msg
                    except BaseException as e:
                        code = _code_of(context, e)
                        raise
                    finally:
                        emit("rpc", method=method, peer=peer, code=code, messages=sent,
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
                    emit("rpc", method=method, peer=peer, code=code,
                         duration_ms=round(1e3 * (time.perf_counter() - t0), 2))
            return logged
        return _rewrap(handler, wrap)


def _code_of(context, exc: BaseException) -> str:
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):  # the call is gone: don't touch it
        return "CANCELLED"
    code = context.code()  # set by abort(); the handler is still running here
    return code.name if code is not None and code != grpc.StatusCode.OK else "UNKNOWN"
