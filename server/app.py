"""Assembles the server: scheduler, both doors (gRPC and the HTTP gateway) over one request
lifecycle and one guard, health, reflection, interceptors, telemetry.

`create_server(llm, settings)` returns a started server and its bound port, so tests bind
port 0. `stop()` drains: health NOT_SERVING, wait `drain_seconds` for load balancers to notice,
then both doors refuse new work at once and in-flight streams get one `grace_seconds`, shared.
The command line (`celeris serve`) lives in server/cli/commands.py.
"""

from __future__ import annotations

import asyncio
import errno
from typing import Any, Optional

import grpc
import structlog
from grpc_reflection.v1alpha import reflection

from celeris.v1 import generation_pb2, generation_pb2_grpc
from celeris.engine.serving import LLM, Engine, TensorThread
from celeris.server.errors import PortInUse
from celeris.server.guard import Guard
from celeris.server.health import Health
from celeris.server.grpc.interceptors import AccessLogInterceptor, GuardInterceptor
from celeris.server.lifecycle import Lifecycle
from celeris.server.pipeline import Pipeline
from celeris.server.grpc.malformed import MalformedInterceptor, request_types
from celeris.server.grpc.servicer import GenerationServicer
from celeris.server.settings import ServerSettings, check_distinct_ports
from celeris.server.tools_api import resolve
from celeris.server.telemetry import Telemetry

log = structlog.get_logger("celeris")


class CelerisServer:
    def __init__(self, llm: LLM, settings: ServerSettings, telemetry: Optional[Telemetry] = None,
                 thread: Optional[TensorThread] = None):
        self.llm, self.settings = llm, settings
        self.thread = thread  # the thread that loaded the model: the step worker runs there too
        self.telemetry = telemetry or Telemetry()
        self.health = Health(settings.max_health_watches, settings.max_health_watches_per_client)
        self.engine: Optional[Engine] = None  # the model plus its scheduler, once started
        self.grpc: Optional[grpc.aio.Server] = None
        self.port = 0
        self.http = None
        self._metrics_server = None
        self._stopped = asyncio.Event()

    async def start(self) -> int:
        """Start everything, or nothing: a failure (a port in use) stops what had started."""
        try:
            return await self._start()
        except BaseException:
            await self.stop(drain_seconds=0, grace_seconds=0, quiet=True)
            raise

    async def _start(self) -> int:
        s = self.settings
        check_distinct_ports(s)  # two doors asking for one port: say so, before the OS blames "another program"
        self.engine = engine = Engine(self.llm, on_step=self.telemetry.on_step, max_open=s.max_streams,
                                      thread=self.thread, unread_timeout=s.unread_timeout_s)
        engine.max_open_per_client = client_share(s.max_streams_per_client, engine.max_open, engine.slots)
        self.telemetry.bind_engine(engine, s.model_names(self.llm.name)[0])
        engine.on_dead(self._cannot_serve)
        engine.start()
        self.guard = Guard(s.api_token, s.rate_limit, s.rate_burst, s.trust_forwarded_for, s.rate_limit_clients)
        self.lifecycle = Lifecycle(engine, self.telemetry, self.guard, s.max_streams_per_connection)
        tok = self.llm.tokenizer  # the tool-call and reasoning parsers, resolved once for both doors
        self.pipeline = Pipeline(self.lifecycle, resolve(tok.chat_template, s.tool_call_parser, s.reasoning_parser,
                                                         tok.special_markers))
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        unary = request_types(generation_pb2.DESCRIPTOR.services_by_name["GenerationService"],
                              health_pb2.DESCRIPTOR.services_by_name["Health"])
        # Innermost: auth is checked before a malformed request is, and the access log sees its code.
        interceptors = [AccessLogInterceptor(), GuardInterceptor(self.guard), MalformedInterceptor(unary)]
        self.grpc = grpc.aio.server(interceptors=interceptors, options=s.grpc_options())
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(
            GenerationServicer(self.llm, self.pipeline, s.model_names(self.llm.name)[0]), self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, self.grpc)
        reflection.enable_server_reflection([
            generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME], self.grpc)
        if s.port != 0:  # gRPC core would print its own error line for a taken port: ask the OS first
            _free(s.host, s.port, "gRPC")
        self.port = _bound(lambda: self._add_port(f"{s.host}:{s.port}"), "gRPC", s.host, s.port)
        await self.health.set(False)
        await self.grpc.start()
        if s.metrics_port is not None:
            host = s.metrics_host or s.host
            self._metrics_server = _bound(lambda: self.telemetry.metrics.serve(s.metrics_port, host),
                                          "metrics", host, s.metrics_port)
        if s.http_port is not None:
            from celeris.server.http.gateway import HttpGateway

            http = HttpGateway(engine, s, self.pipeline, self.guard, health=self.health)
            await http.start(s.http_port)  # cleans up after itself if its port is taken
            self.http = http  # only a started gateway is stopped (with a grace period and its log lines)
        if s.warmup:  # one tiny generation through the real path: the first user request is not the slow one
            await engine.warm_up()
        await self.health.set(True)
        log.info("server.started", port=self.port, model=s.model_names(self.llm.name)[0],
                 http_port=self.http.port if self.http else None)
        return self.port

    def _add_port(self, address: str) -> int:
        """The gRPC port, with TLS server credentials when the settings name a key and certificate."""
        s = self.settings
        if s.ssl_certfile is None:
            return self.grpc.add_insecure_port(address)
        with open(s.ssl_keyfile, "rb") as key, open(s.ssl_certfile, "rb") as chain:
            creds = grpc.ssl_server_credentials([(key.read(), chain.read())])
        return self.grpc.add_secure_port(address, creds)

    def _cannot_serve(self) -> None:
        """The engine can no longer serve (its step worker died): NOT_SERVING, so balancers and
        Kubernetes move traffic away and restart it; new requests get UNAVAILABLE."""
        log.error("server.cannot_serve", reason="the step worker ended")
        asyncio.get_running_loop().create_task(self.health.set(False))

    async def stop(self, drain_seconds: Optional[float] = None, grace_seconds: Optional[float] = None,
                   quiet: bool = False) -> None:
        """Drain: NOT_SERVING, wait, refuse new work, let in-flight streams finish, stop. Each
        phase is one log line (server.draining, server.refusing, server.door_closing and
        server.door_closed per door, server.stopped): tests check the order, not the clock."""
        s = self.settings
        drain = s.drain_seconds if drain_seconds is None else drain_seconds
        grace = s.grace_seconds if grace_seconds is None else grace_seconds
        # quiet: a start that failed (a port in use) says so in one line; no shutdown phases follow it
        say = (lambda *a, **k: None) if quiet else log.info
        await self.health.set(False)
        say("server.draining", drain_seconds=drain, grace_seconds=grace)
        if drain > 0:
            await asyncio.sleep(drain)
        if self.engine is not None:
            self.engine.refuse()  # both doors refuse new work from here on
        say("server.refusing", doors=[d for d, on in (("grpc", self.grpc), ("http", self.http)) if on])
        doors = [_door("http", self.http.stop(grace), say)] if self.http is not None else []
        if self.grpc is not None:
            doors.append(_door("grpc", self.grpc.stop(grace), say))  # new RPCs refused; in-flight get `grace` s
        await asyncio.gather(*doors)  # one grace period for both, not one after the other
        if self.engine is not None:
            await self.engine.stop()
        if self._metrics_server is not None:
            self._metrics_server[0].shutdown()
            self._metrics_server[0].server_close()
        say("server.stopped")
        self._stopped.set()

    @property
    def scheduler(self) -> Any:
        """The engine's scheduler (tests and benchmarks read its counters); None before start."""
        return self.engine.scheduler if self.engine is not None else None

    @property
    def metrics_port(self) -> Optional[int]:
        """The bound port of the separate /metrics server, or None without one."""
        return self._metrics_server[0].server_port if self._metrics_server is not None else None

    @property
    def idle(self) -> bool:
        """No request admitted or being read by either door: a stop needs no drain."""
        http_busy = self.http is not None and self.http.inflight > 0
        return (self.engine is None or self.engine.active == 0) and not http_busy

    async def wait(self) -> None:
        await self._stopped.wait()


