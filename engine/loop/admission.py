"""Admission rules for one call's samples, all or none: draining, duplicate ids, the total number
of open streams, one owner's (client's) share of them, and room in the step loop's queue.
`Scheduler.submit_group` asks before it admits anything."""

from __future__ import annotations

from typing import Container

from celeris.engine.errors import FieldViolation, InvalidRequest, Overloaded, Unavailable, clip
from celeris.engine.loop.step_loop import StepLoop


def check_room(core: StepLoop, ids: list[str], owner: str, accepting: bool, running_ids: Container[str],
               open_now: int, max_open: int, owned: int, max_owned: int) -> None:
    """Raise unless all `ids` (one call's samples) fit now: Unavailable while draining,
    InvalidRequest for a duplicate id or more samples than one owner may ever hold, Overloaded
    (retry later) when the places, the owner's share or the queue are full."""
    k = len(ids)
    if not accepting:
        raise Unavailable("server is draining; retry on another replica")
    dup = next((i for n, i in enumerate(ids) if i in running_ids or i in ids[:n]), None)
    if dup is not None:
        raise InvalidRequest([FieldViolation("request_id", f"{clip(dup)} is already running")])
    limit = min(max_open, max_owned)
    if k > limit:
        raise InvalidRequest([FieldViolation("n", f"{k} samples in one call; this server admits at most "
                                                  f"{limit} per client")])
    if open_now + k > max_open:
        raise Overloaded(f"too many open streams ({open_now} of {max_open}); retry later")
    if owned + k > max_owned:
        raise Overloaded(f"this client already holds {owned} of its {max_owned} places; retry later")
    # Free slots absorb waiting requests at the next step, so they count as queue room too.
    if len(core.waiting) + k > core.max_queue + len(core.free_slots):
        raise Overloaded(f"queue full ({core.max_queue} waiting, {len(core.running)} running)")
