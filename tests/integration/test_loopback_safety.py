"""A gateway on loopback cannot be reached by a web page (#40): DNS rebinding is refused by the
Host allowlist (421), and a cross-site "simple" POST by the required JSON Content-Type (415)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from celeris.server.http.extras import HostCheck

BODY = {"prompt": "It is a truth", "max_tokens": 8, "steps": 4, "seed": 1}


async def call(port: int, method: str, path: str, host: str, **kw) -> tuple[int, dict | str]:
    async with aiohttp.ClientSession() as s:
        async with s.request(method, f"http://127.0.0.1:{port}{path}", headers={"Host": host, **kw.pop("headers", {})},
                             **kw) as r:
            text = await r.text()
            return r.status, (json.loads(text) if r.content_type == "application/json" else text)


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:{port}", "localhost.:{port}", "127.0.0.1:{port}",
                                  "[::1]:{port}", "[::1]", "127.0.0.1"])
async def test_loopback_hosts_are_served(serve, host):
    async with serve(http_port=0) as (server, _, _port):
        port = server.http.port
        status, _ = await call(port, "GET", "/v1/models", host.format(port=port))
        assert status == 200


async def test_a_rebound_name_is_refused_on_every_route_before_any_work(serve):
    """A page on evil.example rebound to 127.0.0.1: same-origin to the browser, but its Host says
    evil.example. Refused with a JSON error, the body never read, nothing generated."""
    async with serve(http_port=0) as (server, _, _port):
        port = server.http.port
        for method, path, kw in (("GET", "/", {}), ("GET", "/v1/models", {}), ("GET", "/health", {}),
                                 ("POST", "/v1/completions", {"json": BODY}), ("POST", "/tokenize", {"json": {}})):
            status, body = await call(port, method, path, f"evil.example:{port}", **kw)
            assert status == 421, (path, body)
            assert body["error"]["code"] == "host_not_allowed" and "--allowed-hosts" in body["error"]["message"]
        assert server.scheduler.running == 0 and server.http.inflight == 0


async def test_operator_named_hosts_are_served_and_cors_comes_after_the_host(serve):
    settings = {"http_port": 0, "allowed_hosts": ("celeris.internal",), "allowed_origins": ("http://app.example",)}
    async with serve(**settings) as (server, _, _port):
        port = server.http.port
        assert (await call(port, "GET", "/v1/models", "Celeris.Internal:8080"))[0] == 200
        assert (await call(port, "GET", "/v1/models", "other.internal"))[0] == 421
        preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "content-type"}
        status, _ = await call(port, "OPTIONS", "/v1/completions", f"127.0.0.1:{port}", headers=preflight)
        assert status == 204
        status, _ = await call(port, "OPTIONS", "/v1/completions", "evil.example", headers=preflight)
        assert status == 421
        status, body = await call(port, "POST", "/v1/completions", "localhost",
                                  headers={"Origin": "http://app.example"}, json=BODY)
        assert status == 200 and body["choices"][0]["finish_reason"]


def test_off_loopback_the_host_is_checked_only_when_the_operator_names_hosts():
    """Bound to every interface (the images), Kubernetes probes and meshes send the pod IP or a
    service name: no check. Names given: those and loopback only. `*`: no check at all."""
    assert not HostCheck("[::]").active and not HostCheck("0.0.0.0").active and not HostCheck("10.0.0.5").active
    named = HostCheck("[::]", ["api.example.com"])
    assert named.active and named.allows("api.example.com:443") and named.allows("127.0.0.1:8080")
    assert not named.allows("10.0.0.5:8080")
    assert HostCheck("127.0.0.1").active and HostCheck("::1").active and HostCheck("localhost").active
    assert not HostCheck("127.0.0.1", ["*"]).active
    assert HostCheck("127.0.0.1").allows(None)  # no Host at all: HTTP/1.0 tools, never a browser


async def raw_post(port: int, path: str, headers: str, body: bytes) -> tuple[int, dict]:
    """A POST exactly as written (no client adds a Content-Type), like a browser's Blob body. On
    the test's event loop, which also runs the server."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n{headers}"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    data = await asyncio.wait_for(reader.read(), 120)
    writer.close()
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
async def test_json_posts_must_say_application_json(serve, path):
    body = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
            "/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [1, 2]}}.get(path, BODY)
    raw = json.dumps(body).encode()
    async with serve(http_port=0) as (server, _, _port):
        port = server.http.port
        for headers, got in (("", "none"), ("Content-Type: text/plain\r\n", "'text/plain'")):
            status, err = await raw_post(port, path, headers, raw)
            assert status == 415, err
            assert err["error"]["param"] == "Content-Type" and f"got {got}" in err["error"]["message"]
        status, ok = await raw_post(port, path, "Content-Type: application/json; charset=utf-8\r\n", raw)
        assert status == 200, ok
        assert server.scheduler.running == 0
