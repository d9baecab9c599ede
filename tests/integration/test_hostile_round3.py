"""Hostile clients, round three (issue 29), against real `celeris serve` processes on loopback.

Every loop is bounded in count and time and targets 127.0.0.1 only. Assertions are on behaviour
(codes, bodies, counts, CPU seconds, log contents and order), never on a tight wall clock: the
suite must pass at load 8 on 2 cores. Each test prints what it measured (run with -s).
"""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from celeris.v1 import generation_pb2 as pb
from celeris.v1 import generation_pb2_grpc as pb_grpc
from tests.integration.h2_client import ParkingConnection, settle
from tests.integration.server_process import ROOT, ServerProcess, free_port

pytestmark = pytest.mark.slow

TOKEN = "tok-5ecret-7f3a9c"
MARKER = "zebra-marker-prompt-41"
GIB = 1 << 30


def _bomb(inflated: int = GIB) -> bytes:
    """gzip of `inflated` zero bytes (about 1 MB for 1 GiB)."""
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = bytes(1 << 20)
    parts = [c.compress(chunk) for _ in range(inflated >> 20)]
    return b"".join(parts) + c.flush()


def request(port: int, method: str, path: str, body: bytes = b"", headers: dict | None = None,
            source: str = "127.0.0.1", timeout: float = 60) -> tuple[int, bytes, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout, source_address=(source, 0))
    try:
        conn.request(method, path, body, {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read(), dict(resp.getheaders())
    finally:
        conn.close()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- item 1: compressed bodies


def test_compressed_body_flood_is_inflated_off_the_loop_and_capped(spawn):
    http_port = free_port()
    proc = spawn("--http-port", str(http_port))
    bomb = _bomb()
    worst = {"grpc": 0.0, "http": 0.0}
    stop = threading.Event()

    def probe_health() -> None:  # both doors' health, as a readiness probe would
        with grpc.insecure_channel(proc.target) as ch:
            from grpc_health.v1 import health_pb2_grpc

            stub = health_pb2_grpc.HealthStub(ch)
            while not stop.is_set():
                t0 = time.monotonic()
                stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
                worst["grpc"] = max(worst["grpc"], time.monotonic() - t0)
                t0 = time.monotonic()
                assert request(http_port, "GET", "/health", timeout=30)[0] == 200
                worst["http"] = max(worst["http"], time.monotonic() - t0)
                time.sleep(0.05)

    results: list[tuple[int, bytes]] = []

    def attack() -> None:
        status, body, _ = request(http_port, "POST", "/v1/completions", bomb, {"Content-Encoding": "gzip"})
        results.append((status, body))

    prober = threading.Thread(target=probe_health, daemon=True)
    prober.start()
    time.sleep(0.5)
    cpu0 = cpu_seconds(proc.proc.pid)
    attackers = [threading.Thread(target=attack, daemon=True) for _ in range(12)]
    for t in attackers:
        t.start()
    for t in attackers:
        t.join(120)
    time.sleep(0.5)
    stop.set()
    prober.join(60)
    cpu = cpu_seconds(proc.proc.pid) - cpu0
    assert [s for s, _ in results] == [413] * 12, results[:2]
    assert all(json.loads(b)["error"]["code"] == "request_too_large" for _, b in results)
    # Inflating 12 GiB takes the old server tens of CPU seconds; capped inflation takes a fraction of one.
    assert cpu < 6.0, f"the server spent {cpu:.1f} CPU s on 12 compressed bodies"
    assert max(worst.values()) < 2.0, worst  # a readiness probe's timeout; typically tens of ms
    # Small compressed bodies are still served, and other encodings are refused, not ignored.
    small = gzip.compress(json.dumps({"prompt": "Emma", "max_tokens": 4}).encode())
    assert request(http_port, "POST", "/v1/completions", small, {"Content-Encoding": "gzip"})[0] == 200
    status, body, _ = request(http_port, "POST", "/v1/completions", b"xx", {"Content-Encoding": "br"})
    assert status == 415 and json.loads(body)["error"]["param"] == "Content-Encoding"
    print(f"\ncompressed flood: 12 gzip bodies of {len(bomb) / 1e6:.1f} MB (1 GiB inflated each): all 413; "
          f"server CPU {cpu:.2f} s; slowest health check gRPC {1e3 * worst['grpc']:.0f} ms, "
          f"HTTP {1e3 * worst['http']:.0f} ms")


# ---------------------------------------------------------------- item 2: secrets out of logs


def test_logs_hold_no_token_or_prompt_text_whatever_fails(spawn):
    http_port = free_port()
    env = {"CELERIS_FAULT_STEP": "3", "CELERIS_FAULT_HTTP": "inject-http-fault"}
    proc = spawn("--http-port", str(http_port), "--api-token", TOKEN, "--rate-limit", "5",
                 module="tests.integration.fault_server", env=env)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    prompt = f"{MARKER} and more words"
    post = lambda body, headers=auth, path="/v1/completions": request(  # noqa: E731
        http_port, "POST", path, json.dumps(body).encode() if not isinstance(body, bytes) else body, headers)
    codes = [
        post({"prompt": "inject-http-fault " + prompt, "max_tokens": 4})[0],  # the injected HTTP bug: 500
        post({"prompt": prompt}, {"Authorization": f"Bearer {TOKEN}x{MARKER}"})[0],  # 401
        post({"prompt": prompt, "remasking": "bogus"})[0],  # 400
        post({"prompt": prompt, "model": "no-such-model"})[0],  # 404
        post(prompt.encode(), {**auth, "Content-Type": "text/plain"})[0],  # 415
        post({"prompt": prompt * 200_000})[0],  # 413
        post({"prompt": "\ud800" + prompt})[0],  # 400
        post({"prompt": prompt}, path="/tokenize")[0],  # 200
    ]
    md = [("authorization", f"Bearer {TOKEN}")]
    grpc_codes = []
    with grpc.insecure_channel(proc.target) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        for req in [pb.GenerateRequest(prompt=prompt, gen_length=8, steps=8, block_length=8),  # step fault: INTERNAL
                    pb.GenerateRequest(prompt=prompt, gen_length=7, steps=8, block_length=8),  # 400
                    pb.GenerateRequest(prompt=prompt, gen_length=4, steps=4, block_length=4)]:  # OK
            try:
                list(stub.Generate(req, metadata=md, timeout=60))
                grpc_codes.append("OK")
            except grpc.RpcError as e:
                grpc_codes.append(e.code().name)
        for _ in range(40):  # until the rate limit answers
            try:
                stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md, timeout=10)
            except grpc.RpcError as e:
                grpc_codes.append(e.code().name)
                break
    assert codes == [500, 401, 400, 404, 415, 413, 400, 200], codes
    assert grpc_codes[:3] == ["INTERNAL", "INVALID_ARGUMENT", "OK"] and "RESOURCE_EXHAUSTED" in grpc_codes, grpc_codes
    time.sleep(0.5)
    text = proc.log_path.read_text(errors="replace")
    records = proc.records()
    assert any(r.get("event") == "http.internal_error" and r.get("exception") for r in records)
    assert any(r.get("event") == "request.failed" and r.get("exception") for r in records)
    assert TOKEN not in text, "the bearer token is in the log"
    assert MARKER not in text, "prompt text is in the log"
    print(f"\nlogs: {len(records)} lines after 8 HTTP and {len(grpc_codes)} gRPC calls covering 500, 401, 400, 404, "
          f"415, 413, 429/RESOURCE_EXHAUSTED and INTERNAL: no token, no prompt text")


# ---------------------------------------------------------------- items 3, 13, 15: inputs and echoes


def test_hostile_inputs_get_bounded_json_errors_never_500(spawn):
    http_port = free_port()
    proc = spawn("--http-port", str(http_port))
    post = lambda path, body: request(http_port, "POST", path, body)  # noqa: E731
    lone = [("/v1/completions", b'{"prompt": "\\ud800 hi", "max_tokens": 4}', "prompt"),
            ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\udfff"}]}', "messages[0].content"),
            ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
            ("/v1/completions", b'{"prompt": "x", "stop": ["\\udbff"]}', "stop[0]")]
    for path, body, field in lone:
        status, raw, _ = post(path, body)
        assert status == 400, (path, status, raw)
        assert json.loads(raw)["error"]["param"] == field, raw
    huge = "A" * (3 << 20)
    for name in ("remasking", "kv_cache", "factor_rule", "schedule"):
        status, raw, _ = post("/v1/completions", json.dumps({"prompt": "x", name: huge}).encode())
        assert status == 400 and len(raw) < 4096, (name, status, len(raw))
    with grpc.insecure_channel(proc.target) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        vocab = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).vocab_size
        for req in (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[vocab]), gen_length=4, steps=4, block_length=4),
                    pb.GenerateRequest(prompt="x", stop_token_ids=[vocab], gen_length=4, steps=4, block_length=4),
                    pb.GenerateRequest(prompt="x", stop=[huge[:4000]], gen_length=4, steps=4, block_length=4)):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(e.value.details()) < 2048
    # aiohttp's own protocol errors: the same JSON shape, not plain text.
    for raw_request in (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
                        b"GARBAGE / HTTP/9.9 what\r\n\r\n",
                        b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", http_port), timeout=30) as s:
            s.sendall(raw_request)
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.split()[1].startswith(b"4"), head
        assert b"application/json" in head.lower(), head
        assert "error" in json.loads(body), body
    print("\ninputs: lone surrogates in 4 places -> 400 naming the field; 3 MiB enum values -> <4 KB errors; "
          "token id = vocab size -> INVALID_ARGUMENT; protocol errors -> JSON 4xx")


# ---------------------------------------------------------------- items 4, 5, 6: fairness per client


def _park_http(port: int, source: str, n: int) -> socket.socket:
    """A streaming request with n samples whose response is never read."""
    body = json.dumps({"prompt": "Emma", "max_tokens": 256, "steps": 256, "block_length": 256, "n": n,
                       "stream": True, "diffusing": True}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return s


def _status_line(s: socket.socket, timeout: float = 30) -> int:
    s.settimeout(timeout)
    return int(s.recv(64).split()[1])


def test_one_client_cannot_take_every_place(spawn):
    """16 places (batch 4 + queue 12): one client's share is 8, on both doors; another address is served."""
    http_port = free_port()
    proc = spawn("--http-port", str(http_port), "--max-batch", "4", "--max-queue", "12", "--unread-timeout", "0")
    hog = [_park_http(http_port, "127.0.0.1", 4) for _ in range(5)]  # 20 samples asked
    conn = ParkingConnection(proc.port)  # and never-read gRPC streams from the same address
    try:
        statuses = sorted(_status_line(s) for s in hog)
        time.sleep(0.3)
        for _ in range(10):
            conn.open(pb.GenerateRequest(prompt="Emma", gen_length=64, steps=64, block_length=64))
        counts = settle([conn], 1.0)
        held = proc.metrics()["celeris_open_streams"]
        other = request(http_port, "POST", "/v1/completions",
                        json.dumps({"prompt": "Emma", "max_tokens": 8, "n": 4}).encode(), source="127.0.0.2")[0]
    finally:
        conn.close()
        for s in hog:
            s.close()
    assert statuses == [200, 200, 429, 429, 429], statuses  # 2 x 4 samples = the share of 8
    assert counts.get("parked", 0) == 0 and counts.get("8", 0) == 10, counts  # the share is used up
    assert held == 8, held
    assert other == 200, "a client on another address was refused"
    print(f"\nshare: one address asked 20 HTTP samples and 10 gRPC streams, held {held} of 16 places; "
          f"another address got {other}")


def test_rate_limit_and_admission_count_samples(spawn):
    http_port = free_port()
    proc = spawn("--http-port", str(http_port), "--rate-limit", "1", "--max-gen-length", "64")
    body = json.dumps({"prompt": "Emma", "max_tokens": 4, "steps": 4, "block_length": 4, "n": 16}).encode()
    http_codes = [request(http_port, "POST", "/v1/completions", body)[0] for _ in range(4)]
    grpc_codes = []
    with grpc.insecure_channel(proc.target) as ch:  # the same client (address): its bucket is in debt now
        stub = pb_grpc.GenerationServiceStub(ch)
        for _ in range(3):
            try:
                list(stub.Generate(pb.GenerateRequest(prompt="Emma", gen_length=4, steps=4, block_length=4, n=16),
                                   timeout=60))
                grpc_codes.append("OK")
            except grpc.RpcError as e:
                grpc_codes.append(e.code().name)
    generations = 16 * (http_codes.count(200) + grpc_codes.count("OK"))
    assert http_codes[0] == 200 and http_codes.count(200) == 1, http_codes  # burst 20: one call of 16
    assert grpc_codes == ["RESOURCE_EXHAUSTED"] * 3, grpc_codes
    assert generations <= 20 + 16
    print(f"\nrate limit 1/s burst 20: 7 calls with n=16 -> {generations} generations (HTTP {http_codes}, gRPC {grpc_codes})")


async def test_concurrent_n_calls_are_admitted_whole_or_not_at_all(spawn):
    """80 places, share off: of 8 concurrent calls with n=16, exactly 5 fit (the rest are refused
    at once; the admitted ones run for many seconds)."""
    proc = spawn("--max-streams-per-client", "0", "--max-gen-length", "256", "--unread-timeout", "0")
    async with grpc.aio.insecure_channel(proc.target) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        req = pb.GenerateRequest(prompt="Emma", gen_length=256, steps=256, block_length=256, n=16)
        calls = [stub.Generate(req, timeout=120) for _ in range(8)]
        codes = [asyncio.ensure_future(c.code()) for c in calls]
        deadline, held = time.monotonic() + 60, 0.0
        while time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            held = proc.metrics()["celeris_open_streams"]
            if sum(t.done() for t in codes) >= 3 and held == 80:
                break
        ended = [t.result() for t in codes if t.done()]
        for c in calls:
            c.cancel()
        await asyncio.gather(*codes, return_exceptions=True)
    assert ended == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 3, ended
    assert held == 80, held
    print(f"\nall or nothing: 8 concurrent calls with n=16 on 80 places: 5 admitted whole ({int(held)} places), "
          f"{len(ended)} refused")


# ---------------------------------------------------------------- item 15: loopback by default


def test_serve_binds_loopback_unless_asked_and_deploy_asks(tiny_model_dir, tmp_path):
    port = free_port()
    argv = [sys.executable, "-m", "celeris.server.cli", "serve", "--model", str(tiny_model_dir), "--grpc-port", str(port),
            "--threads", "1", "--log-format", "json", "--no-http"]  # no --host
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    env.pop("CELERIS_API_TOKEN", None)
    with open(tmp_path / "serve.log", "wb") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        probe = ServerProcess(tiny_model_dir, tmp_path / "unused.log", port=port)
        probe.proc = proc
        probe.wait_serving(90)  # served on 127.0.0.1 ...
        with pytest.raises(ConnectionRefusedError):  # ... and not on another address of this machine
            socket.create_connection(("127.0.0.2", port), timeout=5).close()
    finally:
        proc.kill()
        proc.wait(10)
    for path in ("deploy/Dockerfile", "deploy/Dockerfile.cuda", "deploy/k8s/base/deployment.yaml"):
        text = (ROOT / path).read_text()
        assert '"--host", "[::]"' in text or '"--host=[::]"' in text, f"{path} must ask for every interface"
    print("\nbind: `celeris serve` without --host answers on 127.0.0.1 only; the images and manifests pass [::]")
