"""The step worker: the thread that owns a `StepLoop` while a `Scheduler` (engine/loop/scheduler.py)
serves it to asyncio.

It steps back to back while there is work and, between steps, applies cancellations and admits
waiting requests itself, so the event loop is never on a step's critical path (at a GPU's pace
every hand-off through the loop is time the GPU idles). The event loop only queues requests,
marks cancellations here (`cancel`) and wakes the worker (`kick_soon`).

Step n's events are built while step n+1 runs on the device (`StepLoop.step_later`), then handed
to the formatter thread (the scheduler's `hand_over`: format, then deliver on the event loop)
beside it; the worker hands over step n's events only once step n-1's are in their streams, so
delivery never falls more than one step behind. A step that raises ends its batch's requests
(`on_failure`, on the event loop), not the worker.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
from typing import Callable, Optional

from celeris.engine.errors import Unavailable
from celeris.engine.events import StepEvent
from celeris.engine.loop.sequence import Sequence
from celeris.engine.loop.step_loop import StepLoop, StepRecord

# Formatter thread: format one step's events and post them to the event loop; the returned event is
# set once they are in their streams.
HandOver = Callable[[asyncio.AbstractEventLoop, list[StepEvent], Optional[StepRecord]], threading.Event]
log = logging.getLogger("celeris.engine")


class StepWorker:
    """Runs `work` on one thread; the other methods are called from the event loop."""

    def __init__(self, core: StepLoop, hand_over: HandOver,
                 on_failure: Callable[[list[Sequence], Exception], None]):
        self.core = core
        self.stopping = False
        self._hand_over = hand_over
        self._on_failure = on_failure  # the failed step's sequences and its exception, on the event loop
        # Requests to cancel, appended on the loop, applied by the worker between steps.
        self._cancelled: collections.deque[Sequence] = collections.deque()
        self._kick = threading.Event()  # wakes an idle worker (new work, cancellation, stop)
        self._kick_pending = False
        self._formatter = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="celeris-format")

    def cancel(self, seq: Sequence) -> None:
        """Cancel `seq` between steps."""
        self._cancelled.append(seq)
        self._kick.set()

    def stop(self) -> None:
        """Return after the step in flight (never cut mid-step), its events delivered."""
        self.stopping = True
        self._kick.set()

    def close(self) -> None:
        """Once `work` has returned: wait for the formatter thread's last hand-over."""
        self._formatter.shutdown(wait=True)

    def kick_soon(self) -> None:
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

    def apply_cancellations(self, before: Callable[[], None] = lambda: None) -> None:
        """Cancel what the loop asked to, `before` first if any (it builds the last step's events)."""
        cancels = [self._cancelled.popleft() for _ in range(len(self._cancelled))]
        if cancels:
            before()
        for seq in cancels:
            self.core.cancel(seq)

    def work(self, loop: asyncio.AbstractEventLoop) -> None:
        """The worker's thread (module docstring). Step n's events are built and handed over in
        step n+1's `during` (the device's time when the runner overlaps host work), or before the
        worker idles, cancels, fails or stops: a stalled loop stalls it after one step."""
        previous: Optional[concurrent.futures.Future] = None
        pending: Optional[tuple[list, Optional[StepRecord]]] = None  # the last step's events, unbuilt

        def settle() -> None:  # the previous step's events are in their streams
            nonlocal previous
            if previous is not None:
                waiting, previous = previous, None
                try:
                    waiting.result().wait()
                except Exception:  # a bug in the hand-off must not stop the worker (nor hang the server)
                    log.exception("handing a step's events to the event loop failed")

        def publish() -> None:  # build the last step's events, hand them over (at most once)
            nonlocal pending, previous
            if pending is None:
                return
            (build, record), pending = pending, None
            events = [b() for b in build]
            settle()
            # The step's record travels with its events: telemetry runs on the loop after
            # they are delivered, one hand-off per step, nothing of it on this thread.
            previous = self._formatter.submit(self._hand_over, loop, events, record)

        try:
            while True:
                self.apply_cancellations(publish)
                if self.stopping:
                    return
                if self.core.idle:
                    publish()
                    settle()
                    self._kick.wait()
                    self._kick.clear()  # then look again: whatever set it is visible by now
                    continue
                try:
                    pending = self.core.step_later(during=publish)
                except Exception as exc:  # keep serving: end this batch's requests, not the worker
                    if isinstance(exc, Unavailable):  # e.g. a lost tensor-parallel worker, reported once elsewhere
                        log.warning("engine unavailable; ending %d request(s): %s", len(self.core.running), exc)
                    else:
                        log.exception("denoising step failed; ending %d request(s)", len(self.core.running))
                    publish()
                    settle()  # the steps before the failure reach their streams first
                    post(loop, self._on_failure, self.core.fail_running(), exc)
                    continue
        finally:  # nothing a finished step produced is lost when the worker stops
            publish()
            settle()


def post(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> bool:
    """Run fn(*args) on the event loop, from another thread; False once the loop is closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        return False
    return True
