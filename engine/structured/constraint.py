"""A request's structured-output constraint as it decodes: per-slot fronts and token masks.

The out-of-order part, ours: slots fill left to right inside each slot and in parallel across
slots, so at each step only each unfinished slot's leftmost masked position (its *front*) is a
candidate, and its allowed tokens are those the slot's matcher (llguidance) accepts next. A
slot shorter than its capacity ends with its *filler*: the filler is allowed only where the
slot's text is a complete match, and once chosen every later position of the slot must be the
filler. The filler is the tokenizer's pad id where that is a special id decode drops and not a
stop id (the final text is exactly the JSON); else a space token between JSON values (still
exactly valid JSON), or, for a regex/choice filling the whole canvas, a stop id (the output
ends there). What a door asks for is spec.py's `Structured`; compiler.py turns it into the
`Layout` a `Constraint` decodes (both re-exported here, where callers have always found them).
"""

from __future__ import annotations

from typing import Optional

import llguidance
import numpy as np
import torch

from celeris.engine.errors import FieldViolation, InvalidRequest
from celeris.engine.structured.compiler import Compiler, Layout, SlotSpec  # noqa: F401 (re-exported)
from celeris.engine.structured.document import Closer
from celeris.engine.structured.masks import unpack
from celeris.engine.structured.spec import (  # noqa: F401 (re-exported)
    GRAMMAR, GRAMMAR_CACHE, KINDS, LARGE_SCHEMA_CHARS, LARGE_SCHEMAS_WAITING, LIMITS, MAX_CHOICE_CHARS, MAX_CHOICES,
    MAX_GRAMMAR_CHARS, MAX_SCHEMA_CHARS, MAX_SCHEMA_NESTING, StructureError, Structured, json_text_depth, read_schema,
    value_depth)


