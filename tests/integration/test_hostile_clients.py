"""Hostile clients against a real `celeris serve` process on loopback (issue 13).

Each test is bounded in count and time and prints its figures (run with -s); the reliability
table in docs/operations.md quotes them. Thresholds are loose on purpose (a shared 2-core machine): each
is several times what the fixed server needs and a fraction of what the old one took.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import socket
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from celeris.v1 import generation_pb2 as pb
from celeris.v1 import generation_pb2_grpc as pb_grpc
from celeris.server.health import SERVICE_NAME
from tests.integration.h2_client import ParkingConnection, settle
from tests.integration.server_process import assert_refused, free_port

pytestmark = pytest.mark.slow

PROSE = "It is a truth universally acknowledged, that a single man in possession of a good fortune "
BIG = (PROSE * (4_000_000 // len(PROSE) + 1))[:4_000_000]  # just under the 4 MiB message limit


def http_post(port: int, path: str, body: bytes, timeout: float = 30) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


class Pace:
    """A well-behaved client's view: the longest wait between two of its stream messages, and its
    slowest health check, over a window."""

    def __init__(self, target: str):
        self.target = target
        self.gap = self.health = 0.0
        self.messages = 0
        self.recording = False

    async def stream_forever(self) -> None:
        async with grpc.aio.insecure_channel(self.target) as ch:
            stub, last = pb_grpc.GenerationServiceStub(ch), time.monotonic()
            while True:
                req = pb.GenerateRequest(prompt="Emma", gen_length=32, steps=32, block_length=32)
                async for _ in stub.Generate(req, timeout=30):
                    now = time.monotonic()
                    if self.recording:
                        self.gap, self.messages = max(self.gap, now - last), self.messages + 1
                    last = now

    async def check_health_forever(self) -> None:
        async with grpc.aio.insecure_channel(self.target) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                t0 = time.monotonic()
                await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=30)
                if self.recording:
                    self.health = max(self.health, time.monotonic() - t0)
                await asyncio.sleep(0.05)


async def test_oversized_prompts_do_not_stall_other_clients_or_health(spawn):
    http_port = free_port()
    proc = spawn("--http-port", str(http_port))
    pace = Pace(proc.target)
    tasks = [asyncio.create_task(pace.stream_forever()), asyncio.create_task(pace.check_health_forever())]
    codes: list[object] = []

    def attack_grpc() -> None:  # blocking clients in threads: the test's own loop stays free
        with grpc.insecure_channel(proc.target, options=[("grpc.max_send_message_length", 8 << 20)]) as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            for req in [pb.GenerateRequest(prompt=BIG)] * 16 + [pb.GenerateRequest(
                    chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=BIG)]))] * 4:
                try:
                    list(stub.Generate(req, timeout=60))
                except grpc.RpcError as e:
                    codes.append(e.code())

    def attack_http() -> None:
        for body in [{"prompt": BIG, "max_tokens": 16}] * 8 + [{"messages": [{"role": "user", "content": BIG}]}] * 4:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            codes.append(http_post(http_port, path, json.dumps(body).encode(), 60)[0])

    try:
        await asyncio.sleep(1.0)  # the victims are in their stride
        pace.recording = True
        t0 = time.monotonic()
        await asyncio.wait_for(asyncio.gather(asyncio.to_thread(attack_grpc), asyncio.to_thread(attack_http)), 120)
        attack_s = time.monotonic() - t0
        pace.recording = False
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert codes.count(grpc.StatusCode.INVALID_ARGUMENT) == 20 and codes.count(400) == 12, codes
    assert pace.messages > 20, "the other client's stream did not progress during the attack"
    assert pace.gap < 2.0, f"another client's stream stalled {pace.gap:.2f} s"
    assert pace.health < 2.0, f"a health check took {pace.health:.2f} s"
    print(f"\noversized: 32 prompts of 4 MB (16 gRPC, 4 gRPC chat, 8 HTTP, 4 HTTP chat) over {attack_s:.1f} s, "
          f"all refused before tokenizing; "
          f"other client's worst gap {1e3 * pace.gap:.0f} ms over {pace.messages} messages, "
          f"slowest health check {1e3 * pace.health:.0f} ms")


PARK = pb.GenerateRequest(prompt="Emma", gen_length=512, steps=512, block_length=512)  # long, for SIGTERM
QUICK = pb.GenerateRequest(prompt="Emma", gen_length=16, steps=16, block_length=16)


def test_unread_streams_are_bounded_and_count_against_admission(spawn):
    """Streams opened and never read (the client's receive window stays 0): at most max_streams
    are held, the rest are refused at once, memory stays bounded, and the places come back when
    the client leaves. The engine finishes each request in a few steps; only its handler parks."""
    cap = 8  # --max-batch 4 + --max-queue 4
    proc = spawn("--max-batch", "4", "--max-queue", "4", "--max-gen-length", "64")
    conns = [ParkingConnection(proc.port) for _ in range(8)]  # 30 streams each, under the per-connection 100
    opened = 0
    try:
        time.sleep(0.3)  # settings exchanged
        t0, rss0 = time.monotonic(), None
        while time.monotonic() < t0 + 8.0 and opened < 240:  # ~30 new unread streams a second
            assert conns[opened % 8].open(QUICK) is not None
            opened += 1
            time.sleep(0.03)
            if rss0 is None and time.monotonic() > t0 + 2.0:
                rss0 = proc.rss_kib()
        counts = settle(conns, 1.0)
        grown = (proc.rss_kib() - rss0) / 1024
        metrics = proc.metrics()
        assert proc.health(timeout=5) == health_pb2.HealthCheckResponse.SERVING
        assert counts.get("parked", 0) <= cap, f"{counts} of {opened}: more unread streams held than {cap}"
        assert metrics["celeris_open_streams"] <= cap
        assert counts.get("8", 0) >= opened - cap, counts  # 8 = RESOURCE_EXHAUSTED, trailers-only
        assert grown < 16, f"server memory grew {grown:.1f} MiB after warm-up"
    finally:
        for c in conns:
            c.close()
    deadline = time.monotonic() + 15
    while proc.metrics()["celeris_open_streams"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.metrics()["celeris_open_streams"] == 0, "places not given back after the client left"
    with grpc.insecure_channel(proc.target) as ch:  # and the server serves again
        msgs = list(pb_grpc.GenerationServiceStub(ch).Generate(QUICK, timeout=30))
    assert msgs[-1].done
    print(f"\nparked: {opened} never-read streams opened in 8 s over 8 connections (receive window 0); "
          f"{counts.get('parked', 0)} held (limit {cap}), {counts.get('8', 0)} refused with RESOURCE_EXHAUSTED; "
          f"server RSS {grown:+.1f} MiB over the last 6 s")


def test_per_connection_call_limit(spawn):
    """Calls past --max-streams-per-connection get a counted RESOURCE_EXHAUSTED from the server,
    not an uncounted REFUSED_STREAM from the transport (whose own limit sits well above)."""
    proc = spawn("--max-batch", "4", "--max-queue", "28", "--max-streams-per-connection", "3")
    conn = ParkingConnection(proc.port)
    try:
        time.sleep(0.3)
        assert conn.max_concurrent_streams > 3  # HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS
        opened = [conn.open(QUICK) for _ in range(10)]
        assert None not in opened
        counts = settle([conn], 1.0)
        metrics = proc.metrics()
        assert counts.get("parked", 0) == 3 and counts.get("8", 0) == 7, counts
        assert metrics["celeris_open_streams"] <= 3
        assert metrics["celeris_requests_total{code=RESOURCE_EXHAUSTED,outcome=error}"] == 7
    finally:
        conn.close()


def _park_http(port: int) -> socket.socket:
    """A streaming HTTP request whose response is never read."""
    body = json.dumps({"prompt": "Emma", "max_tokens": 512, "steps": 512, "block_length": 512,
                       "stream": True, "diffusing": True}).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return s


async def test_sigterm_drains_both_doors_together_within_one_grace(spawn):
    """Both doors refuse new work after the drain, and close within one shared grace period:
    checked on the phases the server logs, in order (draining, refusing, both doors closing before
    either is closed, stopped), never on the clock, so a loaded machine cannot fail it."""
    drain, grace = 0.5, 4.0
    http_port = free_port()
    proc = spawn("--http-port", str(http_port), "--max-gen-length", "512", "--drain-seconds", str(drain),
                 "--grace-seconds", str(grace))
    parked_http = _park_http(http_port)
    async with grpc.aio.insecure_channel(proc.target) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        parked_grpc = stub.Generate(PARK, timeout=60)  # never read: outlives the grace period
        await asyncio.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait_for_event, "server.refusing")
        # after the drain gRPC refuses new calls...
        codes = await assert_refused(lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5))
        try:  # ... and so does HTTP
            status = (await asyncio.to_thread(http_post, http_port, "/v1/completions", b'{"prompt": "x"}', 5))[0]
        except OSError:
            status = None  # connection refused: also a refusal
        assert status in (503, None), status
        code = await asyncio.to_thread(proc.wait, 60)
        parked_grpc.cancel()
    parked_http.close()
    assert code == 0
    phases = [(r["event"], r.get("door")) for r in proc.records() if str(r.get("event")).startswith("server.")]
    names = [p for p, _ in phases]
    first = {name: names.index(name) for name in ("server.draining", "server.refusing", "server.stopped")}
    closing = [i for i, (p, _) in enumerate(phases) if p == "server.door_closing"]
    closed = [i for i, (p, _) in enumerate(phases) if p == "server.door_closed"]
    assert first["server.draining"] < first["server.refusing"] < min(closing), phases
    assert sorted(phases[i][1] for i in closing) == ["grpc", "http"] == sorted(phases[i][1] for i in closed)
    assert max(closing) < min(closed), f"one door waited for the other (two grace periods): {phases}"
    assert max(closed) < first["server.stopped"], phases
    assert not [r for r in proc.records() if str(r.get("method", "")).endswith("/GetModelInfo")], \
        "a refused call reached its handler"
    print(f"\nsigterm (HTTP gateway on): both doors refused new work after the {drain} s drain "
          f"(gRPC {[c.name for c in codes]}); phases {names}")


async def test_logs_stay_json_lines_through_cancels_and_faults(spawn, tmp_path):
    proc = spawn()
    async with grpc.aio.insecure_channel(proc.target) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        for i in range(20):  # cancelled mid-stream
            call = stub.Generate(pb.GenerateRequest(prompt="Emma", gen_length=64, steps=64, block_length=64))
            await call.read()
            await call.read()
            call.cancel()
        await asyncio.sleep(0.5)
    faulty = spawn(module="tests.integration.fault_server", env={"CELERIS_FAULT_STEP": "2"})
    async with grpc.aio.insecure_channel(faulty.target) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            _ = [m async for m in pb_grpc.GenerationServiceStub(ch).Generate(
                pb.GenerateRequest(prompt="Emma", gen_length=8, steps=8, block_length=8), timeout=30)]
        assert e.value.code() == grpc.StatusCode.INTERNAL
    time.sleep(0.5)
    for p in (proc, faulty):
        lines = [line for line in p.log_path.read_text().splitlines() if line.strip()]
        bad = [line for line in lines if not _is_json_object(line)]
        assert not bad, bad[:5]
        assert not any("Failed to detach context" in line for line in lines)
    records = [json.loads(line) for line in faulty.log_path.read_text().splitlines() if line.strip()]
    failures = [r for r in records if "denoising step failed" in str(r.get("event"))]
    assert failures and isinstance(failures[0].get("exception"), list), failures
    assert "injected fault" in json.dumps(failures[0]["exception"])


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


