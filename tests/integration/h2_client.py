"""A hostile raw HTTP/2 gRPC client: it opens Generate streams and never reads them.

It announces a stream receive window of 0 and never sends WINDOW_UPDATE, so the server cannot
send a single response byte: every admitted stream parks its handler on its first message. A
refusal still arrives (trailers-only HEADERS are not flow controlled), as does RST_STREAM.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Optional

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings

from celeris.v1 import generation_pb2 as pb


class ParkingConnection:
    def __init__(self, port: int, host: str = "127.0.0.1"):
        self.sock = socket.create_connection((host, port), timeout=10)
        self.authority = f"{host}:{port}"
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.local_settings = h2.settings.Settings(
            client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0,
                                         h2.settings.SettingCodes.ENABLE_PUSH: 0})
        self.conn.initiate_connection()
        self.lock = threading.Lock()
        self.status: dict[int, Optional[str]] = {}  # stream id -> grpc-status, "reset", or None (parked)
        self.closed = False
        self._flush()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def open(self, request: pb.GenerateRequest) -> Optional[int]:
        """One Generate stream; None if the server's MAX_CONCURRENT_STREAMS leaves no room."""
        body = request.SerializeToString()
        with self.lock:
            try:
                sid = self.conn.get_next_available_stream_id()
                self.conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":authority", self.authority),
                                             (":path", "/celeris.v1.GenerationService/Generate"),
                                             ("content-type", "application/grpc"), ("te", "trailers")])
            except h2.exceptions.TooManyStreamsError:
                return None
            self.conn.send_data(sid, b"\x00" + struct.pack(">I", len(body)) + body, end_stream=True)
            self.status[sid] = None
            self._flush()
        return sid

    def _read(self) -> None:
        while not self.closed:
            try:
                data = self.sock.recv(65536)
            except OSError:
                return
            if not data:
                return
            with self.lock:
                try:
                    events = self.conn.receive_data(data)
                except h2.exceptions.ProtocolError:
                    return
                for ev in events:
                    if isinstance(ev, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                        code = dict(ev.headers).get("grpc-status")
                        if code is not None:
                            self.status[ev.stream_id] = code
                    elif isinstance(ev, h2.events.StreamReset):
                        self.status[ev.stream_id] = "reset"
                self._flush()  # SETTINGS and PING acks (never a WINDOW_UPDATE)

    @property
    def max_concurrent_streams(self) -> int:
        with self.lock:
            return self.conn.remote_settings.max_concurrent_streams

    def counts(self) -> dict[str, int]:
        with self.lock:
            out: dict[str, int] = {}
            for code in self.status.values():
                key = "parked" if code is None else code
                out[key] = out.get(key, 0) + 1
            return out

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass


def settle(conns: list[ParkingConnection], seconds: float) -> dict[str, int]:
    time.sleep(seconds)
    total: dict[str, int] = {}
    for c in conns:
        for k, v in c.counts().items():
            total[k] = total.get(k, 0) + v
    return total
