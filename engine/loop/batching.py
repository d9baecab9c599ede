"""Which running requests share a forward, and which forward runs next: no head-of-line padding.

One padded forward over every running request makes a 16-token request pay for a 1024-token
neighbour at every step. Instead, each step:

1. `partition` groups the running rows by the tokens their next forward computes, choosing
   the grouping of least estimated cost: a forward costs `overhead` token-equivalents (launch,
   Python, the host sync) plus rows x the longest row's tokens (padding included). Rows of like
   length share one forward; a short row joins a long one only when a separate forward would
   cost more than the padding.
2. `pick` chooses the one group that steps: the group holding the request with the least work
   left (steps left x its tokens per step: shortest remaining processing time, which minimises
   mean latency) — so a short request is not kept behind a long one, and a new short request
   starts at once. A group skipped `max_skips` ticks in a row runs next whatever its work, so a
   long request keeps at least 1 / (max_skips + 1) of the forwards while short ones keep coming.
   The step loop counts a row's ticks in its own steps' cost (engine/loop/time_share.py), so
   that share is of the loop's work, and a short row waits behind a long one at most max_skips
   of its own steps' cost.

With a single group (the common case: similar lengths) this is exactly one batched forward per
step of every running request. Plain Python, no torch: the scheduler owns it, the runner only
estimates a row's tokens (`Runner.row_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, Sequence, TypeVar

T = TypeVar("T")


@dataclass
class Group(Generic[T]):
    rows: list[T]
    tokens: int  # the longest row's tokens: what every row of the forward is padded to

    def cost(self, overhead: float) -> float:
        return overhead + len(self.rows) * self.tokens


def partition(rows: Sequence[T], tokens: Callable[[T], int], overhead: float) -> list[Group[T]]:
    """Contiguous groups of the rows sorted by tokens, of least total cost (exact).

    Only cuts between different sizes are tried: a cut between equal sizes never pays (moving
    the row after it into the group before keeps that group's padding and leaves the next one
    no longer), so the search is O(m^2) in the m distinct sizes, and one size (the common case)
    is one group with no search at all. Nor is there one when the padding of a single group costs
    at most one forward's overhead: any split costs at least two overheads plus every row's own
    tokens, so one group is then the search's answer too (it keeps the first grouping on a tie).
    That is most steps on a GPU (an overhead of 4,096 tokens), on the step's critical path."""
    estimates = [tokens(r) for r in rows]  # each row's, once
    if not estimates:
        return []
    top = max(estimates)
    if min(estimates) == top:  # one size: one group, in the rows' order (no sort)
        return [Group(list(rows), top)]
    sized = sorted(zip(estimates, range(len(rows))))
    order = [rows[i] for _, i in sized]
    if len(rows) * top - sum(estimates) <= overhead:
        return [Group(order, top)]
    ends, sizes = [], []  # run k: order[ends[k-1]:ends[k]], all of size sizes[k]
    for j, (t, _) in enumerate(sized):
        if sizes and sizes[-1] == t:
            ends[-1] = j + 1
        else:
            ends.append(j + 1)
            sizes.append(t)
    m = len(sizes)
    starts = [0] + ends[:-1]
    best = [0.0] + [float("inf")] * m  # best[k]: cheapest grouping of the first k runs
    cut = [0] * (m + 1)
    for k in range(1, m + 1):
        for i in range(k):  # the last group is runs i..k-1, padded to sizes[k - 1]
            c = best[i] + overhead + (ends[k - 1] - starts[i]) * sizes[k - 1]
            if c < best[k]:
                best[k], cut[k] = c, i
    groups: list[Group[T]] = []
    k = m
    while k > 0:
        i = cut[k]
        groups.append(Group(order[starts[i]:ends[k - 1]], sizes[k - 1]))
        k = i
    return groups[::-1]


class Picker(Generic[T]):
    """Shortest-remaining-work choice among groups, with a starvation bound."""

    def __init__(self, remaining: Callable[[T], float], skipped: Callable[[T], float], max_skips: int = 16):
        self.remaining, self.skipped, self.max_skips = remaining, skipped, max_skips

    def pick(self, groups: Sequence[Group[T]]) -> Group[T]:
        starved = [g for g in groups if max(self.skipped(r) for r in g.rows) >= self.max_skips]
        if starved:
            return max(starved, key=lambda g: max(self.skipped(r) for r in g.rows))
        return min(groups, key=lambda g: (min(self.remaining(r) for r in g.rows), g.tokens))
