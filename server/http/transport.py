"""aiohttp plumbing under the HTTP gateway: the listening socket, and the protocol layer's own
errors (a bad request line, a duplicate Content-Length, headers too large) answered in the same
JSON error shape as every other error, not aiohttp's plain text.

A port already in use is one `PortInUse` error naming it.
"""

from __future__ import annotations

import errno
import socket
import ssl
from http import HTTPStatus
from typing import Optional

import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from celeris.server.errors import PortInUse, bounded, error_body

log = structlog.get_logger("celeris.http")


class JsonErrorHandler(RequestHandler):
    """aiohttp's connection handler, answering its own errors in JSON (and logging client
    mistakes at debug: they are not the server's errors)."""

    def handle_error(self, request, status: int = 500, exc: Optional[BaseException] = None,
                     message: Optional[str] = None) -> web.StreamResponse:
        if status >= 500:
            log.error("http.protocol_error", status=status, error=type(exc).__name__ if exc else None)
        else:
            log.debug("http.bad_request", status=status, error=bounded(str(exc or message or ""), 200))
        if request.writer is not None and request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send an error")
        phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Error"
        detail = getattr(exc, "message", None) or message or ""
        text = f"{phrase}: {bounded(str(detail).splitlines()[0] if detail else '', 200)}".rstrip(": ")
        kind = "server_error" if status >= 500 else "invalid_request_error"
        resp = web.json_response(error_body(text, kind, None, "bad_request" if status < 500 else "internal_error"),
                                 status=status)
        resp.force_close()
        return resp


class JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class JsonErrorRunner(web.AppRunner):
    """An AppRunner whose connections answer protocol errors in JSON."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = JsonErrorServer  # the same server; only its handler factory differs
        return server


def listening_socket(host: str, port: int) -> socket.socket:
    """One bound socket, so port 0 yields one port. "[::]" (the gRPC default) means dual-stack,
    IPv4 included; where IPv6 is off it falls back to 0.0.0.0."""
    host = host.strip("[]")
    if host in ("", "::"):
        candidates = [(socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")]
    else:
        candidates = [(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0], host)]
    error: OSError = OSError(f"cannot bind {host}:{port}")
    for family, addr in candidates:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            if family == socket.AF_INET6 and addr == "::":
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((addr, port))
        except OSError as e:
            sock.close()
            error = e
            continue
        sock.setblocking(False)
        return sock
    if error.errno == errno.EADDRINUSE:
        raise PortInUse(f"HTTP port {port} on {host or '::'} is already in use") from None
    raise error




def tls_context(certfile: Optional[str], keyfile: Optional[str]) -> Optional[ssl.SSLContext]:
    """The gateway's TLS context (--ssl-certfile/--ssl-keyfile), or None for plain HTTP."""
    if certfile is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(certfile, keyfile)
    return ctx
