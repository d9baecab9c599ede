"""Auth, rate limits and hostile input through both doors (issue 13), on real loopback servers.

Figures (attempts, refusals) are printed; run with -s to see them.
"""

from __future__ import annotations

import http.client
import io
import json
import time

import grpc
import pytest

from celeris.v1 import generation_pb2 as pb
from celeris.v1 import generation_pb2_grpc as pb_grpc
from tests.integration.live_server import LiveServer, live_server
from tests.integration.server_process import field_violations

TOKEN = "s3cret"


def raw(live: LiveServer, method: str, path: str, body: bytes = b"", headers=None) -> tuple[int, bytes, dict]:
    """One HTTP request with headers sent as given (bytes allowed); (status, body, headers)."""
    conn = http.client.HTTPConnection("127.0.0.1", live.server.http.port, timeout=60)
    try:
        conn.putrequest(method, path)
        for k, v in (headers or {}).items():
            conn.putheader(k, v)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, resp.read(), dict(resp.getheaders())
    finally:
        conn.close()


JSON = {"Content-Type": "application/json"}


def test_rotating_forwarded_for_or_authorization_does_not_bypass_the_rate_limit(tiny_llm):
    n, burst = 40, 3
    with live_server(tiny_llm, rate_limit=1.0, rate_burst=burst) as live:
        t0 = time.monotonic()
        http_ok = sum(raw(live, "GET", "/v1/models", headers={"X-Forwarded-For": f"10.0.{i}.1",
                                                              "Authorization": f"Bearer k{i}"})[0] == 200
                      for i in range(n))
        with grpc.insecure_channel(live.grpc_target) as ch:
            stub, grpc_ok = pb_grpc.GenerationServiceStub(ch), 0
            for i in range(n):
                try:
                    stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10, metadata=(
                        ("x-forwarded-for", f"10.1.{i}.1"), ("authorization", f"Bearer k{i}")))
                    grpc_ok += 1
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        elapsed = time.monotonic() - t0
    allowed = burst + elapsed * 1.0 + 1  # one bucket per address for both doors: burst plus refill
    assert http_ok + grpc_ok <= allowed, (http_ok, grpc_ok, elapsed)
    print(f"\nrate limit: {2 * n} calls with rotating X-Forwarded-For and Authorization (HTTP and gRPC, "
          f"1/s, burst {burst}) in {elapsed:.2f} s: {http_ok + grpc_ok} allowed, {2 * n - http_ok - grpc_ok} refused")


def test_anonymous_grpc_clients_are_keyed_by_address(tiny_llm):
    """One busy client must not block another address (127.0.0.1 vs ::1 here)."""
    with live_server(tiny_llm, host="localhost", rate_limit=0.2, rate_burst=2) as live:
        port = live.server.port
        with grpc.insecure_channel(f"127.0.0.1:{port}") as busy, grpc.insecure_channel(f"[::1]:{port}") as other:
            b, o = pb_grpc.GenerationServiceStub(busy), pb_grpc.GenerationServiceStub(other)
            for _ in range(2):
                b.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            with pytest.raises(grpc.RpcError) as e:
                b.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            o.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)  # its own bucket


def test_the_bucket_table_is_bounded_and_new_clients_beyond_it_share_one_bucket(tiny_llm):
    with live_server(tiny_llm, rate_limit=0.01, rate_burst=1, trust_forwarded_for=True,
                     rate_limit_clients=50) as live:
        statuses = [raw(live, "GET", "/v1/models", headers={"X-Forwarded-For": f"10.2.{i // 250}.{i % 250}"})[0]
                    for i in range(300)]
        assert len(live.server.guard.limiter) <= 50
        # behind a trusted proxy each address is a client: the first 49 get their burst, the rest
        # share the overflow bucket (one request between them), and a known client is still limited
        assert statuses.count(200) == 50 and statuses.count(429) == 250
        assert raw(live, "GET", "/v1/models", headers={"X-Forwarded-For": "10.2.0.0"})[0] == 429


