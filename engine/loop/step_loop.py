"""The step loop: the synchronous core shared by the offline engine and the server.

Requests wait in a bounded queue, join the running batch when a slot frees, and leave it
between steps. Each step runs one forward for one group of like-length running requests
(engine/loop/batching.py), so a short request never pays for a long one's padding: `step()` is
schedule (`next_batch`), execute (`runner.step`), update (`DecodeSequence.apply`, retire).
`scheduler.Scheduler` serves one `StepLoop` to asyncio.
"""

from __future__ import annotations

import collections
import functools
import time
from dataclasses import dataclass
from typing import Callable, Optional, Union

from celeris.engine.loop import fair_share, time_share
from celeris.engine.loop.batching import Group, Picker, partition
from celeris.engine.errors import Overloaded, row_error
from celeris.engine.loop.runner_api import RowResult, StepRunner, StepStats
from celeris.engine.events import StepEvent
from celeris.engine.loop.sequence import Sequence


def apply_row(seq: Sequence, r: RowResult) -> Callable[[], StepEvent]:
    """Apply one row's result; the call that builds its event. A failure that belongs to this
    row (the runner's `RowResult.error`: its structure, non-finite logits; or applying it: its
    constraint's commit, its stop strings; or building its event) ends this request alone with
    its own error, and the other rows of the step are untouched."""
    try:
        if r.error is not None:
            raise r.error
        build = seq.apply_row_later(r)
    except Exception as exc:
        failed = seq.fail(row_error(exc))  # finished now: released with this step's finished rows
        return lambda: failed
    return functools.partial(_built, seq, build)


def _built(seq: Sequence, build: Callable[[], StepEvent]) -> StepEvent:
    try:
        return build()
    except Exception as exc:  # finished now: released at the end of the next step
        return seq.fail(row_error(exc))


@dataclass(frozen=True)
class StepRecord:
    """One executed step, for telemetry: who was in it and how it went."""

    request_ids: tuple[str, ...]
    tickets: tuple[int, ...]  # Sequence.ticket of each, same order (ids may be reused)
    stats: StepStats
    started: float  # time.time() at start
    ended: float


