"""What every family's request state shares, in plain Python (no torch).

`DecodeSequence` is the loop's `Sequence` (ids, slot, owner, finish, error) with an output canvas:
its mask and stop ids, stop strings, a structured output's skeleton and the constraint that
commits into it, logprobs, a choice's scores, and the `StepEvent` the doors read, built from
them. How a step's picks are committed and when a block ends is each family's
(canvas/sequence.py, block/sequence.py, revise/sequence.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from celeris.engine.events import FinishReason, StepEvent
from celeris.engine.loop.sequence import Sequence
from celeris.engine.tokenizer import stop_cut


@dataclass
class DecodeSequence(Sequence):
    mask_id: int
    stop_ids: frozenset[int]
    canvas: list[int] = field(default_factory=list)
    block: int = 0
    step_in_block: int = 0
    token_logprobs: dict = field(default_factory=dict)  # canvas position -> (logprob, top alternatives)
    # With stop strings: ids -> (prefix length whose text first holds one, the string) or None.
    find_stop_text: Optional[Callable[[list[int]], Optional[tuple[int, str]]]] = field(default=None, repr=False)
    stop_len: Optional[int] = None  # generated ids kept after a stop string (through its last token)
    stop_text: str = ""  # the stop string that ended the output
    # Structured outputs (engine/structured): the skeleton is on the canvas from the start, and
    # each step only the slots' fronts may commit, under their token masks.
    constraint: Any = field(default=None, repr=False)
    skeleton_shown: bool = False  # the first event reports the skeleton's positions as committed
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (block families)
    # A choice's option probabilities, once the runner scored them (RowResult.choices), in its order.
    choice_scores: tuple = ()

    @property
    def length(self) -> int:
        """Positions the runner holds: the prompt, then the output canvas (block families align
        theirs to whole blocks)."""
        return len(self.prompt) + self.params.gen_length

    @property
    def first_window(self) -> int:
        """Output positions [0, n) the forward that decodes output position 0 sees: its block."""
        return self.params.block_length

    @property
    def revising(self) -> bool:
        """Whether a committed token may still be replaced before it is settled (token editing)."""
        return False

    @property
    def forward_passes(self) -> int:
        """Model calls spent on this request: one per step, two with classifier-free guidance."""
        return self.nfe * (2 if self.params.cfg_scale > 0 else 1)

    @property
    def output(self) -> list[int]:
        """The canvas positions that are the request's output (block models decode past them)."""
        return self.canvas

    def generated(self) -> list[int]:
        """The output up to the first stop token (dropped) or through the token that completed a
        stop string: the one rule for what was generated."""
        ids = self.output
        return ids[:stop_cut(ids, self.stop_ids, self.mask_id)][:self.stop_len]

    def generated_logprobs(self, n: int) -> tuple:
        """(logprob, top alternatives) of the first n generated positions; () unless asked."""
        lp = self.token_logprobs
        return tuple(lp.get(i, (0.0, ())) for i in range(n)) if lp else ()

    @property
    def kv_cache(self) -> str:
        return self.params.kv_cache or "none"

    def _view(self, block: int, block_complete: bool) -> tuple[tuple[int, ...], int, int]:
        """(output canvas, number of blocks, positions settled) as the doors see them."""
        p = self.params
        if self.finished:
            settled = p.gen_length
        else:
            settled = (block + 1) * p.block_length if block_complete else block * p.block_length
        return tuple(self.canvas), p.num_blocks, settled

    def event(self, committed: tuple[int, ...] = (), confidences: tuple[float, ...] = (),
              block: Optional[int] = None, block_complete: bool = False, provisional: tuple = (),
              revised: tuple[int, ...] = ()) -> StepEvent:
        """The step event of the current state (computed once per request per step)."""
        p = self.params
        block = self.block if block is None else block
        if self.constraint is not None and not self.skeleton_shown:  # streams show it from the first message
            committed, confidences = self._with_skeleton(committed, confidences)
        canvas, num_blocks, settled = self._view(block, block_complete)
        stop = stop_cut(canvas, self.stop_ids)  # one scan for both cuts (`generated` adds the mask's)
        try:
            cut = canvas.index(self.mask_id, 0, stop)
        except ValueError:
            cut = stop
        generated = canvas[:cut][:self.stop_len]
        lp = self.token_logprobs
        committed_lp = tuple(lp[c] for c in committed if c in lp) if lp else ()
        all_lp = self.generated_logprobs(len(generated)) if self.finished else ()
        return StepEvent(
            request_id=self.request_id, step=max(self.nfe - 1, 0), total_steps=self.total_steps, block=block,
            num_blocks=num_blocks, canvas=canvas, committed=committed, confidences=confidences,
            generated=generated, visible=min(stop, len(canvas) if self.stop_len is None else self.stop_len),
            settled=settled, steps=self.nfe,
            forward_passes=self.forward_passes, seed=p.seed or 0, prompt_tokens=len(self.prompt),
            finished=self.finished, finish_reason=self.finish_reason, block_complete=block_complete,
            ticket=self.ticket, kv_cache=self.kv_cache, committed_logprobs=committed_lp, logprobs=all_lp,
            stop_text=self.stop_text, provisional=() if self.finished else provisional, revised=revised,
            revising=self.revising, cached_tokens=self.cached_tokens,
            choice_probabilities=self.choice_probabilities() if self.finished else None)

    def choice_probabilities(self) -> Optional[dict[str, float]]:
        """{option: probability} of a scored choice (an option listed twice: their sum), else None."""
        if not self.choice_scores:
            return None
        out: dict[str, float] = {}
        for (text, _), p in zip(self.constraint.layout.choices, self.choice_scores):
            out[text] = out.get(text, 0.0) + p
        return out

    def _with_skeleton(self, committed: tuple, confidences: tuple) -> tuple[tuple, tuple]:
        """`committed` with the structure's fixed positions (confidence 1), by position."""
        self.skeleton_shown = True
        fixed = [(i, 1.0) for i, t in enumerate(self.constraint.layout.canvas) if t != self.mask_id]
        pairs = sorted(fixed + [pc for pc in zip(committed, confidences) if pc[0] >= len(self.constraint.layout.canvas)
                                or self.constraint.layout.canvas[pc[0]] == self.mask_id])
        return tuple(p for p, _ in pairs), tuple(c for _, c in pairs)

    def apply_row_later(self, r: Any) -> Callable[[], StepEvent]:
        """Apply a runner's `runner_api.RowResult` now; the returned call builds the step's event
        from the state this left (the step loop's one call). Call it before the sequence changes
        again (its next step, a cancel): the server builds events while the next step runs on
        the device, off the step's critical path."""
        if r.choices:
            self.choice_scores = r.choices
        return self._apply(r.positions, r.tokens, r.confidences, r.logprobs, r.provisional)

    def apply(self, positions: list[int], tokens: list[int], confidences: list[float],
              logprobs: tuple = (), provisional: tuple = ()) -> StepEvent:
        """Commit the runner's picks (block-relative positions), advance, return the event."""
        return self._apply(positions, tokens, confidences, logprobs, provisional)()

    def _apply(self, positions: list[int], tokens: list[int], confidences: list[float],
               logprobs: tuple = (), provisional: tuple = ()) -> Callable[[], StepEvent]:
        """The family's commit rule: write the picks, advance its schedule, return the event's call."""
        raise NotImplementedError(f"{type(self).__name__} commits through apply_row_later")

    def stops_within(self, end: int) -> bool:
        """After a block ending at canvas index `end`: finish (STOP) if what is generated so far
        holds a stop token or a stop string; the rest of the canvas is filled with a stop id."""
        if not self.params.stop_at_eos:
            return False
        head = self.canvas[:end]
        n = stop_cut(head, self.stop_ids, self.mask_id)
        hit = self.find_stop_text(head[:n]) if self.find_stop_text is not None else None
        if hit is None and not (n < len(head) and head[n] in self.stop_ids):
            return False
        if hit is not None:
            self.stop_len, self.stop_text = hit
        if self.stop_ids:
            self.canvas[end:] = [min(self.stop_ids)] * (len(self.canvas) - end)
        self.finish_reason = FinishReason.STOP
        return True

    def cancel(self) -> StepEvent:
        self.finish_reason = FinishReason.CANCELLED
        return self.event()


__all__ = ["DecodeSequence"]
