"""Assembles the server: scheduler, servicers, health, reflection, interceptors, telemetry.

`create_server(llm, settings)` returns a started server and its bound port, so tests bind
port 0. `celeris serve` adds signal handling: SIGTERM flips health to NOT_SERVING, waits
`drain_seconds` for load balancers to notice, then stops with `grace_seconds` so in-flight
streams finish.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from dataclasses import dataclass
from typing import Optional

import grpc
import structlog
from grpc_reflection.v1alpha import reflection

from celeris.v1 import generation_pb2, generation_pb2_grpc
from engine.llm import LLM
from engine.params import SamplingParams
from engine.scheduler import Scheduler
from server.health import Health
from server.interceptors import AccessLogInterceptor, AuthInterceptor, RateLimitInterceptor
from server.servicer import GenerationServicer
from server.telemetry import Metrics, Telemetry, configure_logging, make_tracer_provider

log = structlog.get_logger("celeris")


@dataclass(frozen=True)
class ServerSettings:
    host: str = "[::]"
    port: int = 50051
    api_token: Optional[str] = None  # bearer token; None disables auth
    rate_limit: float = 0.0  # Generate/GetModelInfo/Tokenize calls per second per client; 0 = off
    rate_burst: int = 20
    max_request_bytes: int = 4 << 20
    drain_seconds: float = 5.0  # NOT_SERVING before stopping, so balancers move traffic away
    grace_seconds: float = 120.0  # in-flight streams get this long to finish on shutdown
    keepalive_time_s: float = 30.0  # server pings idle connections (meshes drop silent ones)
    keepalive_timeout_s: float = 10.0
    min_client_ping_interval_s: float = 10.0  # accept client keepalives this often without GOAWAY
    max_connection_age_s: float = 300.0  # GOAWAY after this, so clients rebalance across replicas
    max_connection_age_grace_s: float = 150.0
    metrics_port: Optional[int] = None
    http_port: Optional[int] = None
    warmup: bool = True

    def grpc_options(self) -> list[tuple[str, int]]:
        ms = lambda s: int(s * 1000)  # noqa: E731
        return [
            ("grpc.max_receive_message_length", self.max_request_bytes),
            ("grpc.keepalive_time_ms", ms(self.keepalive_time_s)),
            ("grpc.keepalive_timeout_ms", ms(self.keepalive_timeout_s)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", ms(self.min_client_ping_interval_s)),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.max_connection_age_ms", ms(self.max_connection_age_s)),
            ("grpc.max_connection_age_grace_ms", ms(self.max_connection_age_grace_s)),
        ]


class CelerisServer:
    def __init__(self, llm: LLM, settings: ServerSettings, telemetry: Optional[Telemetry] = None):
        self.llm, self.settings = llm, settings
        self.telemetry = telemetry or Telemetry()
        self.health = Health()
        self.scheduler: Optional[Scheduler] = None
        self.grpc: Optional[grpc.aio.Server] = None
        self.port = 0
        self.http = None
        self._metrics_server = None
        self._stopped = asyncio.Event()

    async def start(self) -> int:
        s = self.settings
        self.scheduler = Scheduler(self.llm.loop, on_step=self.telemetry.on_step)
        self.telemetry.bind_scheduler(self.scheduler)
        self.scheduler.start()
        interceptors = [AccessLogInterceptor()]
        if s.api_token:
            interceptors.append(AuthInterceptor(s.api_token))
        if s.rate_limit > 0:
            interceptors.append(RateLimitInterceptor(s.rate_limit, s.rate_burst))
        self.grpc = grpc.aio.server(interceptors=interceptors, options=s.grpc_options())
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(
            GenerationServicer(self.llm, self.scheduler, self.telemetry), self.grpc)
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, self.grpc)
        reflection.enable_server_reflection([
            generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME], self.grpc)
        self.port = self.grpc.add_insecure_port(f"{s.host}:{s.port}")
        await self.health.set(False)
        await self.grpc.start()
        if s.metrics_port is not None:
            self._metrics_server = self.telemetry.metrics.serve(s.metrics_port)
        if s.http_port is not None:
            from server.http_gateway import HttpGateway

            self.http = HttpGateway(self.llm, self.scheduler, s, health=self.health)
            await self.http.start(s.http_port)
        if s.warmup:
            await self._warmup()
        await self.health.set(True)
        log.info("server.started", port=self.port, model=self.llm.name, http_port=self.http.port if self.http else None)
        return self.port

    async def _warmup(self) -> None:
        """One tiny generation through the real path, so the first user request is not the slow one."""
        ids = self.llm.encode_prompt([self.llm.tokenizer.eos_id])
        seq = self.llm.sequence(ids, SamplingParams(gen_length=1, steps=1, block_length=1, seed=0), "warmup")
        async for _ in self.scheduler.generate(seq):
            pass

    async def stop(self, drain_seconds: Optional[float] = None, grace_seconds: Optional[float] = None) -> None:
        """Drain: NOT_SERVING, wait, refuse new work, let in-flight streams finish, stop."""
        s = self.settings
        drain = s.drain_seconds if drain_seconds is None else drain_seconds
        grace = s.grace_seconds if grace_seconds is None else grace_seconds
        await self.health.set(False)
        log.info("server.draining", drain_seconds=drain, grace_seconds=grace)
        if drain > 0:
            await asyncio.sleep(drain)
        if self.http is not None:
            await self.http.stop(grace)
        if self.grpc is not None:
            await self.grpc.stop(grace)  # new RPCs refused; in-flight ones get `grace` seconds
        if self.scheduler is not None:
            await self.scheduler.stop()
        if self._metrics_server is not None:
            self._metrics_server[0].shutdown()
        log.info("server.stopped")
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()


async def create_server(llm: LLM, settings: ServerSettings = ServerSettings(port=0),
                        telemetry: Optional[Telemetry] = None) -> tuple[CelerisServer, int]:
    server = CelerisServer(llm, settings, telemetry)
    port = await server.start()
    return server, port


def add_serve_args(ap: argparse.ArgumentParser) -> None:
    d = ServerSettings()
    ap.add_argument("--host", default=d.host, help="bind address (default %(default)s)")
    ap.add_argument("--port", type=int, default=d.port, help="gRPC port (default %(default)s)")
    ap.add_argument("--http-port", type=int, default=None, help="also serve the OpenAI-compatible HTTP gateway and web page")
    ap.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    ap.add_argument("--api-token", default=os.environ.get("CELERIS_API_TOKEN"),
                    help="require 'authorization: Bearer TOKEN' (default: $CELERIS_API_TOKEN; unset = no auth)")
    ap.add_argument("--rate-limit", type=float, default=0.0, help="requests/s per client, 0 = off")
    ap.add_argument("--max-batch", type=int, default=16, help="requests decoded together (default %(default)s)")
    ap.add_argument("--max-queue", type=int, default=64, help="waiting requests before RESOURCE_EXHAUSTED")
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--max-gen-length", type=int, default=512)
    ap.add_argument("--drain-seconds", type=float, default=d.drain_seconds)
    ap.add_argument("--grace-seconds", type=float, default=d.grace_seconds)
    ap.add_argument("--trace-exporter", default="auto", choices=("auto", "otlp", "console", "none"),
                    help="auto = OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set, else none")
    ap.add_argument("--log-prompts", action="store_true", help="include prompt text in logs (off by default)")
    ap.add_argument("--log-format", choices=("auto", "json", "console"), default="auto")


def serve_from_args(a: argparse.Namespace) -> int:
    import torch

    from server.cli import engine_config_from_args

    configure_logging(None if a.log_format == "auto" else a.log_format == "json")
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = engine_config_from_args(a, max_batch=a.max_batch, max_queue=a.max_queue,
                                  max_prompt_tokens=a.max_prompt_tokens, max_gen_length=a.max_gen_length)
    llm = LLM.load(a.model, cfg)
    settings = ServerSettings(host=a.host, port=a.port, api_token=a.api_token or None, rate_limit=a.rate_limit,
                              drain_seconds=a.drain_seconds, grace_seconds=a.grace_seconds,
                              metrics_port=a.metrics_port, http_port=a.http_port)
    telemetry = Telemetry(make_tracer_provider(a.trace_exporter), Metrics(), log_prompts=a.log_prompts)
    asyncio.run(_serve(llm, settings, telemetry))
    return 0


async def _serve(llm: LLM, settings: ServerSettings, telemetry: Telemetry) -> None:
    server, _ = await create_server(llm, settings, telemetry)
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task] = []

    def on_signal(sig: signal.Signals) -> None:
        log.info("server.signal", signal=sig.name)
        if not stopping:
            stopping.append(loop.create_task(server.stop()))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    await server.wait()
    telemetry.shutdown()
