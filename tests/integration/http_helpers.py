"""Raw HTTP helpers for the gateway tests: a POST that returns the open response, SSE parsing."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlparse

from tests.integration.live_server import LiveServer


PROMPT = "It is a truth universally"


def post(live: LiveServer, path: str, body, headers: dict | None = None) -> http.client.HTTPResponse:
    """A raw POST; returns the open response (the caller reads or closes it)."""
    u = urlparse(live.http_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
    return conn.getresponse()


def sse_events(resp: http.client.HTTPResponse) -> list:
    """Every `data:` payload of an SSE stream, parsed (the "[DONE]" sentinel kept as a string)."""
    events = []
    for raw in resp:
        line = raw.decode().rstrip("\n")
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events
