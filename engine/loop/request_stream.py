"""One admitted request's events, as its door reads them, with bounded memory whatever the reader does.

`RequestStream` is what `Scheduler.submit_group` hands a door. Its queue holds at most `LAG`
undelivered step events (plus an ending): when the reader falls behind, further events are not
queued one by one but folded into one pending event (`merge`) that is formatted and queued once
the reader catches up, or when the request finishes. A snapshot event carries the whole canvas,
so folding loses nothing a client needs to rebuild it: the folded event has the newest canvas and
every position committed since the last event queued. The scheduler does the folding; this module
only says how (`merge`) and how far behind a reader is.

A reader that takes nothing for `unread_timeout` seconds while events wait is abandoned by the
scheduler: its request is cancelled, its place is given back, and the stream ends with
`StreamAbandoned` for whoever reads it later.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Callable, Optional

from celeris.engine.errors import EngineError
from celeris.engine.events import StepEvent
from celeris.engine.loop.sequence import Sequence

LAG = 4  # step events a stream may hold unread before further ones are folded into one
DONE = object()  # the end marker in a stream's queue


def merge(older: StepEvent, newer: StepEvent) -> StepEvent:
    """One event saying what `older` then `newer` said: `newer`'s snapshot, with every position
    committed in either (and their confidences and commit-time logprobs), and a block completed
    in either. Positions are committed once, so the union keeps step order."""
    seen = set(newer.committed)
    kept = [k for k, p in enumerate(older.committed) if p not in seen]
    lps = older.committed_logprobs
    return dataclasses.replace(
        newer,
        committed=tuple(older.committed[k] for k in kept) + newer.committed,
        confidences=tuple(older.confidences[k] for k in kept) + newer.confidences,
        committed_logprobs=tuple(lps[k] for k in kept if k < len(lps)) + newer.committed_logprobs,
        block_complete=older.block_complete or newer.block_complete)


def fold(events: list[StepEvent], held: dict[int, StepEvent], live: dict[int, RequestStream]) -> list[StepEvent]:
    """The formatter thread's filter over one step's events: those to format now. An event for a
    lagging reader is folded into the one `held` for it, unless it is the request's last; held
    events of requests no longer `live` (cancelled meanwhile) are dropped."""
    out = []
    for ev in events:
        before = held.pop(ev.ticket, None)
        ev = ev if before is None else merge(before, ev)
        stream = live.get(ev.ticket)
        if stream is not None and stream.lagging and not ev.finished:
            held[ev.ticket] = ev
        else:
            out.append(ev)
    for ticket in [t for t in held if t not in live]:
        held.pop(ticket, None)
    return out


class RequestStream:
    """The step events of one admitted request. Iterate it; `close()` it when done (a door's
    `finally`): that cancels the request if it is still in the engine, makes its id reusable at
    once, and gives its place back to admission."""

    def __init__(self, seq: Sequence, on_close: Callable[[RequestStream], None], owner: str = ""):
        # `on_close` is the scheduler's: cancel the request if still running, give its place back.
        self.seq, self.owner, self._on_close = seq, owner, on_close
        self.request_id, self.ticket = seq.request_id, seq.ticket
        self.queue: asyncio.Queue = asyncio.Queue()
        self.ended = False  # the engine has delivered its last event (or an error)
        self.closed = False  # the door closed it
        self.placed = True  # it holds a place in admission (given back on close or abandon)
        self.read_at = time.monotonic()  # when the reader last took an item
        self.on_abandon: Optional[Callable[[], None]] = None  # set by a door: e.g. drop the connection
        # Set by a door: sees each event, or the error, as the reader takes it (its telemetry),
        # so that observing costs no extra async-generator layer per message.
        self.observer: Optional[Callable[[object], None]] = None
        # How its structured output decodes (skeleton, document, regex; "" for free text), set by the
        # engine's front (engine/serving.py): both doors report it without reading the request.
        self.structure_path = ""

    @property
    def lagging(self) -> bool:
        """The reader has `LAG` events waiting: fold further ones (read from the formatter thread:
        a length read, safe without the loop)."""
        return self.queue.qsize() >= LAG

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StepEvent:
        if self.closed:
            raise StopAsyncIteration
        ev = await self.queue.get()
        self.read_at = time.monotonic()
        if ev is DONE:
            raise StopAsyncIteration
        if self.observer is not None:
            self.observer(ev)
        if isinstance(ev, EngineError):
            raise ev
        return ev

    def close(self) -> None:
        self._on_close(self)

    async def aclose(self) -> None:
        self.close()

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()