def test_the_bearer_scheme_is_case_insensitive_on_both_doors(tiny_llm):
    with live_server(tiny_llm, api_token=TOKEN) as live:
        assert raw(live, "GET", "/v1/models", headers={"Authorization": f"bearer {TOKEN}"})[0] == 200
        assert raw(live, "GET", "/v1/models", headers={"Authorization": f"BEARER {TOKEN}"})[0] == 200
        assert raw(live, "GET", "/v1/models", headers={"Authorization": f"Basic {TOKEN}"})[0] == 401
        status, body, _ = raw(live, "GET", "/v1/models", headers={"Authorization": b"Bearer \xff\xfe"})
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        with grpc.insecure_channel(live.grpc_target) as ch:
            pb_grpc.GenerationServiceStub(ch).GetModelInfo(
                pb.GetModelInfoRequest(), timeout=10, metadata=(("authorization", f"bearer {TOKEN}"),))


BAD_BODIES = {
    "max_tokens 1e400": b'{"prompt": "x", "max_tokens": 1e400}',
    "max_tokens of 400 digits": b'{"prompt": "x", "max_tokens": ' + b"9" * 400 + b"}",
    "seed of 5000 digits": b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}",
    "deeply nested JSON": b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "invalid UTF-8": b'{"prompt": "\xff\xfe"}',
    "token ids out of range": b'{"prompt": [1, ' + b"9" * 400 + b"]}",
    "body over the 4 MiB limit": b'{"prompt": "' + b"x" * (5 << 20) + b'"}',
}
BAD_CHAT = {
    "non-string text part": {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    "non-object content part": {"messages": [{"role": "user", "content": [1, None]}]},
    "message not an object": {"messages": ["hi"]},
    "role not a string": {"messages": [{"role": ["user"], "content": "x"}]},
}


@pytest.mark.parametrize("name", list(BAD_BODIES) + list(BAD_CHAT))
def test_hostile_bodies_get_4xx_with_openai_json(tiny_llm, name):
    with live_server(tiny_llm) as live:
        if name in BAD_BODIES:
            status, body, _ = raw(live, "POST", "/v1/completions", BAD_BODIES[name], JSON)
        else:
            status, body, _ = raw(live, "POST", "/v1/chat/completions", json.dumps(BAD_CHAT[name]).encode(), JSON)
    assert 400 <= status < 500, (status, body[:300])
    err = json.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and err["message"]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_browser_simple_bodies_are_refused(tiny_llm, content_type):
    with live_server(tiny_llm) as live:
        body = json.dumps({"prompt": "x", "max_tokens": 4}).encode()
        status, resp, _ = raw(live, "POST", "/v1/completions", body, {"Content-Type": content_type})
        assert status == 415 and json.loads(resp)["error"]["code"] == "unsupported_media_type"
        assert raw(live, "POST", "/v1/completions", body, JSON)[0] == 200


def test_echoed_input_is_truncated_in_errors_and_logs(tiny_llm):
    from celeris.server.telemetry import configure_logging

    logs = io.StringIO()
    configure_logging(json_logs=True, stream=logs)
    try:
        with live_server(tiny_llm) as live:
            role = "r" * (3 << 20)  # a 3 MiB role
            status, body, _ = raw(live, "POST", "/v1/chat/completions",
                                  json.dumps({"messages": [{"role": role, "content": "x"}]}).encode(), JSON)
            assert status == 400 and len(body) < 4096, len(body)
            assert json.loads(body)["error"]["param"] == "messages[0].role"
            with grpc.insecure_channel(live.grpc_target) as ch:
                with pytest.raises(grpc.RpcError) as e:
                    list(pb_grpc.GenerationServiceStub(ch).Generate(pb.GenerateRequest(
                        chat=pb.ChatMessages(messages=[pb.ChatMessage(role="x" * 16384, content="x")])), timeout=10))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # not RESOURCE_EXHAUSTED (huge trailers)
            assert len(e.value.details()) < 1024
            assert [f for f, _ in field_violations(e.value)] == ["chat.messages[0].role"]
    finally:
        configure_logging(json_logs=True)
    lines = logs.getvalue().splitlines()
    assert lines and max(len(line) for line in lines) < 4096, max(len(line) for line in lines)
