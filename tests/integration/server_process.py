"""`celeris serve` as a real child process on loopback, for tests that kill, signal or soak it.

`--grpc-port 0` would not tell the test which port was bound, so a free port is picked first and
passed explicitly; a restarted server can then reuse it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Awaitable, Callable, Optional

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from celeris.server.health import SERVICE_NAME

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "scripts") not in sys.path:  # one port picker for the tests and the benchmarks
    sys.path.insert(0, str(ROOT / "scripts"))
from serving_process import free_port  # noqa: E402,F401 (the tests import it from here)


class ServerProcess:
    """One `python -m celeris.server.cli serve` child. Always `close()` it (the fixtures do)."""

    def __init__(self, model_dir: Path, log_path: Path, *extra: str, port: Optional[int] = None,
                 metrics_port: Optional[int] = None, module: str = "celeris.server.cli", env: Optional[dict] = None):
        self.port = port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.log_path = log_path
        self.env = env or {}
        self.argv = [sys.executable, "-X", "faulthandler", "-m", module, "serve", "--model", str(model_dir),
                     "--host", "127.0.0.1", "--grpc-port", str(self.port), "--metrics-port", str(self.metrics_port),
                     "--threads", "1", "--log-format", "json", *extra]
        if not {"--port", "--http-port"} & set(extra):  # HTTP is on by default (port 8000): tests must not share it
            self.argv.append("--no-http")
        self.proc: Optional[subprocess.Popen] = None

    def records(self) -> list[dict]:
        """The JSON log records the server has written so far (other lines skipped)."""
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
        return out

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, ready_timeout: float = 60.0) -> ServerProcess:
        env = os.environ | {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"} | self.env
        env.pop("CELERIS_API_TOKEN", None)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.wait_serving(ready_timeout)
        return self

    def health(self, timeout: float = 2.0) -> Optional[int]:
        """The health status of the Generation service, or None if the server does not answer."""
        try:
            with grpc.insecure_channel(self.target) as ch:
                return health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout).status
        except grpc.RpcError:
            return None

    def wait_serving(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.health() == health_pb2.HealthCheckResponse.SERVING:
                return
            time.sleep(0.2)
        raise AssertionError(f"server not SERVING after {timeout} s:\n{self.log_tail()}")

    def logged(self, event: str) -> bool:
        """Whether the server has logged a record with this `event` (a shutdown phase, say)."""
        return any(r.get("event") == event for r in self.records())

    def wait_for_event(self, event: str, timeout: float = 60) -> None:
        """Block until the server has `logged` this event."""
        deadline = time.monotonic() + timeout
        while not self.logged(event):
            if time.monotonic() > deadline:
                raise AssertionError(f"no {event!r} logged in {timeout} s:\n{self.log_tail()}")
            time.sleep(0.05)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def metrics(self) -> dict[str, float]:
        """Every unlabelled sample and every labelled one as name{k=v,...}."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                key = f"{s.name}{{{labels}}}" if labels else s.name
                out[key] = s.value
        return out

    def send_signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def close(self) -> None:
        if self.alive:
            self.proc.kill()
            self.proc.wait(10)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""


async def assert_refused(call: Callable[[], Awaitable]) -> list[grpc.StatusCode]:
    """`call()`, a new RPC made after the server logged `server.refusing`, is refused with
    UNAVAILABLE. The transport starts closing at that moment, and a call that crosses the server's
    GOAWAY on the wire is cancelled by gRPC core before any handler sees it (CANCELLED: measured
    on 26 of 38 calls sent at the instant the stop began, none of 32 sent 1-100 ms later): a client
    retrying that one must then get UNAVAILABLE. Returns the codes seen, in order."""
    codes: list[grpc.StatusCode] = []
    for _ in range(2):
        try:
            await call()
        except grpc.aio.AioRpcError as e:
            codes.append(e.code())
        else:
            raise AssertionError(f"served after the server logged server.refusing (codes before: {codes})")
        if codes[-1] != grpc.StatusCode.CANCELLED:
            break
    assert codes[-1] == grpc.StatusCode.UNAVAILABLE, codes
    return codes


def rich_status(err: grpc.RpcError) -> Optional[status_pb2.Status]:
    """The google.rpc.Status a server attached to an error (sync or aio), if any."""
    for key, value in err.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            return status_pb2.Status.FromString(value)
    return None


def retry_delay_s(err: grpc.RpcError) -> Optional[float]:
    """RetryInfo.retry_delay in seconds, if the error carries one."""
    st = rich_status(err)
    for d in st.details if st else ():
        if d.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            d.Unpack(info)
            return info.retry_delay.ToTimedelta().total_seconds()
    return None


def field_violations(err: grpc.RpcError) -> list[tuple[str, str]]:
    st = rich_status(err)
    out = []
    for d in st.details if st else ():
        if d.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            br = error_details_pb2.BadRequest()
            d.Unpack(br)
            out += [(v.field, v.description) for v in br.field_violations]
    return out
