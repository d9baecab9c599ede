"""The lanes structured requests are built on: compiling never delays anyone else's tokenizing.

A request with a structured output or with tools is built (validated, tokenized, its grammars and
its tools' schemas compiled) on a thread of its own, never the event loop and never ahead of plain
requests' tokenizing: a small lane, and a large lane for structures over LARGE_SCHEMA_CHARS (one
can compile for seconds), one build at a time each, at most LARGE_SCHEMAS_WAITING on the large
lane. One client has at most COMPILES_PER_CLIENT builds in a lane's queue at a time (its others
wait at its own gate, on the event loop, costing nothing), so a client's flood waits behind
itself and another client's build waits behind at most that many of the flood's; past
WAITING_PER_CLIENT builds of one client, or LARGE_SCHEMAS_WAITING on the large lane, the call is
refused for overload (429 / RESOURCE_EXHAUSTED with a retry delay).

Counts are read and written on the event loop only (`run` is a coroutine of that loop).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
from typing import Callable, TypeVar

from celeris.engine.errors import Overloaded
from celeris.engine.structured.spec import LARGE_SCHEMA_CHARS, LARGE_SCHEMAS_WAITING

COMPILES_PER_CLIENT = 2  # one client's builds in the lanes' queues at once (the rest wait at its gate)
WAITING_PER_CLIENT = 64  # one client's builds waiting or compiling, past which it is refused
T = TypeVar("T")


class Lanes:
    def __init__(self):
        self._small = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="celeris-compile")
        self._large = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="celeris-compile-large")
        self.large_waiting = 0  # large builds queued or compiling
        self._by_client: collections.Counter[str] = collections.Counter()  # builds waiting or compiling
        self._gates: dict[str, asyncio.Semaphore] = {}

    async def run(self, build: Callable[..., T], arg: object, large: bool, client: str = "") -> T:
        """`build(arg)` on the large lane or the small one, behind at most COMPILES_PER_CLIENT of
        the same client's; Overloaded past a cap (`client`: the caller's key; "" is one client)."""
        if self._by_client[client] >= WAITING_PER_CLIENT:
            raise Overloaded(f"this client already has {WAITING_PER_CLIENT} structured or tool requests compiling "
                             f"or waiting to", retry_after_s=1.0)
        if large and self.large_waiting >= LARGE_SCHEMAS_WAITING:
            raise Overloaded(f"{LARGE_SCHEMAS_WAITING} schemas over {LARGE_SCHEMA_CHARS} characters are already "
                             f"compiling or waiting; they compile one at a time", retry_after_s=2.0)
        loop = asyncio.get_running_loop()
        gate = self._gates.setdefault(client, asyncio.Semaphore(COMPILES_PER_CLIENT))
        self._by_client[client] += 1
        self.large_waiting += large
        try:
            async with gate:
                return await loop.run_in_executor(self._large if large else self._small, build, arg)
        finally:
            self.large_waiting -= large
            self._by_client[client] -= 1
            if self._by_client[client] <= 0:
                del self._by_client[client]
                del self._gates[client]


__all__ = ["Lanes", "COMPILES_PER_CLIENT", "WAITING_PER_CLIENT"]
