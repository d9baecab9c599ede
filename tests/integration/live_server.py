"""A real Celeris server (gRPC + HTTP gateway) on port 0, running in its own thread and event loop.

Blocking clients (the sync client, the CLI, the openai package, a browser) can then be used from
the test's thread without deadlocking the server's loop. The server is always stopped on exit,
which matters because `tiny_llm` (and its StepLoop) is shared by the whole session.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from typing import Any, Callable, Coroutine, Iterator, TypeVar

from celeris.server.app import CelerisServer, create_server
from celeris.server.settings import ServerSettings

T = TypeVar("T")


@dataclasses.dataclass
class LiveServer:
    server: CelerisServer
    loop: asyncio.AbstractEventLoop

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.server.http.port}"

    @property
    def scheduler(self):
        return self.server.scheduler

    def call(self, fn: Callable[[], Coroutine[Any, Any, T]], timeout: float = 30) -> T:
        """Run a coroutine on the server's loop (e.g. to read scheduler state consistently)."""
        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result(timeout)

    def active(self) -> int:
        async def read() -> int:
            return self.scheduler.active
        return self.call(read)


@contextlib.contextmanager
def live_server(llm, telemetry=None, **settings: Any) -> Iterator[LiveServer]:
    base = dict(host="127.0.0.1", port=0, http_port=0, drain_seconds=0, grace_seconds=2, warmup=False)
    cfg = ServerSettings(**(base | settings))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="celeris-test-server", daemon=True)
    thread.start()
    server, _ = asyncio.run_coroutine_threadsafe(create_server(llm, cfg, telemetry), loop).result(60)
    try:
        yield LiveServer(server, loop)
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0, 2), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
    assert llm.loop.idle, "a test left requests in the shared engine"
