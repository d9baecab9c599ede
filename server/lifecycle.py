"""One request lifecycle for both front doors (gRPC and the HTTP gateway).

A door only translates: its wire request -> `celeris.engine.requests.Request`, then

    lives = [lifecycle.start(...)]       # one per sample (n): span, log context, metrics
    await lifecycle.submit(lives, reqs)  # prepared once by the engine (engine/serving.py), tokenized off the event
                                         # loop, then admitted all or none: errors raise here
    async for ev in life.events():       # step events, observed once
        ...                              # -> response messages
    life.close()                         # always (a `finally`): cancels what is left, records the outcome

and maps errors through the one table in server/errors.py.

A call's n samples count as n everywhere: places, the client's share (server.guard.current_client
names the client), the rate limit (the guard charged the call one token; the other n - 1 are
charged here) and the queue. On gRPC, calls open on one connection are limited here, so that
refusal is a counted RESOURCE_EXHAUSTED rather than the transport's uncounted REFUSED_STREAM.
"""

from __future__ import annotations

import asyncio
import collections
from typing import AsyncIterator, Optional

from celeris.engine.errors import EngineError, Overloaded
from celeris.engine.events import StepEvent
from celeris.engine.requests import MAX_REQUEST_ID, Request
from celeris.engine.serving import Engine, FormatterFactory, RequestStream
from celeris.server.guard import Guard, current_client
from celeris.server.telemetry import RequestObserver, Telemetry

class Lifecycle:
    def __init__(self, engine: Engine, telemetry: Telemetry, guard: Optional[Guard] = None,
                 max_calls_per_connection: int = 0):
        self.engine, self.telemetry, self.guard = engine, telemetry, guard
        self.max_calls_per_connection = max_calls_per_connection  # gRPC; 0 = no limit
        self._calls: collections.Counter[str] = collections.Counter()  # open gRPC calls per connection

    def start(self, door: str, name: str, carrier: dict[str, str], peer: str,
              prompt: Optional[str] = None) -> LiveRequest:
        obs = self.telemetry.request(name, carrier, peer, {"celeris.door": door}, prompt)
        return LiveRequest(self, obs, peer if door == "grpc" else "")

    async def submit(self, lives: list[LiveRequest], reqs: list[Request],
                     formatters: Optional[list[Optional[FormatterFactory]]] = None) -> list[RequestStream]:
        """Prepare every sample's request (validate + tokenize, in a worker thread), then admit them
        all or none (`Engine.submit`); raises EngineError, recorded on the first sample.
        `formatters[k](prepared)` makes sample k's event formatter, run off the loop: its events then
        arrive with `formatted` set."""
        first = lives[0]
        try:
            prepared = []
            client = current_client()  # structured and tool builds are capped per client (engine/structured/lanes.py)
            for life, req in zip(lives, reqs):
                if req.request_id:  # logged before validation, so cut to the limit
                    life.obs.bind(req.request_id[:MAX_REQUEST_ID])
                p = await self.engine.prepare(req, inline=len(reqs) == 1, client=client)  # each off the loop
                prepared.append(p)
                life.obs.bind(p.request_id, p.ticket)
                if p.structure_path:
                    self.telemetry.metrics.structured.labels(p.structure_path).inc()
            self._check_connection(first.connection)
            if self.guard is not None and len(prepared) > 1:
                self.guard.charge(client, len(prepared) - 1)  # the call itself paid for one sample
            streams = self.engine.submit(prepared, formatters, client)
        except EngineError as e:
            first.obs.fail(e)
            raise
        for life, stream in zip(lives, streams):
            life.stream = stream
        if first.connection:
            self._calls[first.connection] += 1
            first.counted = True
        return streams

    def _check_connection(self, connection: str) -> None:
        limit = self.max_calls_per_connection
        if connection and limit and self._calls[connection] >= limit:
            raise Overloaded(f"{limit} calls already open on this connection; retry later")

    def _call_ended(self, connection: str) -> None:
        self._calls[connection] -= 1
        if self._calls[connection] <= 0:
            del self._calls[connection]


class LiveRequest:
    def __init__(self, lifecycle: Lifecycle, obs: RequestObserver, connection: str = ""):
        self.lifecycle, self.obs = lifecycle, obs
        self.stream: Optional[RequestStream] = None
        self.connection = connection  # a gRPC call's peer, port included: one per connection
        self.counted = False  # counted against its connection's calls

    async def submit(self, req: Request, formatter: Optional[FormatterFactory] = None) -> RequestStream:
        """`Lifecycle.submit` of this one request."""
        return (await self.lifecycle.submit([self], [req], [formatter]))[0]

    def events(self) -> AsyncIterator[StepEvent]:
        """The stream's events; an engine error mid-stream (a failed step) is recorded and raised.
        The stream itself, observed as it is read (no generator layer per message)."""
        assert self.stream is not None, "submit first"
        self.stream.observer = self._observe
        return self.stream

    def _observe(self, item: object) -> None:
        if isinstance(item, EngineError):
            self.obs.fail(item)
        else:
            self.obs.step(item)

    def fail(self, exc: BaseException) -> None:
        """An error the door raised itself (bad wire fields, a bug while formatting)."""
        if not self.obs.outcome:
            self.obs.fail(exc)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        if self.counted:
            self.counted = False
            self.lifecycle._call_ended(self.connection)
        self.obs.end()


def merged_events(lives: list[LiveRequest]) -> AsyncIterator[StepEvent]:
    """The events of several live requests as they come, as `merged` without the index; one
    request's are its own stream's (one async-generator layer less per message)."""
    if len(lives) == 1:
        return lives[0].events()
    return (ev async for _, ev in merged(lives))


async def merged(lives: list[LiveRequest]) -> AsyncIterator[tuple[int, StepEvent]]:
    """(index, event) of several live requests (one per choice) as their events come; an engine
    error of any of them is raised here."""
    if len(lives) == 1:
        async for ev in lives[0].events():
            yield 0, ev
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(k: int, life: LiveRequest) -> None:
        try:
            async for ev in life.events():
                queue.put_nowait((k, ev))
        except EngineError as e:
            queue.put_nowait(e)
        finally:
            queue.put_nowait(end)

    pumps = [asyncio.ensure_future(pump(k, life)) for k, life in enumerate(lives)]
    try:
        running = len(pumps)
        while running:
            item = await queue.get()
            if item is end:
                running -= 1
            elif isinstance(item, EngineError):
                raise item
            else:
                yield item
    finally:
        for p in pumps:
            p.cancel()
