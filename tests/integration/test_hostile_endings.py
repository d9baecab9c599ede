"""Hostile clients, round three (issue 29): endings, slow senders, unread streams, broken log
pipes, ports in use and overload, against real `celeris serve` processes on loopback.

Every loop is bounded in count and time and targets 127.0.0.1 only. Assertions are on behaviour
(codes, bodies, counts, log order, memory), never on a tight wall clock.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from celeris.v1 import generation_pb2 as pb
from celeris.v1 import generation_pb2_grpc as pb_grpc
from tests.integration.h2_client import ParkingConnection
from tests.integration.server_process import ROOT, free_port, retry_delay_s

pytestmark = pytest.mark.slow

LONG = {"prompt": "Emma", "max_tokens": 512, "steps": 512, "block_length": 512}


def _http_stream(port: int, body: dict, out: dict, key: str) -> None:
    """A client that reads its response to the end (whatever the server sends) into out[key]."""
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(data), data))
    got = b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    except OSError:
        pass
    s.close()
    out[key] = got


def _park_http(port: int) -> socket.socket:
    body = json.dumps({**LONG, "stream": True, "diffusing": True}).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return s


# ---------------------------------------------------------------- items 7 and 11: shutdown


async def test_sigterm_ends_every_stream_properly_on_both_doors(spawn):
    """When the grace runs out, a reading SSE client gets an error event then [DONE], a
    non-streaming client a JSON 503, a gRPC client UNAVAILABLE; the phases run in order, both
    doors closing together (checked in the log's order, not on the clock)."""
    http_port = free_port()
    proc = spawn("--http-port", str(http_port), "--drain-seconds", "0.3", "--grace-seconds", "1.5")
    out: dict[str, bytes] = {}
    readers = [threading.Thread(target=_http_stream, args=(http_port, {**LONG, "stream": True}, out, "sse")),
               threading.Thread(target=_http_stream, args=(http_port, LONG, out, "json"))]
    for t in readers:
        t.start()
    parked = _park_http(http_port)
    async with grpc.aio.insecure_channel(proc.target) as ch:
        call = pb_grpc.GenerationServiceStub(ch).Generate(
            pb.GenerateRequest(prompt="Emma", gen_length=512, steps=512, block_length=512), timeout=120)
        await call.read()  # running
        deadline = time.monotonic() + 30
        while proc.metrics()["celeris_open_streams"] < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            while await call.read() is not grpc.aio.EOF:
                pass
        code = await asyncio.to_thread(proc.wait, 60)
    for t in readers:
        t.join(30)
    parked.close()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
    assert code == 0
    sse = out["sse"].decode(errors="replace")
    events = [line[len("data: "):] for line in sse.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", sse[-300:]
    assert json.loads(events[-2])["error"]["code"] == "unavailable", events[-2]
    head, _, body = out["json"].partition(b"\r\n\r\n")
    assert head.split()[1] == b"503" and json.loads(body)["error"]["code"] == "unavailable", out["json"][:300]
    phases = [(r["event"], r.get("door")) for r in proc.records() if str(r.get("event")).startswith("server.")]
    names = [p for p, _ in phases]
    order = ["server.draining", "server.refusing", "server.door_closing", "server.door_closed", "server.stopped"]
    assert [n for n in names if n in order] == sorted((n for n in names if n in order), key=order.index), phases
    closing = [i for i, (p, _) in enumerate(phases) if p == "server.door_closing"]
    closed = [i for i, (p, _) in enumerate(phases) if p == "server.door_closed"]
    assert {phases[i][1] for i in closing} == {"http", "grpc"} == {phases[i][1] for i in closed}
    assert max(closing) < min(closed), "one door waited for the other: two grace periods"
    print(f"\nshutdown: SSE ended with an error event then [DONE], non-streaming got 503 JSON, gRPC UNAVAILABLE; "
          f"phases {names}")


# ---------------------------------------------------------------- item 8: slow senders


def test_slow_senders_are_cut_off(spawn):
    http_port = free_port()
    spawn("--http-port", str(http_port), "--header-timeout", "2", "--body-timeout", "2")
    heads, bodies = [], []
    for _ in range(40):
        s = socket.create_connection(("127.0.0.1", http_port), timeout=5)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        heads.append(s)
        s = socket.create_connection(("127.0.0.1", http_port), timeout=5)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{")
        bodies.append(s)
    open_ = {s: b"" for s in heads + bodies}
    deadline = time.monotonic() + 60
    while open_ and time.monotonic() < deadline:  # one byte per connection every 0.5 s
        for s in list(open_):
            try:
                s.sendall(b"X" if s in heads else b" ")
                s.setblocking(False)
                try:
                    chunk = s.recv(65536)
                    if not chunk:
                        raise ConnectionResetError
                    open_[s] += chunk
                except BlockingIOError:
                    pass
                finally:
                    s.setblocking(True)
            except OSError:
                closed_with = open_.pop(s)
                if s in bodies:
                    assert closed_with.split()[1] == b"408", closed_with[:200]
                s.close()
        time.sleep(0.5)
    left = len(open_)
    for s in open_:
        s.close()
    assert left == 0, f"{left} of 80 slow connections still open after 60 s"
    print("\nslow senders: 40 dribbled headers and 40 dribbled bodies, all cut (bodies with 408 JSON)")


# ---------------------------------------------------------------- item 9: unread streams


def test_never_read_streams_hold_bounded_memory_then_are_abandoned(spawn):
    # Simulated 5 ms steps (no forward; events and messages are real): 512 steps in seconds, not minutes.
    proc = spawn("--max-gen-length", "512", "--unread-timeout", "20", "--simulate-step-ms", "5")
    full = pb.GenerateRequest(prompt="Emma", gen_length=512, steps=512, block_length=512)  # full snapshots
    quick = pb.GenerateRequest(prompt="Emma", gen_length=8, steps=8, block_length=8)
    conns = [ParkingConnection(proc.port) for _ in range(2)]
    k = 16
    try:
        time.sleep(0.3)
        with grpc.insecure_channel(proc.target) as ch:  # warm the allocator with the same kind of work
            list(pb_grpc.GenerationServiceStub(ch).Generate(full, timeout=120))
        rss0 = proc.rss_kib()
        t0 = time.monotonic()
        for i in range(k):
            assert conns[i % 2].open(full) is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the engine finishes them all (their handlers park)
            m = proc.metrics()
            if m["celeris_open_streams"] == k and m["celeris_running_requests"] == m["celeris_queue_depth"] == 0:
                break
            time.sleep(0.5)
        per_stream = (proc.rss_kib() - rss0) / 1024 / k
        assert m["celeris_open_streams"] == k, m  # all still held (none abandoned yet)
        took = time.monotonic() - t0
        abandoned_by = time.monotonic() + 90
        while proc.metrics()["celeris_open_streams"] and time.monotonic() < abandoned_by:
            time.sleep(0.5)
        freed = proc.metrics()["celeris_open_streams"]
        with grpc.insecure_channel(proc.target) as ch:
            assert list(pb_grpc.GenerationServiceStub(ch).Generate(quick, timeout=60))[-1].done
    finally:
        for c in conns:
            c.close()
    assert per_stream < 1.0, f"{per_stream:.2f} MiB per never-read stream at gen 512"
    assert freed == 0, "unread streams still hold places after the unread timeout"
    assert any("abandoned the unread stream" in str(r.get("event")) for r in proc.records())
    print(f"\nunread: {k} never-read gRPC streams at gen 512 (full snapshots, 512 steps): "
          f"{per_stream * 1024:.0f} KiB RSS each ({took:.0f} s to decode); all abandoned and their places freed after the unread timeout")


# ---------------------------------------------------------------- item 10: a closed log pipe


def test_closed_stdout_pipe_breaks_neither_serving_nor_signals(tiny_model_dir, tmp_path):
    port = free_port()
    argv = [sys.executable, "-m", "celeris.server.cli", "serve", "--model", str(tiny_model_dir), "--host", "127.0.0.1",
            "--grpc-port", str(port), "--threads", "1", "--log-format", "json", "--no-http"]
    env = os.environ | {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("CELERIS_API_TOKEN", None)
    with open(tmp_path / "stderr.log", "wb") as err:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err)
    try:
        deadline = time.monotonic() + 90
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            from grpc_health.v1 import health_pb2_grpc

            health = health_pb2_grpc.HealthStub(ch)
            status = None
            while status != health_pb2.HealthCheckResponse.SERVING and time.monotonic() < deadline:
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                except grpc.RpcError:
                    time.sleep(0.3)
            proc.stdout.close()  # `celeris serve | tee log`, then tee is gone
            stub = pb_grpc.GenerationServiceStub(ch)
            for _ in range(3):
                msgs = list(stub.Generate(pb.GenerateRequest(prompt="Emma", gen_length=8, steps=8, block_length=8),
                                          timeout=60))
                assert msgs[-1].done
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGINT)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert code == 0, (tmp_path / "stderr.log").read_text()[-2000:]
    print("\nclosed stdout pipe: 3 generations served, health SERVING, SIGINT stopped it (exit 0)")


def test_health_says_not_serving_when_the_engine_cannot_serve(spawn):
    proc = spawn(module="tests.integration.fault_server", env={"CELERIS_FAULT_STEP": "2", "CELERIS_FAULT_KIND": "fatal"})
    codes = []
    with grpc.insecure_channel(proc.target) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        for _ in range(2):
            try:
                list(stub.Generate(pb.GenerateRequest(prompt="Emma", gen_length=8, steps=8, block_length=8),
                                   timeout=30))
                codes.append("OK")
            except grpc.RpcError as e:
                codes.append(e.code().name)
    deadline = time.monotonic() + 30
    while proc.health() != health_pb2.HealthCheckResponse.NOT_SERVING and time.monotonic() < deadline:
        time.sleep(0.2)
    assert codes == ["INTERNAL", "UNAVAILABLE"], codes
    assert proc.health() == health_pb2.HealthCheckResponse.NOT_SERVING
    print(f"\ndead step worker: {codes}, health NOT_SERVING")


# ---------------------------------------------------------------- item 12: ports in use


def _serve_fails(tiny_model_dir, tmp_path, *flags: str) -> str:
    """Run `celeris serve` expected to fail at start; its stderr."""
    argv = [sys.executable, "-m", "celeris.server.cli", "serve", "--model", str(tiny_model_dir), "--threads", "1",
            "--log-format", "json", "--host", "127.0.0.1", *flags]
    if not {"--port", "--http-port"} & set(flags):  # HTTP's default port 8000 is not this test's to take
        argv.append("--no-http")
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, timeout=120, text=True)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    return done.stderr


def test_a_port_in_use_is_one_clear_error_on_every_door(spawn, tiny_model_dir, tmp_path):
    first = spawn()
    err = _serve_fails(tiny_model_dir, tmp_path, "--grpc-port", str(first.port))
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    try:
        errs = [err, _serve_fails(tiny_model_dir, tmp_path, "--grpc-port", str(free_port()), "--port", str(busy)),
                _serve_fails(tiny_model_dir, tmp_path, "--grpc-port", str(free_port()), "--metrics-port", str(busy))]
    finally:
        taken.close()
    for door, port, text in zip(("gRPC", "HTTP", "metrics"), (first.port, busy, busy), errs):
        lines = [line for line in text.splitlines() if line.startswith("celeris serve: error:")]
        assert len(lines) == 1 and f"{door} port {port}" in lines[0] and "in use" in lines[0], text[-1500:]
        assert "Traceback" not in text, text[-1500:]
    assert first.health() == health_pb2.HealthCheckResponse.SERVING  # the first server is untouched
    print(f"\nports: gRPC, HTTP and metrics ports in use -> one line each: {errs[0].strip().splitlines()[-1]}")


# ---------------------------------------------------------------- item 14: overload is counted


async def test_overload_is_always_resource_exhausted_and_counted(spawn):
    proc = spawn("--max-streams-per-client", "0")
    codes: collections.Counter[str] = collections.Counter()
    retry_missing = 0
    async with grpc.aio.insecure_channel(proc.target) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        left = [1200]

        async def worker() -> None:
            nonlocal retry_missing
            while left[0] > 0:
                left[0] -= 1
                try:
                    async for _ in stub.Generate(pb.GenerateRequest(prompt="Emma", gen_length=8, steps=4,
                                                                     block_length=8), timeout=120):
                        pass
                    codes["OK"] += 1
                except grpc.aio.AioRpcError as e:
                    codes[e.code().name] += 1
                    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not retry_delay_s(e):
                        retry_missing += 1

        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(256))), 300)
    time.sleep(0.5)
    counted = sum(v for k, v in proc.metrics().items() if k.startswith("celeris_requests_total{"))
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
    assert codes["RESOURCE_EXHAUSTED"] > 0 and retry_missing == 0, (codes, retry_missing)
    assert counted == sum(codes.values()), (counted, codes)  # the warm-up is not a request
    print(f"\noverload: 1200 calls from 256 concurrent streams on one connection: {dict(codes)}; "
          f"server counted {int(counted)}")
