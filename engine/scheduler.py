"""Admission and per-request streams: `Scheduler` serves one `StepLoop` (engine/step_loop.py) to
asyncio. A step worker thread owns the loop: it steps back to back while there is work and, between steps, applies cancellations and admits waiting requests
itself, so the event loop is never on a step's critical path (at a GPU's pace every hand-off
through the loop is time the GPU idles). The loop only queues requests (`StepLoop.add`: a deque
append, safe beside a step), marks cancellations for the worker, and writes each request's step
events to its own `RequestStream`. One worker, batched forwards over the running requests —
never one forward per request.

`submit` admits eagerly: a full queue, too many open streams, draining or a duplicate id raise
there, before a stream exists, so no front door sees admission errors arrive through a stream.
A stream counts against admission until its door closes it, also after the engine finished it:
a client that opens streams and never reads them holds places, not unbounded memory.

Formatting happens off the event loop. A door may pass `submit` a formatter: an opaque callable
StepEvent -> anything (the engine never looks inside; gRPC builds a GenerateResponse, the HTTP
gateway an SSE chunk). A formatter thread calls it once per event, in step order, and the event
reaches the stream with the result in `StepEvent.formatted`; the event loop only writes it out.
A formatter that raises does not fail the step: its exception travels in `formatted` for the
door to raise. Only shutdown's cancel events are formatted on the loop.

Step n's events are formatted and delivered while step n+1 runs (a pipeline of depth one): the
step worker never waits for formatting, and delivery never falls more than one step behind,
because the worker hands over step n+1's events only once step n's are in their streams. Events are immutable
snapshots, so formatting them beside the next step reads nothing that step writes.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import threading
from typing import Any, Callable, Optional

from engine.errors import EngineError, FieldViolation, InvalidRequest, Overloaded, StepFailed, Unavailable, clip
from engine.sequence import Sequence, StepEvent
from engine.step_loop import StepLoop, StepRecord
from engine.threads import TensorThread


_DONE = object()
Formatter = Callable[[StepEvent], Any]
log = logging.getLogger("celeris.engine")


class RequestStream:
    """The step events of one admitted request. Iterate it; `close()` it when done (a door's
    `finally`): that cancels the request if it is still in the engine, makes its id reusable at
    once, and gives its place back to admission."""

    def __init__(self, scheduler: Scheduler, seq: Sequence):
        self.scheduler, self.seq = scheduler, seq
        self.request_id, self.ticket = seq.request_id, seq.ticket
        self.queue: asyncio.Queue = asyncio.Queue()
        self.ended = False  # the engine has delivered its last event (or an error)
        self.closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StepEvent:
        if self.closed:
            raise StopAsyncIteration
        ev = await self.queue.get()
        if ev is _DONE:
            raise StopAsyncIteration
        if isinstance(ev, EngineError):
            raise ev
        return ev

    def close(self) -> None:
        self.scheduler._close(self)

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


class Scheduler:
    """asyncio front of a StepLoop. `submit()` admits a request and returns its RequestStream."""

    def __init__(self, loop_core: StepLoop, on_step: Optional[Callable[[StepRecord], None]] = None,
                 max_open: Optional[int] = None, thread: Optional[TensorThread] = None):
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
        # Requests to cancel, appended on the loop, applied by the worker between steps.
        self._cancelled: collections.deque[Sequence] = collections.deque()
        self._kick = threading.Event()  # wakes an idle worker (new work, cancellation, stop)
        self._kick_pending = False
        self._format_executor = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                      thread_name_prefix="celeris-format")
        self._worker: Optional[asyncio.Future] = None  # done when the step worker has returned
        self._stopping = False
        self.accepting = True
        self.steps = 0

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
        if self._worker is None and self.thread is not None:
            self._worker = asyncio.wrap_future(self.thread.submit(self._work, asyncio.get_running_loop()))
        elif self._worker is None:
            loop = asyncio.get_running_loop()
            done: concurrent.futures.Future = concurrent.futures.Future()

            def work() -> None:
                try:
                    self._work(loop)
                except BaseException as exc:  # never expected: the worker catches step failures
                    done.set_exception(exc)
                else:
                    done.set_result(None)

            # A daemon thread: a scheduler never stopped must not hold the interpreter at exit.
            threading.Thread(target=work, name="celeris-step", daemon=True).start()
            self._worker = asyncio.wrap_future(done)

    async def stop(self) -> None:
        """Refuse new work, let the step in flight finish (the worker is never cut mid-step), then
        cancel what is left."""
        self.accepting = False
        self._stopping = True
        self._kick.set()
        if self._worker is not None:
            try:
                await self._worker  # it ends after the step in flight, its events delivered
            except (asyncio.CancelledError, Exception):  # stopping must always complete
                log.exception("the step worker failed")
            self._worker = None
        self._apply_cancellations()  # the worker is gone: the loop owns the StepLoop now
        for stream in list(self._live.values()):
            ev = self.core.cancel(stream.seq)
            self._deliver(stream, self._format(ev) if ev is not None else None)
        self._format_executor.shutdown(wait=True)

    def submit(self, seq: Sequence, formatter: Optional[Formatter] = None) -> RequestStream:
        """Admit `seq` or raise (Unavailable, Overloaded, InvalidRequest for a duplicate id).
        `formatter`, if given, turns each of its events into `StepEvent.formatted` in the
        formatter thread (see the module docstring); it is set before the request can run a step."""
        if not self.accepting:
            raise Unavailable("server is draining; retry on another replica")
        if seq.request_id in self._ids:
            raise InvalidRequest([FieldViolation("request_id", f"{clip(seq.request_id)} is already running")])
        if self._open >= self.max_open:
            raise Overloaded(f"too many open streams ({self._open}); retry later")
        if formatter is not None:
            self._formatters[seq.ticket] = formatter
        try:
            self.core.add(seq)
        except EngineError:
            self._formatters.pop(seq.ticket, None)
            raise
        stream = RequestStream(self, seq)
        self._live[seq.ticket] = self._ids[seq.request_id] = stream
        self._open += 1
        self._kick_soon()
        return stream

    def cancel(self, request_id: str) -> None:
        """Cancel the running request with this id, if any (its door still closes its stream)."""
        stream = self._ids.get(request_id)
        if stream is not None:
            self._end(stream, cancel=True)

    # ------------------------------------------------------------------ streams

    def _end(self, stream: RequestStream, cancel: bool) -> None:
        """The engine is done with `stream`: forget it, and cancel it between steps if asked."""
        if stream.ended:
            return
        stream.ended = True
        self._live.pop(stream.ticket, None)
        self._formatters.pop(stream.ticket, None)
        if self._ids.get(stream.request_id) is stream:
            del self._ids[stream.request_id]
        if cancel:
            self._cancelled.append(stream.seq)
            stream.queue.put_nowait(_DONE)
            self._kick.set()

    def _close(self, stream: RequestStream) -> None:
        if stream.closed:
            return
        self._end(stream, cancel=True)
        stream.closed = True
        self._open -= 1

    def _deliver(self, stream: Optional[RequestStream], ev: Optional[StepEvent]) -> None:
        if stream is None or stream.ended:
            return
        if ev is not None:
            stream.queue.put_nowait(ev)
        if ev is None or ev.finished:
            self._end(stream, cancel=False)
            stream.queue.put_nowait(_DONE)

    def _fail(self, seq: Sequence, exc: EngineError) -> None:
        stream = self._live.get(seq.ticket)
        if stream is not None:
            self._end(stream, cancel=False)
            stream.queue.put_nowait(exc)
            stream.queue.put_nowait(_DONE)

    def _apply_cancellations(self) -> None:
        while self._cancelled:
            self.core.cancel(self._cancelled.popleft())

    # ------------------------------------------------------------------ the step worker

    def _format(self, ev: StepEvent) -> StepEvent:
        """`ev` with its door's formatter applied (in the formatter thread, but for shutdown)."""
        fmt = self._formatters.get(ev.ticket)
        if fmt is None:
            return ev
        try:
            out = fmt(ev)
        except Exception as exc:  # a formatting bug ends this request only, through its door
            log.exception("formatting the step event of %s failed", ev.request_id)
            out = exc
        return dataclasses.replace(ev, formatted=out)

    def _format_and_post(self, loop: asyncio.AbstractEventLoop, events: list[StepEvent]) -> threading.Event:
        """Formatter thread: format one step's events, hand them to the event loop to write out.
        The returned event is set once they are in their streams."""
        delivered = threading.Event()
        formatted = [self._format(ev) for ev in events]
        if not _post(loop, self._deliver_step, formatted, delivered):
            delivered.set()  # no loop left to deliver to: nothing to wait for
        return delivered

    def _deliver_step(self, formatted: list[StepEvent], delivered: threading.Event) -> None:
        try:
            for ev in formatted:  # a stream cancelled meanwhile is no longer live: dropped
                self._deliver(self._live.get(ev.ticket), ev)
        finally:
            delivered.set()

    def _stepped(self, record: StepRecord) -> None:
        self.steps += 1
        if self.on_step is not None:
            self.on_step(record)

    def _failed(self, seqs: list[Sequence], exc: Exception) -> None:
        for seq in seqs:
            # Unavailable (a tensor-parallel worker lost): the engine cannot serve, not a bug.
            self._fail(seq, exc if isinstance(exc, Unavailable) else StepFailed(f"denoising step failed: {exc!r}"))

    def _kick_soon(self) -> None:
        """Wake the worker at the end of this loop iteration, so requests submitted together
        (several handlers in one iteration) join the same first step."""
        if self._kick_pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # submitted from outside the loop: wake the worker at once
            self._kick.set()
            return
        self._kick_pending = True
        loop.call_soon(self._kick_now)

    def _kick_now(self) -> None:
        self._kick_pending = False
        self._kick.set()

    def _work(self, loop: asyncio.AbstractEventLoop) -> None:
        """The step worker: steps back to back while there is work, applying cancellations and
        admitting between steps itself, so the event loop is never on a step's critical path.
        Step n's events go to the formatter thread while step n+1 runs; the worker waits for
        step n to be delivered before handing over step n+1 (one step deep: a stalled loop
        stalls the worker after one step, it never piles up events)."""
        previous: Optional[concurrent.futures.Future] = None

        def settle() -> None:  # the previous step's events are in their streams
            nonlocal previous
            if previous is not None:
                pending, previous = previous, None
                try:
                    pending.result().wait()
                except Exception:  # a bug in the hand-off must not stop the worker (nor hang the server)
                    log.exception("handing a step's events to the event loop failed")

        try:
            while True:
                self._apply_cancellations()
                if self._stopping:
                    return
                if self.core.idle:
                    settle()
                    self._kick.wait()
                    self._kick.clear()  # then look again: whatever set it is visible by now
                    continue
                try:
                    events, record = self.core.step()
                except Exception as exc:  # keep serving: end this batch's requests, not the worker
                    if isinstance(exc, Unavailable):  # e.g. a lost tensor-parallel worker, reported once elsewhere
                        log.warning("engine unavailable; ending %d request(s): %s", len(self.core.running), exc)
                    else:
                        log.exception("denoising step failed; ending %d request(s)", len(self.core.running))
                    settle()  # the steps before the failure reach their streams first
                    _post(loop, self._failed, self.core.fail_running(), exc)
                    continue
                if record is not None:
                    _post(loop, self._stepped, record)
                settle()
                previous = self._format_executor.submit(self._format_and_post, loop, events)
        finally:  # nothing a finished step produced is lost when the worker stops
            settle()


def _post(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> bool:
    """Run fn(*args) on the event loop, from another thread; False once the loop is closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        return False
    return True