class Constraint:
    """One request's slots as it decodes: a matcher and a front per slot."""

    def __init__(self, layout: Layout, compiler: Compiler, field: str = "structured_output"):
        self.layout, self.field = layout, field  # field: the client's name for it, in its errors
        self.V = compiler.vocab_size
        self.words = (self.V + 31) // 32
        self._matchers = [llguidance.LLMatcher(compiler.ll, s.grammar, limits=LIMITS) for s in layout.slots]
        self._ended = [False] * len(layout.slots)
        self._eos = compiler.tok.eos_id
        self._mask = compiler.tok.mask_id
        self._by_front = {s.start: i for i, s in enumerate(layout.slots)}
        self._force: dict[int, int] = {}  # position -> the token the grammar forces there (forced slots)
        self._early: dict[int, int] = {}  # position -> token a step's chain committed before the sequence did
        # The forced slots' closing (document.Closer): a document ends before the canvas does.
        self._closers = {i: Closer(compiler.tokens, self.words, s.hints) for i, s in enumerate(layout.slots) if s.forced}
        # Typed decisions (engine/sampling/choice.py): whether this request asked for its options'
        # probabilities (a choice with logprobs; engine/requests.py sets it), and whether they are taken.
        self.score_choices = False
        self._scored = False
        self._decided_end: Optional[int] = None  # after the decided option: the position that takes the filler

    @property
    def choice_horizon(self) -> int:
        """H: the output positions a choice's options are scored over, one past the longest
        option (its end), at most the canvas (engine/sampling/choice.py)."""
        longest = max(len(ids) for _, ids in self.layout.choices)
        return min(longest + 1, len(self.layout.canvas))

    def choice_columns(self, cols: list[int]) -> Optional[list[int]]:
        """The window columns of output positions [0, H) when this step is the one the options are
        scored at: asked for, not scored yet, the slot's front still at its first position (every
        slot position masked: the forward that commits its first token), and all H positions in
        this window. Else None. Marks them scored: called once per step, by `selection.select_step`."""
        if not self.score_choices or self._scored or self.layout.slots[0].start not in self._by_front:
            return None
        col_of = {p: j for j, p in enumerate(cols) if p >= 0}
        if 0 not in col_of:
            return None
        H = self.choice_horizon
        if not all(i in col_of for i in range(H)):  # requests.py refuses such a request up front
            raise self.failure(f"the first window holds fewer than the {H} positions its options are scored over")
        self._scored = True
        return [col_of[i] for i in range(H)]

    def choice_ids(self) -> torch.Tensor:
        """(K, H) long: each option's tokens from the slot's first position, the filler past its end."""
        H, filler = self.choice_horizon, self.layout.slots[0].filler
        return torch.tensor([list(ids[:H]) + [filler] * (H - len(ids)) for _, ids in self.layout.choices],
                            dtype=torch.long)

    def decide(self, k: int) -> None:
        """Typed decisions: the choice writes option k, the one its probabilities picked (one
        decision, one computation: the text is the option the numbers rank or draw). Its tokens go
        to the matcher now and each position allows only its token, then the filler (so a prefix
        option, `yes` beside `yesterday`, ends there). Called in the scoring step, before its masks."""
        s, ids = self.layout.slots[0], list(self.layout.choices[k][1])
        taken = self._matchers[0].try_consume_tokens(ids)  # the canonical tokens, as scored: all of them
        for j, t in enumerate(ids[:taken]):
            self._force[s.start + j] = t
            self._by_front[s.start + j] = 0
        self._by_front[s.start + taken] = 0
        if taken == len(ids):
            self._decided_end = s.start + taken

    def fixed(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """(position, token) of the structure's fixed tokens in [lo, hi): the skeleton, and the stop
        id after the structure (also past the layout, for canvases rounded up beyond it)."""
        canvas = self.layout.canvas
        return [(p, canvas[p] if p < len(canvas) else self.layout.tail) for p in range(lo, hi)
                if p >= len(canvas) or canvas[p] != self._mask]

    def fronts(self, lo: int, hi: int) -> list[int]:
        """Canvas positions in [lo, hi) that may commit this step (each live slot's front)."""
        return sorted(p for p in self._by_front if lo <= p < hi)

    def window(self, cols: list[int]) -> tuple[list[int], np.ndarray]:
        """This row's fronts in a step's window, cols[j] the canvas position of column j (-1:
        none): (their columns, their allowed tokens as packed rows (N, ceil(V / 32)) uint32).
        InvalidRequest naming this request's own field if its matcher raises or allows nothing
        at a front (its language ended: nothing could be served)."""
        col_of = {p: j for j, p in enumerate(cols) if p >= 0}
        try:  # llguidance runs in both: its errors are this request's alone
            if col_of:
                self._fast_forward(min(col_of), max(col_of) + 1)
            fronts = self.fronts(min(col_of), max(col_of) + 1) if col_of else []
            words = np.zeros((len(fronts), self.words), dtype=np.uint32)
            for k, p in enumerate(fronts):
                self.fill(p, words[k])
                if not words[k].any():
                    raise self.failure(f"no token can continue it at output position {p}", self._by_front[p])
        except InvalidRequest:
            raise
        except Exception as e:  # llguidance's own error text quotes the state: the type names it
            raise self.failure(f"the constraint library failed ({type(e).__name__})") from None
        return [col_of[p] for p in fronts], words

    def _fast_forward(self, lo: int, hi: int) -> None:
        """A forced slot whose front is in [lo, hi): the tokens its grammar forces next (llguidance's
        fast-forward tokens) go to the matcher now and their positions become fronts that allow
        only them, the position after them the slot's front: they all commit this step. What is
        forced is certain whatever the model picks, so the matcher may run ahead of the canvas."""
        for p, i in list(self._by_front.items()):
            s = self.layout.slots[i]
            if not s.forced or self._ended[i] or p in self._force or not lo <= p < hi:
                continue
            ff = self._matchers[i].compute_ff_tokens()
            if ff:  # the completion's spelling (what fits counts it), so the completion is found
                # first (a document's opening is forced before any front asked for it), and chosen
                # over all the forced bytes before the window cuts them: cut first, a forced key's
                # first piece in llguidance's spelling would not be the completion's first token.
                self._closers[i].completion(self._matchers[i], self._room(s, p))
                ff = self._closers[i].spelled(ff)
            ff = ff[:max(0, min(hi, s.start + s.capacity - 1) - p)]
            ff = ff[:self._matchers[i].try_consume_tokens(ff)] if ff else ff
            if not ff:
                continue
            self._closers[i].consumed(ff)
            for k, t in enumerate(ff):
                self._force[p + k] = t
                self._by_front[p + k] = i
            self._by_front[p + len(ff)] = i

    def failure(self, reason: str, slot: Optional[int] = None) -> InvalidRequest:
        """This request's error when its structure cannot go on: names its own field (the slot's
        schema path where known) and nothing else."""
        path = self.layout.slots[slot].path if slot is not None else ""
        return InvalidRequest([FieldViolation(path or self.field, f"the structure cannot be served: {reason}")])

    def fill(self, pos: int, words: np.ndarray) -> None:
        """Write the tokens the slot whose front is `pos` may commit there into `words`, a
        contiguous (ceil(V / 32),) uint32 row, as bits (token t: bit t % 32 of word t // 32).
        llguidance writes its mask straight into the row (no Python per token)."""
        i = self._by_front[pos]
        s = self.layout.slots[i]
        filler = s.filler
        if pos in self._force:  # a token the grammar forces, already consumed
            words[:] = 0
            filler = self._force[pos]
        elif self._ended[i] or pos == self._decided_end:  # ended, or the decided option is written
            words[:] = 0
        elif s.forced and (close := self._closers[i].closing(self._matchers[i], self._room(s, pos))) is not None:
            words[:] = 0  # the canvas runs short: only the completion's next token, to the document's end
            filler = close[0] if close else filler
        else:
            m = self._matchers[i]
            m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
            words[self._eos >> 5] &= ~np.uint32(1 << (self._eos & 31))  # ends are the filler's job
            if s.forced:  # near the end: no token after which the document could not end in time
                self._closers[i].check(m, self._room(s, pos), words)
            if not m.is_accepting():
                return
        words[filler >> 5] |= np.uint32(1 << (filler & 31))

    @staticmethod
    def _room(s: SlotSpec, pos: int) -> int:
        """Positions a whole-document slot's front at `pos` may still fill, this one included: one
        is kept for the stop id after the document, so a document never fills the canvas to its
        last position and ends as `length` (a tool call then reads as cut)."""
        return s.start + s.capacity - pos - 1

    def allowed(self, pos: int) -> torch.Tensor:
        """(V,) bool: the tokens the slot whose front is `pos` may commit there."""
        words = np.zeros((1, self.words), dtype=np.uint32)
        self.fill(pos, words[0])
        return unpack(words, self.V, torch.device("cpu"))[0]

    def commit(self, pos: int, token: int) -> None:
        """The slot whose front is `pos` committed `token` there: move its front right. A slot
        that ends makes all its remaining positions fronts at once (each allows the filler only).
        A position `commit_early` already took is not taken twice."""
        early = self._early.pop(pos, None)
        if early is not None:
            if early != token:  # the sequence applies the step's own picks: never happens
                raise self.failure(f"output position {pos} took token {token} after {early}")
            return
        self._advance(pos, token)

    def commit_early(self, pos: int, token: int) -> None:
        """`commit` during the step that picked `token` (runner_api's chain): the slot's front
        moves now, so the same step can pick at the next position under its mask; the sequence's
        own `commit` of it afterwards is a no-op."""
        self._advance(pos, token)
        self._early[pos] = token

    def _advance(self, pos: int, token: int) -> None:
        i = self._by_front.pop(pos)
        s = self.layout.slots[i]
        if pos in self._force:
            if self._force.pop(pos) != token:  # the mask allowed only the forced token
                raise self.failure(f"a forced position took token {token} at output position {pos}", i)
            return
        if self._ended[i]:
            return
        end = s.start + s.capacity
        if token == s.filler and self._matchers[i].is_accepting():
            self._ended[i] = True
            self._by_front.update((p, i) for p in range(pos + 1, end))
            return
        if not self._matchers[i].consume_token(token):  # the mask allowed it: its matcher broke
            raise self.failure(f"its matcher refused token {token} at output position {pos}", i)
        if i in self._closers:
            self._closers[i].consumed([token])
        if pos + 1 < end:
            self._by_front[pos + 1] = i
