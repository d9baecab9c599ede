"""The records the engine hands its doors: one request's step event, how it finished, and a
canvas delta (ground floor: no torch, no loop, nothing a door must not see).

`StepEvent` is the event contract. The step loop builds one per request per step (each family's
sequence, engine/families/), a door reads only events, never a request's decoding state, so gRPC
and HTTP report the same numbers. `CanvasDelta` is what changed on one canvas between the events a
door sends (built by engine/detok.py's `CanvasDeltas`): gRPC maps it to a GenerateResponse, HTTP to
an SSE object.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional


class FinishReason(enum.Enum):
    LENGTH = "length"  # the canvas is full
    STOP = "stop"  # a finished block held EOS / end-of-turn
    CANCELLED = "cancelled"


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


@dataclass(frozen=True)
class Cell:
    """One canvas position as a delta reports it."""

    position: int
    id: int
    text: str  # the token's own text (the mask marker where masked)
    masked: bool
    final: bool  # it will never change again (StepEvent.is_final)
    piece: Optional[str] = None  # its share of the canvas text, only where that differs from `text`


@dataclass(frozen=True)
class Guess:
    """The sampler's pick at a position of the current block it left masked (StepEvent.provisional)."""

    position: int
    id: int
    text: str
    confidence: float


@dataclass(frozen=True)
class CanvasDelta:
    """What changed on one request's canvas since the previous delta: the record both doors map."""

    cells: tuple[Cell, ...]  # ascending: every position whose id, piece or final flag changed
    committed: tuple[int, ...]  # positions committed since the previous delta, ascending
    confidences: tuple[float, ...]  # theirs, same order
    visible: int  # positions before the first stop token: the text is the pieces of [0, visible)
    settled: int  # positions [0, settled) are final (StepEvent.settled)
    masked: int  # positions still masked
    provisional: tuple[Guess, ...] = ()


__all__ = ["CanvasDelta", "Cell", "FinishReason", "Guess", "StepEvent"]
