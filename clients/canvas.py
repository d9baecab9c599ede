"""Rebuilds full snapshots from a delta stream (SNAPSHOT_FORMAT_DELTA), one canvas per choice.

The server sends, per choice, a layout on the first message, then only the positions whose
state changed (id, own text, masked flag, text piece), and a whole snapshot last. `Canvas`
keeps each choice's positions and turns every message back into the `Snapshot` a full stream
would have carried, so callers of `CelerisClient.stream` see the same records in both formats.
Per message, work is O(changed positions) plus building the Snapshot's token tuple.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from celeris.v1 import generation_pb2 as pb
from celeris_client.types import Snapshot, Token


@dataclass
class ChoiceCanvas:
    """The positions of one choice: plain tokens (committed_this_step False, confidence 0)."""

    tokens: list[Token]
    pieces: list[str]
    visible: int

    @classmethod
    def from_layout(cls, layout: pb.CanvasLayout) -> ChoiceCanvas:
        blank = Token(layout.mask_token_id, layout.mask_text, True, False, 0.0)
        n = layout.gen_length
        return cls([blank] * n, [layout.mask_text] * n, n)

    def apply(self, m: pb.GenerateResponse) -> Snapshot:
        for u in m.updates:
            t = u.token
            self.tokens[u.position] = Token(t.id, t.text, t.masked, False, 0.0)
            self.pieces[u.position] = t.piece if t.HasField("piece") else t.text
        if m.HasField("text_positions"):
            self.visible = m.text_positions
        tokens = list(self.tokens)
        for p, c in zip(m.committed_positions, m.committed_confidences):
            tokens[p] = replace(tokens[p], committed_this_step=True, confidence=c)
        guesses = tuple((u.position, Token(u.token.id, u.token.text, False, False, u.token.confidence))
                        for u in m.provisional)
        return replace(Snapshot.from_pb(m), text="".join(self.pieces[:self.visible]), tokens=tuple(tokens),
                       provisional=guesses)


@dataclass
class Canvas:
    """Feed it every message of one Generate stream, in order: `snapshot(msg)` is that
    message as a full Snapshot. Full-format messages pass through unchanged."""

    choices: dict[int, ChoiceCanvas] = field(default_factory=dict)

    def snapshot(self, m: pb.GenerateResponse) -> Snapshot:
        if m.format != pb.SNAPSHOT_FORMAT_DELTA or m.done:  # the last message is whole in both formats
            self.choices.pop(m.choice, None)
            return Snapshot.from_pb(m)
        if m.HasField("layout"):
            self.choices[m.choice] = ChoiceCanvas.from_layout(m.layout)
        canvas = self.choices.get(m.choice)
        if canvas is None:
            raise ValueError(f"delta message for choice {m.choice} before its layout")
        return canvas.apply(m)
