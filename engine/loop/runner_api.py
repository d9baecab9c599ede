"""The contract between the step loop and a runner, and the records that cross it.

A runner owns the device state of every slot (canvases, caches) and runs one batched step:
`StepLoop` hands it the rows that step and gets one `RowResult` per row back, plus the step's
`StepStats`. `StepRunner` is the base class of every runner: each family folder's
(families/canvas, block, revise, through `ConfigCosts`) and `sim_runner.SimulatedRunner`, which
fakes one for benchmarks. How a runner selects its tokens is its
family's (the mask families share engine/families/selection.py): the loop only reads the rows'
results.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence as Seq

from celeris.engine.loop.sequence import Sequence


@dataclass(frozen=True)
class RowResult:
    """What one request got from one step: block-relative positions, tokens, confidences, and
    (when asked) each token's log-probability with its top alternatives ((id, logprob), ...)."""

    positions: list[int]
    tokens: list[int]
    confidences: list[float]
    logprobs: tuple = ()  # per position: (logprob, ((id, logprob), ...))
    # With params.provisional: (position, token, confidence) of every candidate left masked.
    provisional: tuple = ()
    # Revising families (revise_runner.py): `positions` are output offsets written this step,
    # `final` how many output positions are now final, `done` whether the request ended.
    final: int = 0
    done: bool = False
    # This row's own part of the step failed (its structure, non-finite logits): it committed
    # nothing and its request ends with this error (step_loop.apply_row); the batch steps on.
    error: Optional[Exception] = None
    # Typed decisions: with a choice's probabilities asked for, the step that scored its options
    # carries one probability per option, in the choice's order (engine/sampling/choice.py).
    choices: tuple = ()


EMPTY = RowResult([], [], [])


@dataclass(frozen=True)
class StepStats:
    batch: int  # requests served
    bucket_batch: int
    bucket_length: int
    window: int
    committed: int
    seconds: float
    cuda_graph: bool = False
    forwards: int = 1  # model calls this step (more than one when cache refresh groups differ)


class StepRunner(abc.ABC):
    """What `StepLoop` needs of a runner: four methods every runner writes, its `slots` and
    `forward_overhead_tokens`, and six optional members whose defaults are here (a runner
    overrides those it has; the loop reads them all, never probing)."""

    slots: int  # rows of device state: at most this many requests run at once
    # What one more forward costs, in tokens of padding it would save (the grouping's price).
    forward_overhead_tokens: int
    # The most tokens one forward may compute (rows x padded length); a larger group steps part
    # of its rows (StepLoop.next_batch). None: no bound.
    forward_token_budget: Optional[int] = None
    # Whether `step` takes `during` (below): a runner that queues its device work and waits later.
    overlaps_host: bool = False
    # `resumable(seq) -> bool`: whether `load(seq)` into any slot, where its canvas stands,
    # continues `seq` token for token; only such a runner preempts samples for another client's
    # share of the slots (engine/loop/fair_share.py). None: this runner never preempts (and the
    # fair share skips looking for samples to preempt).
    resumable: Optional[Callable[[Sequence], bool]] = None
    # The most units of host constraint work (`row_constraint_work`) one step computes while
    # several owners run; each owner's share of it is `fair_share.share` (engine/loop/fair_share.py).
    # None: no bound.
    constraint_budget: Optional[int] = None

    def row_constraint_work(self, seq: Sequence) -> int:
        """Units of host work this row's next step spends on its constraint (structured outputs:
        one unit a round of its token masks); 0, the default, for a row with none."""
        return 0

    @abc.abstractmethod
    def row_tokens(self, seq: Sequence) -> int:
        """Columns this row's next forward computes: the scheduler's cost estimate."""

    @abc.abstractmethod
    def forward_kind(self, seq: Sequence) -> object:
        """Which of the step's forwards this row joins; rows of different kinds never share one."""

    @abc.abstractmethod
    def load(self, seq: Sequence) -> None:
        """Write a newly admitted request into its slot."""

    @abc.abstractmethod
    def step(self, seqs: Seq[Sequence], during: Optional[Callable[[], None]] = None
             ) -> tuple[list[RowResult], StepStats]:
        """One denoising step for every row: results in the same order. A runner whose
        `overlaps_host` is true is given `during`, a callable it runs exactly once, after the
        step's device work is queued and before the host waits for its results (host work
        that overlaps the device's; `StepLoop.step_later`); the others are called without it."""

    def release(self, slot: int) -> None:
        """Called on the step thread when a request leaves its slot (finished, cancelled, failed).
        Nothing by default: slot rows are preallocated and the next `load` overwrites them; a
        runner holding per-request state elsewhere frees it here (the revise runner's caches)."""


class ConfigCosts(StepRunner):
    """A runner whose cost knobs are read from its EngineConfig (`self.config`): what one more
    forward costs in tokens, the most tokens one forward may compute, and the constraint work a
    step may do while several owners run."""

    config: Any

    @property
    def forward_overhead_tokens(self) -> int:
        return self.config.overhead_tokens

    @property
    def forward_token_budget(self) -> Optional[int]:
        return self.config.forward_token_budget

    @property
    def constraint_budget(self) -> Optional[int]:
        return self.config.constraint_budget or None


def read_queued(reads: list[tuple[Seq[int], Callable[[], list[RowResult]]]], n: int,
                during: Optional[Callable[[], None]]) -> tuple[list[RowResult], int]:
    """A step's results once every group's device work is queued: `during` first (host work
    beside the device's), then each group's read (the host's wait; the mask families':
    `selection.row_results`) into the rows it holds, of n. -> (results by row, tokens committed)."""
    if during is not None:
        during()
    results, committed = [EMPTY] * n, 0
    for rows, read in reads:
        for i, r in zip(rows, read()):
            results[i] = r
            committed += len(r.positions)
    return results, committed
