"""Per-request state of a revising model's request (DiffusionGemma), as the step loop sees it, in
plain Python; the model side (cache, canvas tensors, random stream) is the runner's
(`revise_runner.ReviseRunner`, one `revise_sequence.SlotState` per slot).

The output is whole canvases (`gen_length` is a multiple of the canvas length, as transformers
writes them): positions of committed canvases are final; every position of the canvas being
denoised shows its current argmax and may change at the next step; positions of canvases not
started yet hold the mask id (no vocabulary token), so they render as the mask marker. Each
step's event lists, as `committed`, the positions written that step (changed, or made final).
Stop strings are looked for in final text only, each time a canvas is committed: one found ends
the request there (the step loop then releases its slot, and the runner drops its cache).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from celeris.engine.families.sequence import DecodeSequence
from celeris.engine.events import FinishReason, StepEvent
from celeris.engine.tokenizer import stop_cut


@dataclass
class RevisingSequence(DecodeSequence):
    final_length: int = 0  # output positions that can no longer change (committed canvases)
    revising: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self.canvas = [self.mask_id] * self.params.gen_length
        self.skeleton_shown = True  # a structure's fixed tokens show as each canvas starts, not up front

    @property
    def total_steps(self) -> int:
        """The worst case: every canvas runs out of steps."""
        return self.params.num_blocks * self.params.max_denoising_steps

    @property
    def tokens_this_step(self) -> int:
        return self.params.block_length

    def _view(self, block: int, block_complete: bool) -> tuple[tuple[int, ...], int, int]:
        settled = self.params.gen_length if self.finished else self.final_length
        return tuple(self.canvas), self.params.num_blocks, settled

    def apply_row_later(self, r: Any) -> Callable[[], StepEvent]:
        """A `runner_api.RowResult` of the revise runner: positions (output offsets) written this
        step and their tokens, `final` the output positions now final, `done` the request's end.
        Returns the call that builds the step's event (`Sequence.apply_row_later`)."""
        for pos, tok in zip(r.positions, r.tokens):
            self.canvas[pos] = tok
        if r.choices:
            self.choice_scores = r.choices  # a choice's option probabilities (slots.py scores them)
        self.token_logprobs.update(zip(r.positions, r.logprobs))  # a committed canvas's, when asked
        self.nfe += 1
        block, complete = self.block, r.final > self.final_length
        self.final_length = r.final
        if complete and self.block + 1 < self.params.num_blocks:
            self.block += 1
        if (complete or r.done) and self.find_stop_text is not None:
            self.stops_within(self.final_length)  # a stop string in the final text ends it here
        if r.done and not self.finished:
            head = self.canvas[:self.final_length]
            stopped = stop_cut(head, self.stop_ids) < len(head)
            self.finish_reason = FinishReason.STOP if stopped else FinishReason.LENGTH
        return functools.partial(self.event, tuple(r.positions), tuple(r.confidences), block, complete)
