"""One door-neutral pipeline: map the request, open the streams, stream, map the errors.

Both generation handlers (gRPC Generate, HTTP completions) are this, with their door's mapping
and their door's way to answer an error:

    async with pipeline.call(door, name, carrier, peer, prompt) as call:
        try:
            await call.open(reqs, formatters)  # one life per sample; prepared once, admitted all or none
        except EngineError as e:
            ...                                # the door answers call.fail(<e named in its fields>)
        async for message in call.messages():  # each event's message, built off the loop by its formatter
            ...

`Call` closes every sample's stream and records its outcome however the handler leaves (`async
with`), so no handler writes a `finally`. The tool-call and reasoning parsers are resolved once, for
both doors (`Pipeline.parsers`: the settings' names, else detected from the chat template).
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable, Optional

from celeris.engine.events import StepEvent
from celeris.engine.requests import Request
from celeris.engine.serving import FormatterFactory, RequestStream
from celeris.server.lifecycle import Lifecycle, LiveRequest, merged_events
from celeris.server.tools_api import Parsers


class Pipeline:
    def __init__(self, lifecycle: Lifecycle, parsers: Parsers):
        self.lifecycle, self.parsers = lifecycle, parsers

    def call(self, door: str, name: str, carrier: dict[str, str], peer: str, prompt: Optional[str] = None) -> Call:
        """One call of `door` ("grpc", "http"): its first sample's life starts now (a span, a log
        context), so an error mapping the request is recorded too."""
        return Call(lambda: self.lifecycle.start(door, name, carrier, peer, prompt))


class Call:
    """One door call's samples, from its mapped requests to their last messages."""

    def __init__(self, start: Callable[[], LiveRequest]):
        self._start = start
        self.lives = [start()]
        self.streams: list[RequestStream] = []

    async def __aenter__(self) -> Call:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for life in self.lives:
            life.close()  # cancels what is still running (a client gone, an error), frees its place

    async def open(self, reqs: list[Request], formatters: Optional[list[Optional[FormatterFactory]]] = None
                   ) -> list[RequestStream]:
        """Prepare and admit every sample (`Lifecycle.submit`); raises EngineError, recorded."""
        self.lives += [self._start() for _ in reqs[1:]]  # one life (span, metrics) per sample
        self.streams = await self.lives[0].lifecycle.submit(self.lives, reqs, formatters)
        return self.streams

    @property
    def structure_path(self) -> str:
        """How its structured output decodes ("" for free text): gRPC's initial metadata, HTTP's header."""
        return self.streams[0].structure_path if self.streams else ""

    def fail(self, exc: BaseException) -> BaseException:
        """Record an error the door raised itself (bad wire fields, a formatting bug); returns it."""
        self.lives[0].fail(exc)
        return exc

    def on_abandon(self, callback: Optional[Callable[[], None]]) -> None:
        """Call `callback` when the engine abandons a stream its client stopped reading."""
        for stream in self.streams:
            stream.on_abandon = callback

    async def messages(self) -> AsyncIterator[Any]:
        """Every sample's messages as their events come; an engine error mid-stream raises here, and
        so does a formatter's exception (a bug: recorded, answered as an internal error)."""
        async for ev in merged_events(self.lives):
            if isinstance(ev.formatted, Exception):
                raise self.fail(ev.formatted)
            if ev.formatted is not None:
                yield ev.formatted

    async def finals(self) -> list[Optional[StepEvent]]:
        """Each sample's last event (None: dropped before its first step); an engine error raises."""
        return list(await asyncio.gather(*(_last(life) for life in self.lives)))


async def _last(life: LiveRequest) -> Optional[StepEvent]:
    last = None
    async for last in life.events():
        pass
    return last
