"""Admission and per-request streams: `Scheduler` serves one `StepLoop` (engine/loop/step_loop.py) to
asyncio. A step worker thread owns the loop (engine/loop/step_worker.py: it steps back to back,
and applies cancellations and admits waiting requests between steps, so the event loop is never
on a step's critical path). The event loop only queues requests (`StepLoop.add`: a deque append,
safe beside a step), marks cancellations for the worker, and writes each request's step events to
its own `RequestStream`. One worker, batched forwards over the running requests — never one
forward per request.

`submit_group` admits one call's samples eagerly and all or none: a full queue, too many open
streams, the owner's (client's) share used up, draining or a duplicate id raise there, before a
stream exists. A stream holds its place until its door closes it, also after the engine finished
it; memory per stream is bounded however its client reads (engine/loop/request_stream.py: lagging
readers get folded events, readers silent for `unread_timeout` are abandoned).

Formatting happens off the event loop. A door may pass `submit` a formatter: an opaque callable
StepEvent -> anything (the engine never looks inside; gRPC builds a GenerateResponse, the HTTP
gateway an SSE chunk). A formatter thread calls it once per event, in step order, and the event
reaches the stream with the result in `StepEvent.formatted`; the event loop only writes it out.
A formatter that raises does not fail the step: its exception travels in `formatted` for the
door to raise. Only shutdown's cancel events are formatted on the loop.

Step n's events are built while step n+1 runs on the device, then formatted and delivered beside
it, at most one step behind (step_worker.py). Events are immutable snapshots: formatting one
reads nothing the next step writes.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import Any, Callable, Optional

from celeris.engine.loop.admission import check_room
from celeris.engine.errors import EngineError, Overloaded, StepFailed, StreamAbandoned, Unavailable, clip
from celeris.engine.loop.request_stream import DONE, RequestStream, fold
from celeris.engine.loop.retry_after import RetryEstimate
from celeris.engine.events import StepEvent
from celeris.engine.loop.sequence import Sequence
from celeris.engine.loop.step_loop import StepLoop, StepRecord
from celeris.engine.loop.step_worker import StepWorker, post
from celeris.engine.threads import TensorThread, in_daemon_thread


Formatter = Callable[[StepEvent], Any]
log = logging.getLogger("celeris.engine")


class Scheduler:
    """asyncio front of a StepLoop. `submit()` admits a request and returns its RequestStream."""

    def __init__(self, loop_core: StepLoop, on_step: Optional[Callable[[StepRecord], None]] = None,
                 max_open: Optional[int] = None, thread: Optional[TensorThread] = None,
                 max_open_per_owner: Optional[int] = None, unread_timeout: float = 0.0):
        self.core = loop_core
        self.on_step = on_step
        # Where the step worker runs: the thread that loaded the model (a server passes the
        # TensorThread it loaded with: engine/threads.py says why), else a thread of its own.
        self.thread = thread
        # Open streams (running, waiting, or finished but not yet closed by their door).
        self.max_open = max_open if max_open is not None else loop_core.runner.slots + loop_core.max_queue
        self._live: dict[int, RequestStream] = {}  # ticket -> stream, while the engine has it
        self._ids: dict[str, RequestStream] = {}  # request id -> stream, while the engine has it
        self._formatters: dict[int, Formatter] = {}  # ticket -> the door's formatter, while live
        self._open = 0
        # One owner (a client: its API key, else its address) holds at most this many places.
        self.max_open_per_owner = max_open_per_owner or self.max_open
        self._owned: collections.Counter[str] = collections.Counter()
        self._placed: set[RequestStream] = set()  # streams holding a place
        self.unread_timeout = unread_timeout  # 0 = off; else abandon streams unread this long
        self._watch: Optional[asyncio.Task] = None
        # Formatter thread only: per ticket, the events folded for a lagging reader (request_stream.py).
        self._held: dict[int, StepEvent] = {}
        self.worker = StepWorker(loop_core, self._format_and_post, self._failed)
        self._worker: Optional[asyncio.Future] = None  # done when the step worker has returned
        self.accepting = True
        self.on_dead: Optional[Callable[[], None]] = None  # called if the step worker dies
        self.steps = 0
        self.retry_estimate = RetryEstimate()  # a refusal's retry_after_s, from the queue and step pace

    # ------------------------------------------------------------------ public

    @property
    def running(self) -> int:
        return len(self.core.running)

    @property
    def queued(self) -> int:
        return len(self.core.waiting)

    @property
    def active(self) -> int:
        """Requests the engine still works on."""
        return len(self._live)

    @property
    def open(self) -> int:
        """Streams admitted and not yet closed, parked ones included."""
        return self._open

    def start(self) -> None:
        if self.unread_timeout > 0 and self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(self._watch_unread())
        if self._worker is None and self.thread is not None:
            self._worker = asyncio.wrap_future(self.thread.submit(self.worker.work, asyncio.get_running_loop()))
        elif self._worker is None:  # a thread of its own (the worker catches step failures)
            loop = asyncio.get_running_loop()
            self._worker = asyncio.wrap_future(in_daemon_thread(lambda: self.worker.work(loop), "celeris-step"))
        self._worker.add_done_callback(self._worker_ended)

    def _worker_ended(self, worker: asyncio.Future) -> None:
        """The step worker returned: expected when stopping; otherwise nothing can be served any
        more, so refuse new work and say so (`on_dead`, e.g. health NOT_SERVING)."""
        if self.worker.stopping:
            return
        self.accepting = False
        error = worker.exception() if not worker.cancelled() else None
        log.error("the step worker ended unexpectedly: %r; refusing new work", error)
        self._failed([stream.seq for stream in self._live.values()], RuntimeError(f"the step worker ended: {error!r}"))
        if self.on_dead is not None:
            self.on_dead()

    async def stop(self) -> None:
        """Refuse new work, let the step in flight finish (the worker is never cut mid-step), then
        cancel what is left."""
        self.accepting = False
        self.worker.stop()
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self._worker is not None:
            try:
                await self._worker  # it ends after the step in flight, its events delivered
            except (asyncio.CancelledError, Exception):  # stopping must always complete
                log.exception("the step worker failed")
            self._worker = None
        self.worker.apply_cancellations()  # the worker is gone: the loop owns the StepLoop now
        for stream in list(self._live.values()):
            ev = self.core.cancel(stream.seq)
            self._deliver(stream, self._format(ev) if ev is not None else None)
        self.worker.close()

    def submit(self, seq: Sequence, formatter: Optional[Formatter] = None, owner: str = "") -> RequestStream:
        """`submit_group` of one request."""
        return self.submit_group([seq], [formatter], owner)[0]

    def submit_group(self, seqs: list[Sequence], formatters: Optional[list[Optional[Formatter]]] = None,
                     owner: str = "") -> list[RequestStream]:
        """Admit every one of `seqs` (one call's samples) or none: raises Unavailable, Overloaded,
        or InvalidRequest (a duplicate id, or more samples than one owner may ever hold).
        `formatters[k]`, if given, turns each event of seqs[k] into `StepEvent.formatted` in the
        formatter thread (see the module docstring); set before the request can run a step.
        `owner` (a client key) holds at most `max_open_per_owner` places."""
        try:
            check_room(self.core, [s.request_id for s in seqs], owner, self.accepting, self._ids, self._open,
                       self.max_open, self._owned[owner], self.max_open_per_owner)
        except Overloaded as e:  # when this call would have started, queued behind what is there now
            e.retry_after_s = self.retry_estimate.seconds(self.core, len(seqs))
            raise
        streams = []
        for seq, fmt in zip(seqs, formatters or [None] * len(seqs)):
            if fmt is not None:
                self._formatters[seq.ticket] = fmt
            seq.owner = owner  # its share of the running slots is the owner's (engine/loop/fair_share.py)
            self.core.add(seq, bounded=False)  # room for all was checked above
            stream = RequestStream(seq, self._close, owner)
            self._live[seq.ticket] = self._ids[seq.request_id] = stream
            self._placed.add(stream)
            streams.append(stream)
        self._open += len(seqs)
        self._owned[owner] += len(seqs)
        self.worker.kick_soon()
        return streams

    def cancel(self, request_id: str) -> None:
        """Cancel the running request with this id, if any (its door still closes its stream)."""
        stream = self._ids.get(request_id)
        if stream is not None:
            self._end(stream, cancel=True)

    def interrupt(self, error: EngineError) -> None:
        """End every request the engine still works on with `error` (shutdown's grace is over):
        their doors then write a proper ending instead of being cut."""
        for stream in list(self._live.values()):
            self._end(stream, cancel=True, error=error)

    # ------------------------------------------------------------------ streams

    def _end(self, stream: RequestStream, cancel: bool, error: Optional[EngineError] = None) -> None:
        """The engine is done with `stream`: forget it, and cancel it between steps if asked
        (the reader then gets `error`, if given, and the end)."""
        if stream.ended:
            return
        stream.ended = True
        self._live.pop(stream.ticket, None)
        self._formatters.pop(stream.ticket, None)
        if self._ids.get(stream.request_id) is stream:
            del self._ids[stream.request_id]
        if cancel:
            if error is not None:
                stream.queue.put_nowait(error)
            stream.queue.put_nowait(DONE)
            self.worker.cancel(stream.seq)

    def _release(self, stream: RequestStream) -> None:
        """Give `stream`'s place back to admission (once)."""
        if stream.placed:
            stream.placed = False
            self._placed.discard(stream)
            self._open -= 1
            self._owned[stream.owner] -= 1
            if not self._owned[stream.owner]:
                del self._owned[stream.owner]

    def _close(self, stream: RequestStream) -> None:
        if stream.closed:
            return
        self._end(stream, cancel=True)
        stream.closed = True
        self._release(stream)

    def _abandon(self, stream: RequestStream) -> None:
        """Its reader took nothing for `unread_timeout` s: cancel it, drop what it holds, free its place."""
        while not stream.queue.empty():
            stream.queue.get_nowait()
        error = StreamAbandoned(f"the stream was not read for {self.unread_timeout:g} s; request cancelled")
        if stream.ended:
            stream.queue.put_nowait(error)
            stream.queue.put_nowait(DONE)
        self._end(stream, cancel=True, error=error)
        self._release(stream)
        log.warning("abandoned the unread stream of %s after %g s", clip(stream.request_id), self.unread_timeout)
        if stream.on_abandon is not None:
            stream.on_abandon()

    async def _watch_unread(self) -> None:
        """Abandon streams whose reader has taken nothing for `unread_timeout` while events wait."""
        period = max(0.05, min(1.0, self.unread_timeout / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for stream in [s for s in self._placed if not s.queue.empty()]:
                if now - stream.read_at > self.unread_timeout:
                    self._abandon(stream)

    def _deliver(self, stream: Optional[RequestStream], ev: Optional[StepEvent]) -> None:
        if stream is None or stream.ended:
            return
        if ev is not None and ev.error is not None:  # its own row failed (step_loop.apply_row): it alone ends
            self._fail(stream.seq, ev.error)
            return
        if ev is not None:
            stream.queue.put_nowait(ev)
        if ev is None or ev.finished:
            self._end(stream, cancel=False)
            stream.queue.put_nowait(DONE)

    def _fail(self, seq: Sequence, exc: EngineError) -> None:
        stream = self._live.get(seq.ticket)
        if stream is not None:
            self._end(stream, cancel=False)
            stream.queue.put_nowait(exc)
            stream.queue.put_nowait(DONE)

    # ------------------------------------------------------------------ formatting and delivery

    def _format(self, ev: StepEvent) -> StepEvent:
        """`ev` with its door's formatter applied (in the formatter thread, but for shutdown)."""
        fmt = self._formatters.get(ev.ticket)
        if fmt is None or ev.error is not None:  # a failed row's door raises its error, formats nothing
            return ev
        try:
            out = fmt(ev)
        except Exception as exc:  # a formatting bug ends this request only, through its door
            log.exception("formatting the step event of %s failed", ev.request_id)
            out = exc
        return ev.with_formatted(out)

    def _format_and_post(self, loop: asyncio.AbstractEventLoop, events: list[StepEvent],
                         record: Optional[StepRecord] = None) -> threading.Event:
        """Formatter thread: format one step's events, hand them and the step's record to the
        event loop in one call (one wake-up of the loop per step). The returned event is set
        once they are in their streams."""
        delivered = threading.Event()
        formatted = [self._format(ev) for ev in fold(events, self._held, self._live)]
        if not post(loop, self._deliver_step, formatted, delivered, record):
            delivered.set()  # no loop left to deliver to: nothing to wait for
        return delivered

    def _deliver_step(self, formatted: list[StepEvent], delivered: threading.Event,
                      record: Optional[StepRecord] = None) -> None:
        try:
            for ev in formatted:  # a stream cancelled meanwhile is no longer live: dropped
                self._deliver(self._live.get(ev.ticket), ev)
        finally:
            delivered.set()  # the worker waits on this, not on the step's telemetry below
            if record is not None:
                self._stepped(record)

    def _stepped(self, record: StepRecord) -> None:
        self.steps += 1
        self.retry_estimate.observe(record)
        if self.on_step is not None:
            self.on_step(record)

    def _failed(self, seqs: list[Sequence], exc: Exception) -> None:
        for seq in seqs:
            # Unavailable (a tensor-parallel worker lost): the engine cannot serve, not a bug.
            # The exception's text may quote any request's input (a grammar, a prompt): the log has
            # it, the clients get its type only.
            self._fail(seq, exc if isinstance(exc, Unavailable) else StepFailed(
                f"denoising step failed ({type(exc).__name__}); the server log has the details"))
