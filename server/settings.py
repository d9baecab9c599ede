"""The server's settings: one frozen record both doors, the guard and the health service read
(`ServerSettings`), and the checks a set of settings must pass before anything binds.

`celeris serve` builds it from its flags (server/cli/commands.py), tests build it directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from celeris.server.errors import PortInUse
from celeris.server.health import MAX_WATCHES, MAX_WATCHES_PER_CLIENT

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
    allowed_hosts: tuple[str, ...] = ()  # HTTP Host names served beside loopback ones; ("*",) = any (server/http/extras.py)
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
