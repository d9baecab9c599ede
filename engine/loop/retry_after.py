"""How long a refused caller should wait before trying again: an estimate from the queue.

A constant delay (every refusal said 1.0 s) sends a burst of refused clients back together, in
waves, before anything has changed. Instead the server says when the call would have started
had it been queued behind what is there now: the running requests finish after their remaining
steps, each freed slot takes the next waiting request for its planned steps, and the call's own
samples start once every waiting one has. That many steps times the recent seconds per step,
clamped to [FLOOR_S, CEILING_S]. The estimate is deterministic; the door adds the jitter
(server/errors.py), so callers refused together come back spread out.

Steps are the planned worst case (threshold and factor rules may finish sooner) and a step may
serve only one group of rows (engine/loop/batching.py), so this is an estimate, not a promise.
"""

from __future__ import annotations

import heapq
from typing import Iterable, Optional

from celeris.engine.loop.step_loop import StepLoop, StepRecord

FLOOR_S = 0.1  # below this a retry is a busy loop
CEILING_S = 30.0  # beyond this the estimate is a guess; clients give up past their own limit
DEFAULT_STEP_S = 0.05  # until a step has been timed
SMOOTHING = 0.2  # weight of the newest step in the moving average
BACK_TO_BACK_S = 1.0  # a step starting this soon after the last one counts the gap as its own


def steps_until_start(running_left: Iterable[int], waiting_steps: Iterable[int], slots: int, need: int) -> int:
    """Steps until `need` more requests could start, after every waiting one (in order): each
    running request frees its slot after its steps left, each waiting one then holds a slot
    for its planned steps. A free slot (fewer running than `slots`) is free at step 0."""
    finish = list(running_left)
    finish += [0] * max(0, slots - len(finish))
    heapq.heapify(finish)
    t = 0
    for steps in waiting_steps:  # each waiting request takes the earliest free slot
        t = heapq.heappop(finish)
        heapq.heappush(finish, t + max(1, steps))
    for _ in range(need):  # then the caller's own samples, one slot each
        t = heapq.heappop(finish) if finish else t
    return t


class RetryEstimate:
    """Seconds a refused caller should wait; `observe` each step so the pace stays recent."""

    def __init__(self, default_step_s: float = DEFAULT_STEP_S, floor_s: float = FLOOR_S,
                 ceiling_s: float = CEILING_S):
        self.step_s = default_step_s
        self.floor_s, self.ceiling_s = floor_s, ceiling_s
        self._timed = False
        self._last_end: Optional[float] = None

    def observe(self, record: StepRecord) -> None:
        """Fold one executed step into the moving average of seconds per step. Back-to-back
        steps count from the previous step's end: the pace a queued request sees includes the
        host work between forwards."""
        start = record.started
        if self._last_end is not None and 0 <= record.started - self._last_end < BACK_TO_BACK_S:
            start = self._last_end
        self._last_end = record.ended
        seconds = max(0.0, record.ended - start)
        self.step_s = seconds if not self._timed else (1 - SMOOTHING) * self.step_s + SMOOTHING * seconds
        self._timed = True

    def seconds(self, core: StepLoop, need: int = 1) -> float:
        """The wait for `need` places (one call's samples) behind `core`'s running and waiting requests."""
        # Copies first: the step worker admits and retires between our reads (a C-level copy
        # of a list or deque is one step under the GIL, iterating it is not).
        running, waiting = list(core.running), tuple(core.waiting)
        left = [max(1, s.total_steps - s.nfe) for s in running]
        queued = [max(1, s.total_steps) for s in waiting]
        steps = steps_until_start(left, queued, core.runner.slots, max(1, need))
        return min(self.ceiling_s, max(self.floor_s, steps * self.step_s))
