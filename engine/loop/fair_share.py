"""Fair shares of the running batch: while other clients wait, no one client (owner) keeps more
than its share of the runner's slots.

Why: admission (engine/loop/admission.py) counts a call's samples against places and a per-owner cap,
but free slots used to go first come, first served, so one call of n=16 on a 16-slot server held
every slot for all its steps while another client's 8-token request waited behind it.

The policy, applied between steps by `StepLoop._admit` (who holds what is `Sequence.owner`, the
client key `Scheduler.submit_group` was given):
- Admission: a free slot goes to the waiting sample whose owner holds the fewest running slots;
  ties go to the earliest in the queue. One owner alone (the offline engine, `celeris batch`) is
  first come, first served, as before.
- Preemption: with O owners running or waiting, an owner's share is max(1, slots // O). While an
  owner that waits holds fewer than its share and no slot is free, the owner holding the most
  above its share gives slots up: its least advanced samples (fewest steps taken; of those, the
  last admitted) leave the batch between steps and go back to the head of the queue, to be
  admitted again (into any slot) when their owner is the one holding fewest. Nothing is lost: a
  sample's canvas lives in its Sequence, and the runner writes it back on load.
- Only a runner that resumes exactly preempts: `resumable(seq)` says whether loading `seq` into a
  slot afresh continues it token for token. The full-canvas runner can at any step without a KV
  cache and at block boundaries with one (the block's first step rewrites the cache); the
  simulated runner always. The block (SDAR, LLaDA2) and revise (DiffusionGemma) runners keep
  per-slot caches that a reload would recompute with different rounding, so they never preempt:
  there an owner's further samples wait (admission above) but running ones keep their slots.
- Constraint work (`within_constraint_budget`, applied by `StepLoop.next_batch` to the rows that
  step): a structured row's token masks are host work its step waits for, and so does every row
  sharing the step. With O owners running, an owner's constrained rows spend at most its share,
  max(1, budget // O), of the runner's `constraint_budget` units a step (one row at least, so it
  always progresses); its other constrained rows wait for a later step, those that waited longest
  first, exactly as rows over the forward's token budget do. Unconstrained rows and one owner
  alone are never held back.
Token identity: a sample's draws are keyed by its seed, its step count and the canvas position
(engine/sampling/select.py), and its logits do not depend on its batch or slot, so when it ran, how long
it waited and how often it was preempted change none of its tokens.
Worst case (docs/limits.md): with a resumable runner a waiting owner below its share gets a slot
at the next step, or at the next block boundary of the sample it displaces when KV caching.
"""

from __future__ import annotations

import collections
import operator
from typing import Callable, Optional

from celeris.engine.loop.sequence import Sequence

Resumable = Callable[[Sequence], bool]
_owner = operator.attrgetter("owner")


