"""The two child processes of scripts/bench_serving.py: `celeris serve` and the client load.

`ServeProcess` starts the real command on free loopback ports, waits on the gRPC health service,
and samples what the server says about itself: Prometheus metrics (steps, summed step seconds,
the event loop's CPU) and its process CPU from /proc/<pid>/stat (utime + stime; psutil is not a
dependency). `ClientProcess` is `python -m celeris_client.stream_load`, fed one JSON job per line.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
METRICS = {"steps": "celeris_steps_total", "forward_s": "celeris_step_latency_seconds_sum",
           "loop_cpu_s": "celeris_event_loop_cpu_seconds", "forwards": "celeris_forward_passes_total"}


def child_env() -> dict[str, str]:
    """The children run the installed `celeris` packages (`scripts/setup.sh` installs this checkout
    editable); the checkout's top stays first on their path for the `scripts` helpers."""
    path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return os.environ | {"PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1"}


_handed_out: set[int] = set()
_ports = random.Random()  # its own generator: a test that seeds `random` must not replay the picks


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range and never handed out before
    in this process (the benchmarks' servers and the tests' use it). A port from the ephemeral
    range (what binding port 0 returns) can be taken, before the server binds it, as the local
    port of any outgoing connection (the health checks that poll while a server starts): that
    once failed CI with "metrics port ... is already in use". Falls back to port 0's answer where
    the range leaves no room below it."""
    low = _ephemeral_low()
    for _ in range(100 if low > 20_100 else 0):
        port = _ports.randrange(20_000, low)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of Linux's ephemeral range (0 elsewhere: no room assumed)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def process_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ServeProcess:
    """`celeris serve` as deployed: its own process, logs on (JSON, to a file), drains at exit."""

    def __init__(self, model: Optional[Path], threads: int, max_batch: int, kv_cache: str, log_path: Path,
                 max_gen_length: int = 512, simulate_step_ms: Optional[float] = None, extra: tuple[str, ...] = ()):
        self.port, self.metrics_port, self.log_path = free_port(), free_port(), log_path
        self.argv = [sys.executable, "-m", "celeris.server.cli", "serve", "--host", "127.0.0.1", "--grpc-port", str(self.port),
                     "--metrics-port", str(self.metrics_port), "--threads", str(threads),
                     "--max-batch", str(max_batch), "--max-queue", str(4 * max_batch), "--kv-cache", kv_cache,
                     "--max-gen-length", str(max(512, max_gen_length)), "--log-format", "json",
                     "--drain-seconds", "0", "--grace-seconds", "5"]
        if model is not None:
            self.argv += ["--model", str(model)]
        if simulate_step_ms is not None:
            self.argv += ["--simulate-step-ms", str(simulate_step_ms)]
        self.argv += list(extra)  # e.g. --device cuda --dtype bfloat16 (scripts/bench_gpu_served.py)
        if not {"--port", "--http-port"} & set(extra):  # HTTP is on by default (port 8000); the benchmarks speak gRPC
            self.argv.append("--no-http")
        self.proc: Optional[subprocess.Popen] = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> ServeProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
        self._wait_serving(120.0)
        return self

    def _wait_serving(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.target) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"celeris serve exited with {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise RuntimeError(f"celeris serve not SERVING after {timeout} s:\n{self.log_tail()}")

    def sample(self) -> dict[str, float]:
        """Cumulative counters now: steps, forward_s, loop_cpu_s (from /metrics) and cpu_s."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        values = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                  if not s.labels}
        out = {key: float(values.get(name, 0.0)) for key, name in METRICS.items()}
        out["cpu_s"] = process_cpu_s(self.proc.pid)
        return out

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""

    def __exit__(self, *exc: Any) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # drains (0 s here) and stops, as in a rollout
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


class ClientProcess:
    """`python -m celeris_client.stream_load`: one job in, one answer out, per line."""

    def __init__(self) -> None:
        self.proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> ClientProcess:
        self.proc = subprocess.Popen([sys.executable, "-m", "celeris_client.stream_load"], cwd=ROOT, env=child_env(),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        return self

    def run(self, job: dict[str, Any]) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"client process exited with {self.proc.poll()}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"client process: {answer['error']}")
        return answer

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
