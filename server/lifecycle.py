"""One request lifecycle for both front doors (gRPC and the HTTP gateway).

A door only translates: its wire request -> `engine.llm.Request`, then

    life = lifecycle.start(...)          # span, log context, metrics
    stream = await life.submit(request)  # validated once by the engine, tokenized off the event
                                         # loop, admitted eagerly: errors raise here
    async for ev in life.events():       # step events, observed once
        ...                              # -> response messages
    life.close()                         # always (a `finally`): cancels what is left, records the outcome

and maps errors through the one table in server/errors.py.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, Optional

from engine.errors import EngineError
from engine.llm import LLM, MAX_REQUEST_ID, Request
from engine.scheduler import Formatter, RequestStream, Scheduler
from engine.sequence import Sequence, StepEvent
from server.telemetry import RequestObserver, Telemetry


class Lifecycle:
    def __init__(self, llm: LLM, scheduler: Scheduler, telemetry: Telemetry):
        self.llm, self.scheduler, self.telemetry = llm, scheduler, telemetry

    def start(self, door: str, name: str, carrier: dict[str, str], peer: str,
              prompt: Optional[str] = None) -> LiveRequest:
        obs = self.telemetry.request(name, carrier, peer, {"celeris.door": door}, prompt)
        return LiveRequest(self, obs)


class LiveRequest:
    def __init__(self, lifecycle: Lifecycle, obs: RequestObserver):
        self.lifecycle, self.obs = lifecycle, obs
        self.stream: Optional[RequestStream] = None

    async def submit(self, req: Request, formatter: Optional[Callable[[Sequence], Formatter]] = None
                     ) -> RequestStream:
        """Build (validate + tokenize, in a worker thread) and admit; raises EngineError.
        `formatter(seq)` makes the request's event formatter, run in the step worker
        (Scheduler.submit): its events then arrive with `formatted` set."""
        if req.request_id:  # logged before validation, so cut to the limit
            self.obs.bind(req.request_id[:MAX_REQUEST_ID])
        try:
            seq = await self.lifecycle.llm.build_async(req)
            self.obs.bind(seq.request_id, seq.ticket)
            self.stream = self.lifecycle.scheduler.submit(seq, formatter(seq) if formatter else None)
        except EngineError as e:
            self.obs.fail(e)
            raise
        return self.stream

    async def events(self) -> AsyncIterator[StepEvent]:
        """The stream's events; an engine error mid-stream (a failed step) is recorded and raised."""
        assert self.stream is not None, "submit first"
        try:
            async for ev in self.stream:
                self.obs.step(ev)
                yield ev
        except EngineError as e:
            self.obs.fail(e)
            raise

    def fail(self, exc: BaseException) -> None:
        """An error the door raised itself (bad wire fields, a bug while formatting)."""
        if not self.obs.outcome:
            self.obs.fail(exc)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        self.obs.end()


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
