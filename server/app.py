"""Assembles the server: scheduler, both doors (gRPC and the HTTP gateway) over one request
lifecycle and one guard, health, reflection, interceptors, telemetry.

`create_server(llm, settings)` returns a started server and its bound port, so tests bind
port 0. `stop()` drains: health NOT_SERVING, wait `drain_seconds` for load balancers to notice,
then both doors refuse new work at once and in-flight streams get one `grace_seconds`, shared.
The command line (`celeris serve`) lives in server/cli_commands.py.
"""

from __future__ import annotations

import asyncio
import errno
from dataclasses import dataclass
from typing import Optional

import grpc
import structlog
from grpc_reflection.v1alpha import reflection

from celeris.v1 import generation_pb2, generation_pb2_grpc
from celeris.engine.llm import LLM
from celeris.engine.loop.scheduler import Scheduler
from celeris.engine.threads import TensorThread
from celeris.server.errors import PortInUse
from celeris.server.guard import Guard
from celeris.server.health import MAX_WATCHES, MAX_WATCHES_PER_CLIENT, Health
from celeris.server.interceptors import AccessLogInterceptor, GuardInterceptor
from celeris.server.lifecycle import Lifecycle
from celeris.server.malformed import MalformedInterceptor, request_types
from celeris.server.servicer import GenerationServicer
from celeris.server.tools_api import resolve
from celeris.server.telemetry import Telemetry

log = structlog.get_logger("celeris")
TRANSPORT_STREAMS = 1024  # HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS of the gRPC port


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"  # loopback unless asked: "[::]" or "0.0.0.0" serve every interface
    port: int = 50051
    api_token: Optional[str] = None  # bearer token; None disables auth
    rate_limit: float = 0.0  # Generate/GetModelInfo/Tokenize calls per second per client; 0 = off
    rate_burst: int = 20
    rate_limit_clients: int = 10_000  # bucket table bound; beyond it new clients share one bucket
    trust_forwarded_for: bool = False  # key clients on x-forwarded-for (only behind a proxy that sets it)
    max_streams: Optional[int] = None  # open streams in all (parked ones too); None = max_batch + max_queue
    max_streams_per_client: Optional[int] = None  # places one client may hold; None = half of max_streams
    # (at least max_batch), 0 = no share
    max_streams_per_connection: int = 100  # open gRPC calls per connection (refused with RESOURCE_EXHAUSTED)
    max_health_watches: int = MAX_WATCHES  # open grpc.health Watch streams in all (server/health.py)
    max_health_watches_per_client: int = MAX_WATCHES_PER_CLIENT  # ... from one client address
    unread_timeout_s: float = 30.0  # a stream whose client reads nothing this long is cancelled; 0 = never
    header_timeout_s: float = 10.0  # HTTP: a connection's request line and headers must arrive within this
    body_timeout_s: float = 30.0  # HTTP: a request body must arrive within this
    max_request_bytes: int = 4 << 20
    drain_seconds: float = 5.0  # NOT_SERVING before stopping, so balancers move traffic away
    grace_seconds: float = 120.0  # in-flight streams get this long to finish on shutdown
    keepalive_time_s: float = 30.0  # server pings idle connections (meshes drop silent ones)
    keepalive_timeout_s: float = 10.0
    min_client_ping_interval_s: float = 10.0  # accept client keepalives this often without GOAWAY
    max_connection_age_s: float = 300.0  # GOAWAY after this, so clients rebalance across replicas
    max_connection_age_grace_s: float = 150.0
    metrics_port: Optional[int] = None
    metrics_host: Optional[str] = None  # None: the gRPC host
    metrics_on_http: bool = True  # /metrics on the HTTP gateway's port too (as vLLM does)
    http_port: Optional[int] = None
    allowed_origins: tuple[str, ...] = ()  # CORS for the HTTP gateway; () = off, ("*",) = any origin
    allowed_hosts: tuple[str, ...] = ()  # HTTP Host names served beside loopback ones; ("*",) = any (http_extras)
    served_model_names: tuple[str, ...] = ()  # the name clients use, then aliases; () = the model's own name
    ssl_keyfile: Optional[str] = None  # TLS on both doors (PEM files), with ssl_certfile; None = plaintext
    ssl_certfile: Optional[str] = None
    warmup: bool = True
    tool_call_parser: Optional[str] = None  # names in engine/agents; None: detected from the chat template
    reasoning_parser: Optional[str] = None  # (server/tools_api.py); "none": off

    def __post_init__(self) -> None:
        if self.api_token is not None and not self.api_token.strip():  # never a silent "auth off"
            raise ValueError("api_token is empty: give a token, or None for no auth")

    def model_names(self, model_name: str) -> tuple[str, ...]:
        """The served name first, then its aliases."""
        return tuple(self.served_model_names) or (model_name,)

    def grpc_options(self) -> list[tuple[str, int]]:
        ms = lambda s: int(s * 1000)  # noqa: E731
        return [
            ("grpc.max_receive_message_length", self.max_request_bytes),
            # The transport's own limit sits well above ours: a stream over it is refused with an
            # uncounted REFUSED_STREAM (UNAVAILABLE), ours with a counted RESOURCE_EXHAUSTED.
            ("grpc.max_concurrent_streams", max(TRANSPORT_STREAMS, 2 * self.max_streams_per_connection)),
            ("grpc.so_reuseport", 0),  # a port in use is an error, never silently shared
            ("grpc.keepalive_time_ms", ms(self.keepalive_time_s)),
            ("grpc.keepalive_timeout_ms", ms(self.keepalive_timeout_s)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", ms(self.min_client_ping_interval_s)),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.max_connection_age_ms", ms(self.max_connection_age_s)),
            ("grpc.max_connection_age_grace_ms", ms(self.max_connection_age_grace_s)),
        ]


