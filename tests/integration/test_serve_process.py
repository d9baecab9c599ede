"""`celeris serve` as a person runs it: Ctrl-C on an idle server stops at once, SIGTERM still
drains, and health probes stay out of the info-level access log."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request

import pytest
from grpc_health.v1 import health_pb2

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
LONG_DRAIN = "60"  # far longer than any wait below: a stop that honours it cannot pass for "at once"


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_sigint_on_an_idle_server_exits_without_the_drain(spawn):
    proc = spawn("--drain-seconds", LONG_DRAIN, "--grace-seconds", LONG_DRAIN)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0  # would take 60 s if the drain were waited out
    assert time.monotonic() - t0 < 30
    events = [r.get("event") for r in proc.records()]
    assert "server.stopped" in events


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_sigterm_on_an_idle_server_still_drains(spawn):
    proc = spawn("--drain-seconds", LONG_DRAIN)
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while proc.health() != NOT_SERVING:  # balancers are told at once ...
        assert time.monotonic() < deadline, "health still SERVING after SIGTERM"
        time.sleep(0.1)
    time.sleep(1.0)
    assert proc.alive  # ... and the process waits out its drain for them
    signal_lines = [r for r in proc.records() if r.get("event") == "server.signal"]
    assert signal_lines and signal_lines[0]["signal"] == "SIGTERM" and signal_lines[0]["idle"] is False


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_health_probes_are_logged_at_debug_only_and_served_names_listed(spawn):
    from tests.integration.server_process import free_port

    http = free_port()
    quiet = spawn("--http-port", str(http), "--served-model-name", "celeris-tiny", "tiny")
    for _ in range(3):
        assert quiet.health() is not None
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=5) as r:
            assert r.status == 200
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/v1/models", timeout=5) as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == ["celeris-tiny", "tiny"]
    time.sleep(0.3)  # let the last access lines reach the log
    recs = quiet.records()
    http_paths = [r.get("path") for r in recs if r.get("event") == "http"]
    rpc_methods = [r.get("method") for r in recs if r.get("event") == "rpc"]
    assert "/v1/models" in http_paths and "/health" not in http_paths
    assert not any(m and m.startswith("/grpc.health.v1.Health/") for m in rpc_methods)

    http2 = free_port()
    loud = spawn("--http-port", str(http2), "--log-level", "debug")
    assert loud.health() is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{http2}/health", timeout=5) as r:
        assert r.status == 200
    time.sleep(0.3)
    recs = loud.records()
    probes = [r for r in recs if r.get("event") in ("rpc", "http")
              and (r.get("path") == "/health" or str(r.get("method", "")).startswith("/grpc.health.v1.Health/"))]
    assert probes and {r["level"] for r in probes} == {"debug"}


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
@pytest.mark.parametrize("door", ["gRPC", "HTTP", "metrics"])
def test_a_port_in_use_prints_one_line_and_nothing_else(door, tiny_model_dir, tmp_path):
    """The promised line, alone: no gRPC core log line, no shutdown records of the doors that had
    started before the taken one (the HTTP and metrics ports are bound after gRPC's)."""
    from tests.integration.server_process import ServerProcess

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        opts = {"gRPC": {"port": port}, "metrics": {"metrics_port": port}}.get(door, {})
        extra = ("--http-port", str(port)) if door == "HTTP" else ()
        proc = ServerProcess(tiny_model_dir, tmp_path / "unused.log", *extra, **opts)
        env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        out = subprocess.run(proc.argv, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 2
    assert out.stdout == "", out.stdout
    assert out.stderr.splitlines() == [f"celeris serve: error: {door} port {port} on 127.0.0.1 is already in use"], \
        out.stderr


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
@pytest.mark.parametrize("how", ["env", "env-blank", "flag"])
def test_an_empty_api_key_is_an_error_at_start_not_auth_off(how, tiny_model_dir, tmp_path):
    """`CELERIS_API_TOKEN=` (a Secret with an empty value) or `--api-key ''` meant "require a key":
    serving without one would be a silent hole. One line, exit 2, nothing served."""
    from celeris.server.settings import ServerSettings
    from tests.integration.server_process import ServerProcess

    proc = ServerProcess(tiny_model_dir, tmp_path / "unused.log", *(("--api-key", "") if how == "flag" else ()))
    env = os.environ | {"OMP_NUM_THREADS": "1", "CELERIS_API_TOKEN": " " if how == "env-blank" else ""}
    out = subprocess.run(proc.argv, capture_output=True, text=True, timeout=120, env=env)  # serving: no exit
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == ["celeris serve: error: the API key is empty (--api-key or $CELERIS_API_TOKEN "
                                       "set to ''); give a key, or leave both unset to serve without one"], out.stderr
    with pytest.raises(ValueError, match="api_token is empty"):
        ServerSettings(api_token="")
