"""Per-request decoding state, in plain Python (no torch).

A `Sequence` knows where its request stands in the reverse process — block, step within the
block, how many tokens the fixed schedule commits next — and applies what the runner committed.
The scheduler owns sequences; the runner reads `StepInput` from them and the scheduler feeds
the runner's per-row results back through `Sequence.apply`, which yields a `StepEvent`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

from engine.params import SamplingParams
from engine.sampler import dream_transfer_count, transfer_schedule


class FinishReason(enum.Enum):
    LENGTH = "length"  # the canvas is full
    STOP = "stop"  # a finished block held EOS / end-of-turn
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class StepEvent:
    """Engine-level snapshot after one denoising step of one request: the raw material of streaming."""

    request_id: str
    step: int  # 0-based index of the forward pass that produced this snapshot
    block: int
    num_blocks: int
    canvas: tuple[int, ...]  # generated region, mask id where still masked
    committed: tuple[int, ...]  # positions (in the generated region) committed this step
    confidences: tuple[float, ...]  # their confidences, same order
    forward_passes: int
    finished: bool = False
    finish_reason: Optional[FinishReason] = None
    block_complete: bool = False


@dataclass
class Sequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams  # validated, seed filled in
    mask_id: int
    stop_ids: frozenset[int]
    canvas: list[int] = field(default_factory=list)
    block: int = 0
    step_in_block: int = 0
    nfe: int = 0
    finish_reason: Optional[FinishReason] = None
    slot: int = -1  # runner row, assigned by the scheduler

    def __post_init__(self) -> None:
        self.canvas = [self.mask_id] * self.params.gen_length
        self._schedule = transfer_schedule(self.params.block_length, self.params.steps_per_block)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def length(self) -> int:
        return len(self.prompt) + self.params.gen_length

    @property
    def block_start(self) -> int:
        return self.block * self.params.block_length

    @property
    def tokens_this_step(self) -> int:
        """Fixed-schedule commit count for the next step (ignored by adaptive rules)."""
        p = self.params
        if p.schedule == "dream":  # from the masks still left in the block, every step
            n_masked = self.canvas[self.block_start:self.block_start + p.block_length].count(self.mask_id)
            return dream_transfer_count(n_masked, self.step_in_block, p.steps_per_block, p.eps)
        return self._schedule[min(self.step_in_block, len(self._schedule) - 1)]  # adaptive may run past it

    def generated(self) -> list[int]:
        """Generated ids up to the first stop token (which is dropped)."""
        out = []
        for t in self.canvas:
            if t in self.stop_ids or t == self.mask_id:
                break
            out.append(t)
        return out

    def apply(self, positions: list[int], tokens: list[int], confidences: list[float]) -> StepEvent:
        """Commit the runner's picks (block-relative positions) and advance the schedule."""
        p = self.params
        committed = []
        for pos, tok in zip(positions, tokens):
            committed.append(self.block_start + pos)
            self.canvas[self.block_start + pos] = tok
        self.nfe += 1
        self.step_in_block += 1
        if p.adaptive:  # threshold / factor: a block ends when no mask is left in it
            block_done = self.mask_id not in self.canvas[self.block_start:self.block_start + p.block_length]
        else:  # the fixed schedule commits the whole block in steps_per_block steps
            block_done = self.step_in_block >= p.steps_per_block
        event_block = self.block
        if block_done:
            if p.stop_at_eos and any(t in self.stop_ids for t in self.canvas[:self.block_start + p.block_length]):
                end = self.block_start + p.block_length
                eos = min(self.stop_ids)
                self.canvas[end:] = [eos] * (p.gen_length - end)
                self.finish_reason = FinishReason.STOP
            elif self.block + 1 >= p.num_blocks:
                self.finish_reason = FinishReason.LENGTH
            else:
                self.block += 1
                self.step_in_block = 0
        return StepEvent(
            request_id=self.request_id, step=self.nfe - 1, block=event_block, num_blocks=p.num_blocks,
            canvas=tuple(self.canvas), committed=tuple(committed), confidences=tuple(confidences),
            forward_passes=self.nfe, finished=self.finished, finish_reason=self.finish_reason,
            block_complete=block_done)

    def cancel(self) -> StepEvent:
        self.finish_reason = FinishReason.CANCELLED
        return StepEvent(self.request_id, max(self.nfe - 1, 0), self.block, self.params.num_blocks,
                         tuple(self.canvas), (), (), self.nfe, True, FinishReason.CANCELLED)
