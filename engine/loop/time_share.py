"""Shares of the step time: a row's wait is measured in its own steps' cost, not in steps, and while
several clients (owners) run, each one's rows take at most its share of a forward's token budget.

Why: rows of very different lengths step in separate forwards, one group a step
(engine/loop/batching.py), chosen by least work left, with a bound on how long a group may be
skipped. That bound counted steps, and a step is not a unit of time: one client's n=16 tool call
over a 350-token prompt stepped five rows of 348 tokens a forward (2-5 s on a 2-core CPU) while
another client's 16-token completion took 0.1-0.3 s a step, and the long group, skipped 16 short
steps, ran again after some 3 s: several times in the short request's life, which took 4-5x its
time alone (issue 60 item 5). So:

- `skips` counts the skips of a row as the cost of the steps it sat out over the cost of its own
  last step, a step's cost being what the grouping prices a forward at: the loop's overhead plus
  its rows' tokens (`StepRunner.row_tokens`; on the CPU a forward's time follows its tokens). A row
  of 1,740-token steps has waited "one step" after some 1,740 tokens of others' steps, a row of
  20-token steps after one of them. With steps of one size it is the count, as before; a new row
  takes the costliest running row's last step as its own. An estimate, not the clock: the same
  requests are scheduled alike on a loaded machine and a quiet one (and in tests). The picker's
  bound (`max_skips`) now says: a long group keeps at least 1 / (max_skips + 1) of the loop's
  work while short ones keep coming, and short rows wait at most max_skips of their own steps'
  cost behind long ones.
- `owner_rows`: while O > 1 owners run, one forward takes at most max(1, budget // O // tokens)
  rows of an owner (the forward's token budget, `StepRunner.forward_token_budget`, shared like
  the running slots are, engine/loop/fair_share.py): the step another client waits on when it
  arrives is at most about its share of the budget long.
Token identity: which step a row joins never changes its tokens (engine/loop/fair_share.py).
"""

from __future__ import annotations

import collections
from typing import Sequence as Seq

from celeris.engine.loop.sequence import Sequence


def skips(s: Sequence, costliest: float) -> float:
    """How long `s` has been skipped, in its own steps: the cost of the steps it sat out over its
    last step's. A row that has not run yet takes the `costliest` last step of the running rows
    as its own (a new row of a long group waits as its group does, not by the count of short
    steps); the count of steps when no row has run."""
    own = s.step_cost or costliest
    return s.waited / own if own > 0 else s.skipped


def stepped(rows: Seq[Sequence], skipped: Seq[Sequence], cost: float) -> None:
    """A step of `cost` ran `rows` without the running rows `skipped`: the rows' waits end and
    their step's cost is remembered; the others' waits grow by it."""
    for s in rows:
        s.skipped, s.waited, s.step_cost = 0, 0.0, cost
    for s in skipped:
        s.skipped += 1
        s.waited += cost


def owner_rows(rows: Seq[Sequence], k: int, owners: int, budget: int, tokens: int) -> list[Sequence]:
    """The first `k` of `rows` (ordered longest waiting first), each owner at most its share of the
    forward's token `budget`, budget // owners, in rows of `tokens` (one row at least) while
    `owners` > 1 run."""
    if owners < 2:
        return list(rows[:k])
    cap = max(1, budget // owners // max(1, tokens))
    taken: collections.Counter = collections.Counter()
    out = []
    for s in rows:
        if len(out) == k:
            break
        if taken[s.owner] < cap:
            taken[s.owner] += 1
            out.append(s)
    return out


__all__ = ["owner_rows", "skips", "stepped"]
