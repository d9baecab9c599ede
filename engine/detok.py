"""Incremental detokenization of a diffusion canvas: one text piece per position.

A delta stream sends each position's share of the canvas text (its *piece*) once, when it
changes, instead of decoding the whole canvas for every message. The rule, for every canvas:

    "".join(pieces[:visible]) == Tokenizer.render(canvas[:visible])

`render` decodes each run of real tokens between masks as a whole, so a token's text depends on
its left neighbours (a UTF-8 character split over byte tokens, a leading space a decoder drops at
the start of a run, WordPiece "##" joins). As in vLLM's incremental detokenizer, a piece is
`decode(window + [token]) - decode(window)` over a small window of real tokens to its left in
the same run (special tokens, which decode to nothing, are passed over without counting): the
window never crosses a mask or the `visible` cut (so the run structure matches
`render`'s), and grows left while its text starts inside a split character. The replacement
character of an unfinished character at the end is held back (piece "") until the character
completes or the run ends, where `render` shows it too. Lossy UTF-8 decoding (Rust's, as the
`tokenizers` decoders use) turns an unfinished tail into exactly one U+FFFD, so at most one is
held: bytes that are simply invalid are emitted one step later, never lost.

So a commit at position p can change the pieces of p - 1 (no longer the end of its run) and of
the next few positions to its right (their left context changed): `update` recomputes just those
and reports which positions changed. Transport-free: doors turn the pieces into messages.

`CanvasDeltas` is what both doors' delta streams are built from: one request's canvas between
the events a door sends, as a `CanvasDelta` record (the cells whose id, piece or final flag
changed, the commits, the cuts) that gRPC maps to a GenerateResponse and HTTP to an SSE object.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Optional, Sequence

from celeris.engine.events import CanvasDelta, Cell, Guess, StepEvent
from celeris.engine.tokenizer import MASK_MARKER, Tokenizer

REPLACEMENT = "\ufffd"
WINDOW = 4  # real tokens of left context (a UTF-8 character spans at most 4 byte tokens)
GROW = 4  # more tokens the window may take while its text starts inside a split character


def _hold(text: str) -> str:
    """`text` without the one replacement character an unfinished last character decodes to."""
    return text[:-1] if text.endswith(REPLACEMENT) else text


class IncrementalDetokenizer:
    """The pieces of one canvas (the generated part of one request), kept up to date."""

    def __init__(self, tok: Tokenizer, length: int, window: int = WINDOW):
        self.tok, self.window = tok, window
        self.ids = [tok.mask_id] * length
        self.pieces = [MASK_MARKER] * length
        self.visible = length
        self.masked = length  # positions still masked

    def _boundary(self, q: int) -> bool:
        """True if q starts a run (nothing real to its left in the same run)."""
        return q <= 0 or q == self.visible or self.ids[q - 1] == self.tok.mask_id

    def _run_end(self, q: int) -> bool:
        """True if q is the last real token of its run."""
        return q + 1 >= len(self.ids) or q + 1 == self.visible or self.ids[q + 1] == self.tok.mask_id

    def piece(self, q: int) -> str:
        """The piece of position q, from the ids to its left in its run."""
        t = self.ids[q]
        if t == self.tok.mask_id:
            return MASK_MARKER
        special = self.tok.special_ids
        s, limit = q, self.window
        while limit > 0 and not self._boundary(s):
            s -= 1
            limit -= self.ids[s] not in special
        decode = self.tok.decode
        prev = decode(self.ids[s:q])
        grow = GROW
        while prev.startswith(REPLACEMENT) and grow > 0 and not self._boundary(s):  # window starts mid-character
            s -= 1
            grow -= self.ids[s] not in special
            prev = decode(self.ids[s:q])
        full = decode(self.ids[s:q + 1])
        held_prev = _hold(prev)
        held = full if self._run_end(q) else _hold(full)
        if held.startswith(held_prev):
            return held[len(held_prev):]
        return self._exact(q)  # a decoder that rewrites earlier text: fall back to the whole run

    def _exact(self, q: int) -> str:
        s = q
        while not self._boundary(s):
            s -= 1
        decode = self.tok.decode
        prev = _hold(decode(self.ids[s:q]))
        full = decode(self.ids[s:q + 1])
        full = full if self._run_end(q) else _hold(full)
        return full[len(prev):] if full.startswith(prev) else full

    def _span(self, p: int) -> range:
        """Positions whose piece may depend on position p (or on a run boundary at p): p - 1, and
        to the right as far as window + GROW text-bearing tokens (special ones do not count)."""
        special, mask = self.tok.special_ids, self.tok.mask_id
        end, need = p + 1, self.window + GROW
        while end < len(self.ids) and need > 0 and self.ids[end] != mask:
            need -= self.ids[end] not in special
            end += 1
        return range(max(0, p - 1), min(len(self.ids), end + 1))

    def update(self, canvas: Sequence[int], changed: Iterable[int], visible: int) -> list[int]:
        """Take the ids of canvas at the `changed` positions and the new visible cut; return the
        positions whose id or piece changed, ascending. Cost: O(changed * window) decodes."""
        dirty: set[int] = set()
        moved: set[int] = set()
        for p in changed:
            t = canvas[p]
            if t != self.ids[p]:
                self.masked += (t == self.tok.mask_id) - (self.ids[p] == self.tok.mask_id)
                self.ids[p] = t
                moved.add(p)
                dirty.update(self._span(p))
        if visible != self.visible:
            for v in (self.visible, visible):
                dirty.update(self._span(v))
            self.visible = visible
        out = []
        for q in sorted(dirty):
            new = self.piece(q)
            if new != self.pieces[q] or q in moved:
                self.pieces[q] = new
                out.append(q)
        return out

    def text(self) -> str:
        """The canvas text (O(length): for tests and checks, not for messages)."""
        return "".join(self.pieces[:self.visible])


class CanvasDeltas:
    """Builds one request's `CanvasDelta`s from the step events a door sends, in order.

    A cell is reported when its id or piece changed (the detokenizer's `update`) or when it became
    final without changing: the events' `settled` count only grows, so those are the positions
    between the previous delta's count and this one's that were not final before (every position
    of a revising model's canvas; a mask model's committed ones already were). `StepEvent.is_final`
    holds the one rule for which family is which."""

    def __init__(self, tok: Tokenizer, length: int):
        self.tok = tok
        self.detok = IncrementalDetokenizer(tok, length)
        self.final = bytearray(length)  # each position's final flag as last reported
        self.settled = 0  # `settled` of the previous delta

    def delta(self, ev: StepEvent, committed: Mapping[int, float]) -> Optional[CanvasDelta]:
        """The delta of `ev`, given the positions committed since the previous delta (with their
        confidences); None for the last event, which both doors send whole (its text cut at the stop)."""
        if ev.finished:
            return None
        d, mask, final = self.detok, self.tok.mask_id, self.final
        changed = set(d.update(ev.canvas, committed, ev.visible))
        changed.update(i for i in range(self.settled, ev.settled) if not final[i])
        self.settled = max(self.settled, ev.settled)
        text = self.tok.token_text
        cells = []
        for i in sorted(changed):
            t = d.ids[i]
            final[i] = ev.is_final(i, mask)
            own = text(t)
            cells.append(Cell(i, t, own, t == mask, bool(final[i]), None if d.pieces[i] == own else d.pieces[i]))
        positions = tuple(sorted(committed))
        return CanvasDelta(tuple(cells), positions, tuple(committed[p] for p in positions), ev.visible, ev.settled,
                           d.masked, tuple(Guess(i, t, text(t), c) for i, t, c in ev.provisional))


__all__ = ["CanvasDeltas", "IncrementalDetokenizer"]