class StepLoop:
    def __init__(self, runner: StepRunner, max_queue: int, overhead: Optional[float] = None, max_skips: int = 16):
        self.runner = runner
        self.max_queue = max_queue
        # What one more forward costs, in tokens of padding it would save: the grouping's price.
        self.overhead = overhead if overhead is not None else runner.forward_overhead_tokens
        self.budget: Optional[int] = runner.forward_token_budget  # tokens a forward, at most
        # Skips measured in each row's own steps' cost (engine/loop/time_share.py).
        self.picker: Picker[Sequence] = Picker(self._remaining, self._skips, max_skips)
        self._costliest = 0.0  # the costliest last step of the running rows, for new rows' skips
        self.free_slots = list(range(runner.slots))
        self.running: list[Sequence] = []
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.steps = 0  # steps run
        self.forwards = 0  # model calls they made (a step makes one per kind of forward, two with CFG)
        self.preemptions = 0  # samples taken out of the batch for another owner's share

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    def add(self, seq: Sequence, bounded: bool = True) -> None:
        """Queue a request; with `bounded`, a full queue raises Overloaded at once."""
        # Free slots absorb waiting requests at the next step, so they count as capacity too.
        if bounded and len(self.waiting) >= self.max_queue + len(self.free_slots):
            raise Overloaded(f"queue full ({self.max_queue} waiting, {len(self.running)} running)")
        self.waiting.append(seq)

    def cancel(self, target: Union[Sequence, str]) -> Optional[StepEvent]:
        """Cancel a waiting or running sequence (the object, or the first with that request id)."""
        match = (lambda s: s is target) if isinstance(target, Sequence) else (lambda s: s.request_id == target)
        for seq in list(self.waiting):
            if match(seq):
                self.waiting.remove(seq)
                return seq.cancel()
        for seq in self.running:
            if match(seq):
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
        """Fill free slots, fairly across owners, preempting between steps (engine/loop/fair_share.py)."""
        if not self.waiting:
            return
        queued = list(self.waiting)  # a snapshot: the event loop may append meanwhile
        victims, admits = fair_share.plan(self.running, queued, len(self.free_slots), self.runner.slots,
                                          self.runner.resumable)
        for seq in victims:  # its canvas stays in the Sequence: loaded again, it resumes exactly
            self._release(seq)
            seq.slot = -1
        self.preemptions += len(victims)
        fair_share.requeue(self.waiting, len(queued), admits, victims)
        for seq in admits:
            seq.slot = self.free_slots.pop(0)
            self.running.append(seq)  # first: if loading raises, the failure ends it (fail_running)
            self.runner.load(seq)

    def _release(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.free_slots.append(seq.slot)
        self.free_slots.sort()
        self.runner.release(seq.slot)

    def _remaining(self, seq: Sequence) -> float:
        """Work left: steps left (the planned worst case for adaptive rules) x tokens per step."""
        return max(1, seq.total_steps - seq.nfe) * self.runner.row_tokens(seq)

    def next_batch(self) -> list[Sequence]:
        """The running requests that step now: of each kind of forward the runner will run (a KV
        cache's refresh or cached step, a block model's prefill or denoise), one group of
        like-length rows (engine/loop/batching.py). Kinds run as separate forwards of the same step
        whatever the grouping, so holding one kind back for another would only cost a step. While
        several owners run, each one's constrained rows keep to its share of the step's constraint
        work (`fair_share.within_constraint_budget`)."""
        kinds: dict[object, list[Sequence]] = {}
        for seq in self.running:
            kinds.setdefault(self.runner.forward_kind(seq), []).append(seq)
        owners = len({s.owner for s in self.running})
        self._costliest = max((s.step_cost for s in self.running), default=0.0)
        batch: list[Sequence] = []
        for rows in kinds.values():
            groups = partition(rows, self.runner.row_tokens, self.overhead)
            batch += self._within_budget(groups[0] if len(groups) == 1 else self.picker.pick(groups), owners)
        return fair_share.within_constraint_budget(batch, self.runner.row_constraint_work,
                                                   self.runner.constraint_budget, owners)

    def _skips(self, seq: Sequence) -> float:
        return time_share.skips(seq, self._costliest)

    def _within_budget(self, group: Group[Sequence], owners: int = 1) -> list[Sequence]:
        """A group's rows, at most the runner's token budget of them in one forward: a larger
        group steps those that waited longest first (round robin among its rows), so a request
        arriving beside it waits for one small forward, not one long one. While several owners
        run, each one's rows take at most its share of the budget (`time_share.owner_rows`)."""
        if self.budget is None or (owners < 2 and len(group.rows) * group.tokens <= self.budget):
            return group.rows
        k = max(1, self.budget // max(1, group.tokens))
        order = sorted(group.rows, key=lambda s: (-s.skipped, s.ticket))
        return time_share.owner_rows(order, k, owners, self.budget, group.tokens)

    def step(self) -> tuple[list[StepEvent], Optional[StepRecord]]:
        """Admit, run one batched forward + selection for the group that steps, apply results,
        retire finished requests; the step's events."""
        build, record = self.step_later()
        return [b() for b in build], record

    def step_later(self, during: Optional[Callable[[], None]] = None
                   ) -> tuple[list[Callable[[], StepEvent]], Optional[StepRecord]]:
        """`step`, with the step's events left to build: the calls that build them, valid until
        the sequences change again (the next step, a cancellation). `during` runs exactly once,
        before any sequence changes: while the device computes this step when the runner
        overlaps host work (`overlaps_host`), else before the forward. The server builds and
        hands over the previous step's events there, so they stay off the critical path."""
        self._admit()
        if not self.running:
            if during is not None:
                during()
            return [], None
        batch = self.next_batch()
        cost = self.overhead + sum(map(self.runner.row_tokens, batch))  # its rows' waits (time_share.py)
        started = time.time()
        if during is not None and self.runner.overlaps_host:
            results, stats = self.runner.step(batch, during=during)
        else:
            if during is not None:
                during()
            results, stats = self.runner.step(batch)
        self.steps += 1
        self.forwards += stats.forwards
        if len(batch) == len(self.running):  # everyone stepped (the common case)
            time_share.stepped(batch, (), cost)
        else:
            ids = set(map(id, batch))
            time_share.stepped(batch, [s for s in self.running if id(s) not in ids], cost)
        build = [apply_row(seq, r) for seq, r in zip(batch, results)]
        for seq in [s for s in self.running if s.finished]:  # a failed event build may end a row not in this batch
            self._release(seq)
        return build, StepRecord(tuple(s.request_id for s in batch), tuple(s.ticket for s in batch), stats,
                                 started, time.time())

    def run_to_completion(self, on_event: Optional[Callable[[StepEvent], None]] = None) -> None:
        while not self.idle:
            events, _ = self.step()
            if on_event:
                for ev in events:
                    on_event(ev)
