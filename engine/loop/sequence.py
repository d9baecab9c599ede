"""Per-request decoding state, in plain Python (no torch).

A `Sequence` knows where its request stands in the reverse process — block, step within the
block, how many tokens the fixed schedule commits next — and applies what the runner committed.
The step loop owns sequences; a runner reads each row's geometry and parameters from them, and
the loop feeds the runner's per-row results back through `Sequence.apply_row_later`, which
commits them and returns the call that builds the step's `StepEvent` (`apply` builds it at once).
"""

from __future__ import annotations

import enum
import functools
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from celeris.engine.sampling.params import SamplingParams
from celeris.engine.sampling.schedule import dream_transfer_count, transfer_schedule
from celeris.engine.tokenizer import stop_cut


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
    ticket: int = field(default_factory=lambda: next(_tickets))  # unique per object: ids may be reused
    token_logprobs: dict = field(default_factory=dict)  # canvas position -> (logprob, top alternatives)
    # With stop strings: ids -> (prefix length whose text first holds one, the string) or None.
    find_stop_text: Optional[Callable[[list[int]], Optional[tuple[int, str]]]] = field(default=None, repr=False)
    stop_len: Optional[int] = None  # generated ids kept after a stop string (through its last token)
    stop_text: str = ""  # the stop string that ended the output
    skipped: int = 0  # steps in a row the scheduler ran without this request
    # Structured outputs (engine/structured): the skeleton is on the canvas from the start, and
    # each step only the slots' fronts may commit, under their token masks.
    constraint: Any = field(default=None, repr=False)
    skeleton_shown: bool = False  # the first event reports the skeleton's positions as committed
    error: Optional[Exception] = None  # why this request alone failed (Sequence.fail), else None
    # The client (API key, else address) whose share of the running slots it counts against
    # (engine/loop/fair_share.py); one call's samples share it. "" = one anonymous owner.
    owner: str = ""
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (block families)
    # A choice's option probabilities, once the runner scored them (RowResult.choices), in its order.
    choice_scores: tuple = ()

    def __post_init__(self) -> None:
        self.canvas = [self.mask_id] * self.params.gen_length
        if self.constraint is not None:
            self.canvas = list(self.constraint.layout.canvas)
        self._schedule = transfer_schedule(self.params.block_length, self.params.steps_per_block)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def length(self) -> int:
        return len(self.prompt) + self.params.gen_length

    @property
    def first_window(self) -> int:
        """Output positions [0, n) the forward that decodes output position 0 sees: its block."""
        return self.params.block_length

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

    def _cut(self, ids):
        """`ids` up to the first stop token (dropped) or through the token that completed a stop
        string: the one rule for what was generated."""
        return ids[:stop_cut(ids, self.stop_ids, self.mask_id)][:self.stop_len]

    def generated(self) -> list[int]:
        return self._cut(self.output)

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
        stop = stop_cut(canvas, self.stop_ids)  # one scan for both cuts (`_cut` adds the mask's)
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
        """Commit the runner's picks (block-relative positions), advance the schedule, return the event."""
        return self._apply(positions, tokens, confidences, logprobs, provisional)()

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

    def fail(self, error: Exception) -> StepEvent:
        """End this request alone: its own row-level work failed (its structure, its stop strings,
        non-finite logits in its row). Its last event carries `error` for its door to raise, and
        nothing of its state (reading that may be what failed)."""
        self.error, self.finish_reason = error, FinishReason.CANCELLED
        return StepEvent(request_id=self.request_id, step=max(self.nfe - 1, 0), total_steps=0, block=0, num_blocks=0,
                         canvas=(), committed=(), confidences=(), generated=(), visible=0, settled=0, steps=self.nfe,
                         forward_passes=0, seed=0, prompt_tokens=len(self.prompt), finished=True,
                         finish_reason=FinishReason.CANCELLED, ticket=self.ticket, error=error)
