"""The loop's record of a request (no torch); the events it yields are engine/events.py's.

A `Sequence` is what the step loop keeps of a request: its ids, slot, owner, steps and finish.
Each family subclasses it with its decoding state (engine/families/sequence.py and each family's
folder); a runner reads a row's geometry and parameters from it, and the loop feeds the runner's
per-row results back through `Sequence.apply_row_later`, which commits them and returns the call
that builds the step's `StepEvent`.
"""

from __future__ import annotations

import abc
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from celeris.engine.events import FinishReason, StepEvent
from celeris.engine.sampling.params import SamplingParams

_tickets = itertools.count(1)


@dataclass
class Sequence(abc.ABC):
    """The loop's bookkeeping of one request: its ids, the slot it runs in, its owner's share, how
    many steps it ran and skipped, and how it finished. How it decodes (its canvas, schedule,
    stops) is its family's subclass (engine/families/sequence.py and each family's folder)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams  # validated, seed filled in
    # Keyword-only, so a family's subclass adds positional fields after these.
    nfe: int = field(default=0, kw_only=True)  # forwards run for it (steps, counted by the family)
    finish_reason: Optional[FinishReason] = field(default=None, kw_only=True)
    slot: int = field(default=-1, kw_only=True)  # runner row, assigned by the scheduler
    # Unique per object: request ids may be reused once one ends.
    ticket: int = field(default_factory=lambda: next(_tickets), kw_only=True)
    skipped: int = field(default=0, kw_only=True)  # steps in a row the scheduler ran without this request
    waited: float = field(default=0.0, kw_only=True)  # their cost in tokens (engine/loop/time_share.py)
    step_cost: float = field(default=0.0, kw_only=True)  # of the last step it ran in (0: none yet)
    error: Optional[Exception] = field(default=None, kw_only=True)  # why this request alone failed (`fail`)
    # The client (API key, else address) whose share of the running slots it counts against
    # (engine/loop/fair_share.py); one call's samples share it. "" = one anonymous owner.
    owner: str = field(default="", kw_only=True)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    @abc.abstractmethod
    def total_steps(self) -> int:
        """Forwards planned (the worst case where the count adapts): the scheduler's cost estimate."""

    @abc.abstractmethod
    def apply_row_later(self, r: Any) -> Callable[[], StepEvent]:
        """Apply a runner's `runner_api.RowResult` now; return the call that builds the step's event
        (the step loop calls it before the sequence changes again)."""

    @abc.abstractmethod
    def cancel(self) -> StepEvent:
        """End it as CANCELLED; its last event."""

    def fail(self, error: Exception) -> StepEvent:
        """End this request alone: its own row-level work failed (its structure, its stop strings,
        non-finite logits in its row). Its last event carries `error` for its door to raise, and
        nothing of its state (reading that may be what failed)."""
        self.error, self.finish_reason = error, FinishReason.CANCELLED
        return StepEvent(request_id=self.request_id, step=max(self.nfe - 1, 0), total_steps=0, block=0, num_blocks=0,
                         canvas=(), committed=(), confidences=(), generated=(), visible=0, settled=0, steps=self.nfe,
                         forward_passes=0, seed=0, prompt_tokens=len(self.prompt), finished=True,
                         finish_reason=FinishReason.CANCELLED, ticket=self.ticket, error=error)
