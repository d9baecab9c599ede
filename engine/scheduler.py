"""Admission, per-request state and the step loop.

`StepLoop` is the synchronous core shared by the offline engine and the server: requests wait
in a bounded queue, join the running batch when a slot frees, and leave it between steps.
`Scheduler` drives one `StepLoop` from asyncio: the forward runs in a worker thread so the event
loop keeps serving RPCs, and each request's snapshots go to its own queue. One loop, one forward
per step for every running request — never one forward per request.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional

from engine.errors import EngineError, FieldViolation, InvalidRequest, Overloaded, StepFailed, Unavailable
from engine.runner import Runner, StepStats
from engine.sequence import Sequence, StepEvent


@dataclass(frozen=True)
class StepRecord:
    """One executed step, for telemetry: who was in it and how it went."""

    request_ids: tuple[str, ...]
    stats: StepStats
    started: float  # time.time() at start
    ended: float


class StepLoop:
    def __init__(self, runner: Runner, max_queue: int):
        self.runner = runner
        self.max_queue = max_queue
        self.free_slots = list(range(runner.slots))
        self.running: list[Sequence] = []
        self.waiting: collections.deque[Sequence] = collections.deque()

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    def add(self, seq: Sequence, bounded: bool = True) -> None:
        """Queue a request; with `bounded`, a full queue raises Overloaded at once."""
        # Free slots absorb waiting requests at the next step, so they count as capacity too.
        if bounded and len(self.waiting) >= self.max_queue + len(self.free_slots):
            raise Overloaded(f"queue full ({self.max_queue} waiting, {len(self.running)} running)")
        self.waiting.append(seq)

    def cancel(self, request_id: str) -> Optional[StepEvent]:
        for seq in list(self.waiting):
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return seq.cancel()
        for seq in self.running:
            if seq.request_id == request_id:
                self._release(seq)
                return seq.cancel()
        return None

    def fail_running(self) -> list[Sequence]:
        """After a step raised: end every running request (their canvases are suspect)."""
        failed = list(self.running)
        for seq in failed:
            self._release(seq)
            seq.cancel()
        return failed

    def _admit(self) -> None:
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop(0)
            self.runner.load(seq)
            self.running.append(seq)

    def _release(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.free_slots.append(seq.slot)
        self.free_slots.sort()

    def step(self) -> tuple[list[StepEvent], Optional[StepRecord]]:
        """Admit, run one batched forward + selection, apply results, retire finished requests."""
        self._admit()
        if not self.running:
            return [], None
        batch = list(self.running)
        started = time.time()
        results, stats = self.runner.step(batch)
        events = [seq.apply(r.positions, r.tokens, r.confidences) for seq, r in zip(batch, results)]
        for seq in batch:
            if seq.finished:
                self._release(seq)
        return events, StepRecord(tuple(s.request_id for s in batch), stats, started, time.time())

    def run_to_completion(self, on_event: Optional[Callable[[StepEvent], None]] = None) -> None:
        while not self.idle:
            events, _ = self.step()
            if on_event:
                for ev in events:
                    on_event(ev)


_DONE = object()
log = logging.getLogger("celeris.engine")


class Scheduler:
    """asyncio front of a StepLoop. `generate()` streams a request's StepEvents."""

    def __init__(self, loop_core: StepLoop, on_step: Optional[Callable[[StepRecord], None]] = None):
        self.core = loop_core
        self.on_step = on_step
        self._queues: dict[str, asyncio.Queue] = {}
        self._cancelled: set[str] = set()
        self._wake = asyncio.Event()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="celeris-step")
        self._task: Optional[asyncio.Task] = None
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
        return len(self._queues)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="celeris-step-loop")

    async def stop(self) -> None:
        self.accepting = False
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # stopping must always complete
                pass
            self._task = None
        for rid in list(self._queues):
            ev = self.core.cancel(rid)
            self._deliver(rid, ev)
        self._executor.shutdown(wait=True)

    async def generate(self, seq: Sequence) -> AsyncIterator[StepEvent]:
        """Admit `seq` (raising Overloaded/Unavailable at once) and yield its snapshots.

        Leaving the iteration early (client cancel, deadline) cancels the request before the
        next step and frees its slot.
        """
        queue = self.submit(seq)
        try:
            while True:
                ev = await queue.get()
                if ev is _DONE:
                    return
                if isinstance(ev, EngineError):
                    raise ev
                yield ev
                if ev.finished:
                    return
        finally:
            self.cancel(seq.request_id)

    def submit(self, seq: Sequence) -> asyncio.Queue:
        if not self.accepting:
            raise Unavailable("server is draining; retry on another replica")
        if seq.request_id in self._queues:
            raise InvalidRequest([FieldViolation("request_id", f"{seq.request_id!r} is already running")])
        self.core.add(seq)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[seq.request_id] = queue
        self._wake.set()
        return queue

    def cancel(self, request_id: str) -> None:
        if request_id in self._queues:
            self._cancelled.add(request_id)
            self._wake.set()

    # ------------------------------------------------------------------ loop

    def _deliver(self, rid: str, ev: Optional[StepEvent]) -> None:
        queue = self._queues.get(rid)
        if queue is None:
            return
        if ev is not None:
            queue.put_nowait(ev)
        if ev is None or ev.finished:
            queue.put_nowait(_DONE)
            del self._queues[rid]

    def _fail(self, rid: str, exc: EngineError) -> None:
        queue = self._queues.pop(rid, None)
        if queue is not None:
            queue.put_nowait(exc)
            queue.put_nowait(_DONE)

    def _apply_cancellations(self) -> None:
        for rid in self._cancelled:
            self._deliver(rid, self.core.cancel(rid))
        self._cancelled.clear()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._apply_cancellations()
            if self.core.idle:
                self._wake.clear()
                await self._wake.wait()
                await asyncio.sleep(0)  # let requests that arrived together join the same step
                continue
            try:
                events, record = await loop.run_in_executor(self._executor, self.core.step)
            except Exception as exc:  # keep serving: end this batch's requests, not the loop
                log.exception("denoising step failed; ending %d request(s)", self.running)
                for seq in self.core.fail_running():
                    self._fail(seq.request_id, StepFailed(f"denoising step failed: {exc!r}"))
                continue
            self.steps += record is not None
            for ev in events:
                if ev.request_id in self._cancelled:
                    continue  # cancelled while the step ran: the cancel delivers its own last event
                self._deliver(ev.request_id, ev)
            if record is not None and self.on_step is not None:
                self.on_step(record)
            await asyncio.sleep(0)  # let handlers consume and new requests arrive between steps