class CelerisServer:
    def __init__(self, llm: LLM, settings: ServerSettings, telemetry: Optional[Telemetry] = None,
                 thread: Optional[TensorThread] = None):
        self.llm, self.settings = llm, settings
        self.thread = thread  # the thread that loaded the model: the step worker runs there too
        self.telemetry = telemetry or Telemetry()
        self.health = Health(settings.max_health_watches, settings.max_health_watches_per_client)
        self.scheduler: Optional[Scheduler] = None
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
        self.scheduler = Scheduler(self.llm.loop, on_step=self.telemetry.on_step, max_open=s.max_streams,
                                   thread=self.thread, unread_timeout=s.unread_timeout_s)
        self.scheduler.max_open_per_owner = client_share(s.max_streams_per_client, self.scheduler.max_open,
                                                         self.llm.loop.runner.slots)
        self.telemetry.bind_scheduler(self.scheduler, s.model_names(self.llm.name)[0])
        self.scheduler.on_dead = self._cannot_serve
        self.scheduler.start()
        self.guard = Guard(s.api_token, s.rate_limit, s.rate_burst, s.trust_forwarded_for, s.rate_limit_clients)
        self.lifecycle = Lifecycle(self.llm, self.scheduler, self.telemetry, self.guard,
                                   s.max_streams_per_connection)
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        unary = request_types(generation_pb2.DESCRIPTOR.services_by_name["GenerationService"],
                              health_pb2.DESCRIPTOR.services_by_name["Health"])
        # Innermost: auth is checked before a malformed request is, and the access log sees its code.
        interceptors = [AccessLogInterceptor(), GuardInterceptor(self.guard), MalformedInterceptor(unary)]
        self.grpc = grpc.aio.server(interceptors=interceptors, options=s.grpc_options())
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(
            GenerationServicer(self.llm, self.lifecycle, s.model_names(self.llm.name)[0],
                               resolve(self.llm.tokenizer.chat_template, s.tool_call_parser, s.reasoning_parser,
                                       self.llm.tokenizer.special_markers)),
            self.grpc)
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
            from celeris.server.http_gateway import HttpGateway

            http = HttpGateway(self.llm, self.scheduler, s, health=self.health, lifecycle=self.lifecycle,
                               guard=self.guard)
            await http.start(s.http_port)  # cleans up after itself if its port is taken
            self.http = http  # only a started gateway is stopped (with a grace period and its log lines)
        if s.warmup:
            await self._warmup()
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

    async def _warmup(self) -> None:
        """One tiny generation through the real path, so the first user request is not the slow one."""
        ids = self.llm.encode_prompt([self.llm.tokenizer.eos_id])
        seq = self.llm.sequence(ids, self.llm.warmup_params, "warmup")  # its family's tiny request
        with self.scheduler.submit(seq) as stream:
            async for _ in stream:
                pass

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
        if self.scheduler is not None:
            self.scheduler.accepting = False  # both doors refuse new work from here on
        say("server.refusing", doors=[d for d, on in (("grpc", self.grpc), ("http", self.http)) if on])
        doors = [_door("http", self.http.stop(grace), say)] if self.http is not None else []
        if self.grpc is not None:
            doors.append(_door("grpc", self.grpc.stop(grace), say))  # new RPCs refused; in-flight get `grace` s
        await asyncio.gather(*doors)  # one grace period for both, not one after the other
        if self.scheduler is not None:
            await self.scheduler.stop()
        if self._metrics_server is not None:
            self._metrics_server[0].shutdown()
            self._metrics_server[0].server_close()
        say("server.stopped")
        self._stopped.set()

    @property
    def metrics_port(self) -> Optional[int]:
        """The bound port of the separate /metrics server, or None without one."""
        return self._metrics_server[0].server_port if self._metrics_server is not None else None

    @property
    def idle(self) -> bool:
        """No request admitted or being read by either door: a stop needs no drain."""
        http_busy = self.http is not None and self.http.inflight > 0
        return (self.scheduler is None or self.scheduler.active == 0) and not http_busy

    async def wait(self) -> None:
        await self._stopped.wait()


