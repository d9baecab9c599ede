"""Per-request decoding state of a full-canvas request (LLaDA, Dream), in plain Python (no torch).

A `CanvasSequence` knows where its request stands in the reverse process: the block, the step
within the block, and how many tokens the fixed schedule commits next (LLaDA's schedule split
once per block, or Dream's recomputed each step from the masks left). It applies what the runner
committed and finishes when the last block is filled or a finished block holds a stop (the stop
rule, the skeleton and the event are the shared `DecodeSequence`'s, engine/families/sequence.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from celeris.engine.families.sequence import DecodeSequence
from celeris.engine.events import FinishReason, StepEvent
from celeris.engine.sampling.schedule import dream_transfer_count, transfer_schedule


@dataclass
class CanvasSequence(DecodeSequence):
    def __post_init__(self) -> None:
        self.canvas = [self.mask_id] * self.params.gen_length
        if self.constraint is not None:
            self.canvas = list(self.constraint.layout.canvas)
        self._schedule = transfer_schedule(self.params.block_length, self.params.steps_per_block)

    @property
    def block_start(self) -> int:
        return self.block * self.params.block_length

    @property
    def tokens_this_step(self) -> int:
        """Fixed-schedule commit count for the next step (ignored by adaptive rules)."""
        p = self.params
        if self.constraint is not None:  # every slot's front may commit: one token a slot a step
            return p.block_length
        if p.schedule == "dream":  # from the masks still left in the block, every step
            n_masked = self.canvas[self.block_start:self.block_start + p.block_length].count(self.mask_id)
            return dream_transfer_count(n_masked, self.step_in_block, p.steps_per_block, p.eps)
        return self._schedule[min(self.step_in_block, len(self._schedule) - 1)]  # adaptive may run past it

    @property
    def total_steps(self) -> int:
        """Steps planned: the fixed schedule runs `steps`; threshold/factor rules run each block
        until it has no masks (1 to block_length steps), so at most gen_length. `steps` on the
        last event says how many ran."""
        return self.params.gen_length if self.params.adaptive else self.params.steps

    def _apply(self, positions: list[int], tokens: list[int], confidences: list[float],
               logprobs: tuple = (), provisional: tuple = ()) -> Callable[[], StepEvent]:
        # Once per row per step, on the step's critical path (the device waits): plain locals.
        p, canvas, start = self.params, self.canvas, self.block * self.params.block_length
        provisional = tuple((start + i, t, c) for i, t, c in provisional) if provisional else ()
        committed = tuple([start + pos for pos in positions])
        for pos, tok in zip(committed, tokens):
            canvas[pos] = tok
            if self.constraint is not None:
                self.constraint.commit(pos, tok)
        if logprobs:
            self.token_logprobs.update(zip(committed, logprobs))
        self.nfe += 1
        self.step_in_block += 1
        end = start + p.block_length
        if p.adaptive or self.constraint is not None:  # threshold / factor: a block ends when no mask is left in it
            block_done = self.mask_id not in canvas[start:end]
        else:  # the fixed schedule commits the whole block in steps_per_block steps
            block_done = self.step_in_block >= p.steps_per_block
        event_block = self.block
        if block_done and not self.stops_within(end):
            if self.block + 1 >= p.num_blocks:
                self.finish_reason = FinishReason.LENGTH
            else:
                self.block += 1
                self.step_in_block = 0
        return functools.partial(self.event, committed, tuple(confidences), event_block, block_done, provisional)


__all__ = ["CanvasSequence"]