async def _door(name: str, stopping, say) -> None:
    say("server.door_closing", door=name)
    await stopping
    say("server.door_closed", door=name)


def _free(host: str, port: int, door: str) -> None:
    """Raise PortInUse (one line, naming the reason) if `port` cannot be bound on `host`: a
    socket bound and closed with the options gRPC uses (SO_REUSEADDR, dual-stack "[::]"). A port
    taken between this check and gRPC's bind still fails, through `_bound`."""
    from celeris.server.http.transport import listening_socket  # aiohttp's module: only when binding

    try:
        listening_socket(host, port).close()
    except PortInUse:
        raise PortInUse(f"{door} port {port} on {host} is already in use") from None
    except OSError as e:
        reason = "is already in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror or e})"
        raise PortInUse(f"{door} port {port} on {host} {reason}") from None


def _bound(bind, door: str, host: str, port: int):
    """bind(), with "address in use" (gRPC says so with a RuntimeError) as one PortInUse naming the port."""
    try:
        result = bind()
    except (RuntimeError, OSError) as e:
        if isinstance(e, OSError) and e.errno != errno.EADDRINUSE:
            raise
        maybe = "" if isinstance(e, OSError) else " (or cannot be bound)"  # gRPC's error does not say which
        raise PortInUse(f"{door} port {port} on {host} is already in use{maybe}") from None
    if result == 0 and port != 0:  # older gRPC: 0 instead of an error
        raise PortInUse(f"{door} port {port} on {host} is already in use (or cannot be bound)")
    return result


def client_share(setting: Optional[int], places: int, batch: int) -> int:
    """Places one client may hold: the setting, 0 meaning all; by default half of them, but never
    less than a full batch (one client alone still fills every batch slot)."""
    if setting is None:
        return min(places, max(batch, places // 2))
    return places if setting <= 0 else min(setting, places)


async def create_server(llm: LLM, settings: ServerSettings = ServerSettings(port=0),
                        telemetry: Optional[Telemetry] = None,
                        thread: Optional[TensorThread] = None) -> tuple[CelerisServer, int]:
    server = CelerisServer(llm, settings, telemetry, thread)
    port = await server.start()
    return server, port