async def _door(name: str, stopping, say) -> None:
    say("server.door_closing", door=name)
    await stopping
    say("server.door_closed", door=name)


_FLAGS = {"gRPC": "--grpc-port", "HTTP": "--port", "metrics": "--metrics-port"}
_ANY_HOST = ("", "::", "0.0.0.0")


def check_distinct_ports(s: ServerSettings) -> None:
    """PortInUse naming both doors when this server asks for one port twice (`--grpc-port 8000
    --port 8000`): the second bind would fail as if another program held the port."""
    doors = [("gRPC", s.host, s.port), ("HTTP", s.host, s.http_port),
             ("metrics", s.metrics_host or s.host, s.metrics_port)]
    doors = [(door, host.strip("[]"), port) for door, host, port in doors if port]  # None, 0: none or any
    for i, (door, host, port) in enumerate(doors):
        for other, other_host, other_port in doors[:i]:
            if port == other_port and (host == other_host or host in _ANY_HOST or other_host in _ANY_HOST):
                hint = "; --port is the HTTP port, as in vLLM" if "HTTP" in (door, other) else ""
                raise PortInUse(f"{door} port {port} on {host or '::'} is this server's {other} port too: give "
                                f"each door its own ({_FLAGS[other]} {port} and {_FLAGS[door]} {port} were asked{hint})")


def _free(host: str, port: int, door: str) -> None:
    """Raise PortInUse (one line, naming the reason) if `port` cannot be bound on `host`: a
    socket bound and closed with the options gRPC uses (SO_REUSEADDR, dual-stack "[::]"). A port
    taken between this check and gRPC's bind still fails, through `_bound`."""
    from celeris.server.http_transport import listening_socket  # aiohttp's module: only when binding

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