def share(slots: int, owners: int) -> int:
    """The running slots one of `owners` owners may keep while another waits below it."""
    return max(1, slots // max(1, owners))


def plan(running: list[Sequence], waiting: list[Sequence], free: int, slots: int,
         resumable: Optional[Resumable]) -> tuple[list[Sequence], list[Sequence]]:
    """(samples to preempt now, samples to admit now in admission order) for a step loop whose
    `running` samples hold slots, `free` slots are free and `waiting` is the queue, oldest first.
    Runs every step: one owner (`celeris batch`, 4,096 queued) costs two C-speed passes."""
    if not waiting or (not free and resumable is None):
        return [], []
    held = collections.Counter(map(_owner, running))
    wanted = collections.Counter(map(_owner, waiting))
    if len(wanted.keys() | held.keys()) < 2:
        return [], waiting[:free]  # one owner: first come, first served
    victims = _victims(running, held, wanted, free, slots, resumable) if resumable is not None else []
    room = free + len(victims)
    if not room:
        return [], []
    # Each owner's first `room` waiting samples with their queue positions (ties go to the older).
    queued: dict[str, collections.deque[tuple[int, Sequence]]] = {o: collections.deque() for o in wanted}
    full = 0
    for pos, s in enumerate(waiting):
        q = queued[s.owner]
        if len(q) < room:
            q.append((pos, s))
            full += len(q) == room
            if full == len(queued):
                break
    for pos, v in enumerate(reversed(victims), start=1):  # back at the head of their owner's queue
        held[v.owner] -= 1
        queued.setdefault(v.owner, collections.deque()).appendleft((-pos, v))
    admits: list[Sequence] = []
    for _ in range(room):
        heads = [(held[o], q[0][0], o) for o, q in queued.items() if q]
        if not heads:
            break
        _, _, owner = min(heads)
        admits.append(queued[owner].popleft()[1])
        held[owner] += 1
    return victims, admits


def _victims(running: list[Sequence], held: collections.Counter, wanted: collections.Counter, free: int,
             slots: int, resume: Resumable) -> list[Sequence]:
    """The samples to preempt so that every waiting owner below its share reaches it."""
    fair = share(slots, len(wanted.keys() | held.keys()))
    owed = sum(min(n, fair - held[o]) for o, n in wanted.items() if held[o] < fair) - free
    if owed <= 0:
        return []
    # Per owner above its share, its resumable samples: least advanced first, the last admitted
    # first among equals (`running` is in admission order and the sort is stable).
    candidates: dict[str, list[Sequence]] = {}
    for s in reversed(running):
        if held[s.owner] > fair and resume(s):
            candidates.setdefault(s.owner, []).append(s)
    for rows in candidates.values():
        rows.sort(key=lambda s: s.nfe)
    left, victims = dict(held), []
    while owed > 0:
        over = [o for o, rows in candidates.items() if rows and left[o] > fair]
        if not over:
            break  # the rest wait for a block boundary or a sample's end
        owner = max(over, key=lambda o: left[o])
        victims.append(candidates[owner].pop(0))
        left[owner] -= 1
        owed -= 1
    return victims


def within_constraint_budget(rows: list[Sequence], work: Callable[[Sequence], int], budget: Optional[int],
                             owners: int) -> list[Sequence]:
    """`rows` (a step's batch, in order) less the constrained rows (`work(row)` > 0 units) past
    their owner's share of `budget` while `owners` (> 1) run; the rest keep their order. Per owner
    its constrained rows that waited longest (`Sequence.skipped`, then the oldest ticket) go
    first, while their units fit its share; the first always does."""
    if budget is None or owners < 2:
        return rows
    cost = {id(s): work(s) for s in rows}
    if not any(cost.values()):
        return rows
    fair = share(budget, owners)
    spent: collections.Counter = collections.Counter()
    held: set[int] = set()
    for s in sorted((s for s in rows if cost[id(s)]), key=lambda s: (-s.skipped, s.ticket)):
        if spent[s.owner] and spent[s.owner] + cost[id(s)] > fair:
            held.add(id(s))
        else:
            spent[s.owner] += cost[id(s)]
    return [s for s in rows if id(s) not in held]


def requeue(waiting: collections.deque, seen: int, admits: list[Sequence], victims: list[Sequence]) -> None:
    """Take `admits` out of `waiting`, whose first `seen` entries were the snapshot `plan` read,
    and put the `victims` not admitted back at its head. The event loop appends to `waiting`
    while this runs (StepLoop.add): popleft and extendleft are atomic, iterating it is not."""
    if not victims and all(waiting[i] is s for i, s in enumerate(admits)):
        for _ in admits:  # the common case: first come, first served
            waiting.popleft()
        return
    head = [waiting.popleft() for _ in range(seen)]
    taken = set(map(id, admits))
    keep = [s for s in victims + head if id(s) not in taken]
    waiting.extendleft(reversed(keep))


__all__ = ["plan", "requeue", "share", "within_constraint_budget"]
