"""The loop's record of a request, and the event contract the doors read (no torch).

A `Sequence` is what the step loop keeps of a request: its ids, slot, owner, steps and finish.
Each family subclasses it with its decoding state (engine/families/sequence.py and each family's
folder); a runner reads a row's geometry and parameters from it, and the loop feeds the runner's
per-row results back through `Sequence.apply_row_later`, which commits them and returns the call
that builds the step's `StepEvent`.
"""

from __future__ import annotations

import abc
import enum
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from celeris.engine.sampling.params import SamplingParams


class FinishReason(enum.Enum):
    LENGTH = "length"  # the canvas is full
    STOP = "stop"  # a finished block held EOS / end-of-turn
    CANCELLED = "cancelled"


_tickets = itertools.count(1)


@dataclass(frozen=True)
class StepEvent:
    """Everything a front door needs after one denoising step of one request.

    Doors read only events, never `Sequence` state, so gRPC and HTTP report the same numbers.
    """

    request_id: str
    step: int  # 0-based index of the denoising step that produced this snapshot
    total_steps: int  # steps planned (for threshold/factor: gen_length, the worst case)
    block: int
    num_blocks: int
    canvas: tuple[int, ...]  # generated region, mask id where still masked
    committed: tuple[int, ...]  # positions (in the generated region) committed this step
    confidences: tuple[float, ...]  # their confidences, same order
    generated: tuple[int, ...]  # canvas ids up to the first stop token or still-masked position
    visible: int  # canvas positions before the first stop token (masks included): what to render
    settled: int  # canvas positions that can no longer change (finished blocks)
    steps: int  # denoising steps run so far
    forward_passes: int  # model calls spent on this request so far (two per step with CFG)
    seed: int
    prompt_tokens: int
    finished: bool = False
    finish_reason: Optional[FinishReason] = None
    block_complete: bool = False
    ticket: int = 0  # which submission this is (request ids can be reused once one ends)
    kv_cache: str = "none"  # what the request decodes over: none, prefix, dual (approximate) or exact
    # With params.logprobs: (logprob, ((id, logprob), ...)) of each committed position, taken at the
    # step it was committed; `logprobs` covers every generated position, on the last event only.
    committed_logprobs: tuple = ()
    logprobs: tuple = ()
    stop_text: str = ""  # the stop string that ended the output: text is cut where it begins
    # With params.provisional: (position, token, confidence) for each position of the current
    # block the sampler ranked this step and left masked, its pick there (ascending positions).
    provisional: tuple = ()
    # The stream contract: a position is final (will never change) or provisional (may). A mask
    # model's committed positions are final (masked ones are not); a revising model's (DiffusionGemma,
    # LLaDA2.1 editing) are final only below `settled`, the rest shows its current guess.
    # Token editing (LLaDA2.1): `revised` are the positions of `committed` that replaced a token
    # written at an earlier step (not a mask), ascending.
    revised: tuple[int, ...] = ()
    revising: bool = False
    # What the door's formatter (Scheduler.submit) built from this event in the step worker thread:
    # opaque to the engine (a response message, an SSE chunk, or None for "send nothing").
    formatted: Any = None
    # Set on the last event of a request whose own row-level work failed (Sequence.fail): the
    # error its door raises instead of this event (engine/errors.py: InvalidRequest, RowFailed).
    error: Optional[Exception] = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (engine/models/prefix_cache.py)
    # Typed decisions: a choice asked with logprobs gets {option: probability} over its options
    # (summing to 1; engine/sampling/choice.py), on the last event only; None otherwise.
    choice_probabilities: Optional[dict[str, float]] = None
    # Self-speculation (Nemotron-Labs-Diffusion's linear_spec): verify passes run so far and the
    # tokens they accepted (accepted / passes: accepted tokens per verify pass); 0 otherwise.
    verify_passes: int = 0
    accepted_tokens: int = 0

    def with_formatted(self, formatted: Any) -> StepEvent:
        """This event with `formatted` set: `dataclasses.replace` without running the frozen
        `__init__` over every field again (7 us -> under 1; once per event, in the formatter thread)."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.__dict__["formatted"] = formatted
        return new

    def is_final(self, i: int, mask_id: int) -> bool:
        """Whether canvas position i will never change again (the stream contract above)."""
        return i < self.settled or (not self.revising and self.canvas[i] != mask_id)


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
