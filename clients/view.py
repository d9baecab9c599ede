"""Terminal views of a generation: the live canvas redrawn in place, JSON lines, final stats.

The live view shows every position of the canvas: still-masked positions as dim blocks (or, with
provisional predictions, the predicted token dim and italic), tokens committed in the latest
step highlighted, the rest as plain text, then a
"step i/N · block b/B" line. Each new snapshot replaces the previous frame: the cursor moves
back up over the rows the last frame took (wrapping counted) and clears to the end of screen.
Model output is sanitized so it can never inject terminal escape sequences.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
import unicodedata
from typing import Optional, TextIO

from celeris_client.types import Snapshot

MASK = "\u2592"
DIM, HIGHLIGHT, BOLD, RESET = "\x1b[2;37m", "\x1b[1;30;43m", "\x1b[1m", "\x1b[0m"
GUESS = "\x1b[2;3;36m"  # dim italic cyan: a provisional prediction, not yet committed
HIDE_CURSOR, SHOW_CURSOR, CLEAR_DOWN = "\x1b[?25l", "\x1b[?25h", "\x1b[J"


def sanitize(text: str) -> str:
    """Control characters (ESC included) become U+FFFD; newlines and tabs stay."""
    return "".join(c if c in "\n\t" or unicodedata.category(c)[0] != "C" else "\ufffd" for c in text)


def display_width(text: str) -> int:
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 0 if unicodedata.combining(c) else 1
               for c in text)


def rows(plain: str, columns: int) -> int:
    """Screen rows `plain` takes on a terminal `columns` wide."""
    return sum(max(1, math.ceil(display_width(line.expandtabs()) / columns)) for line in plain.split("\n"))


# End-of-turn tokens of the model families served (as engine/tokenizer.py lists them): text stops there.
STOP_TEXTS = frozenset({"<|eos|>", "<|eot_id|>", "<|im_end|>", "<|endoftext|>", "<eos>", "</s>"})


def visible_count(snap: Snapshot, stop_ids: frozenset[int] = frozenset()) -> int:
    """Positions before the first stop token; exact on the last snapshot (usage counts them)."""
    if snap.done and snap.usage is not None and snap.masked_count == 0:
        return snap.usage.generated_tokens
    return next((i for i, t in enumerate(snap.tokens)
                 if not t.masked and (t.id in stop_ids or t.text in STOP_TEXTS)), len(snap.tokens))


def render_canvas(snap: Snapshot, stop_ids: frozenset[int] = frozenset(), color: bool = True,
                  highlight: bool = True) -> tuple[str, str]:
    """(styled, plain) text of the canvas up to the first stop token (EOS)."""
    styled, plain = [], []
    guesses = {p: t for p, t in snap.provisional}
    for i, tok in enumerate(snap.tokens[:visible_count(snap, stop_ids)]):
        guess = guesses.get(i) if tok.masked else None
        text = sanitize(guess.text) if guess is not None else MASK if tok.masked else sanitize(tok.text)
        if not color:
            styled.append(text)
        elif guess is not None:
            styled.append(f"{GUESS}{text}{RESET}")
        elif tok.masked:
            styled.append(f"{DIM}{text}{RESET}")
        elif highlight and tok.committed_this_step:
            styled.append(f"{HIGHLIGHT}{text}{RESET}")
        else:
            styled.append(text)
        plain.append(text)
    return "".join(styled), "".join(plain)


def status_line(snap: Snapshot, elapsed_s: float) -> str:
    filled = sum(not t.masked for t in snap.tokens)
    rate = filled / elapsed_s if elapsed_s > 0 else 0.0
    return (f"step {snap.step}/{snap.total_steps} · block {snap.block_index + 1}/{snap.num_blocks}"
            f" · {snap.masked_count} masked · {len(snap.committed_positions)} new · {rate:.1f} tok/s")


def final_line(snap: Snapshot, elapsed_s: float) -> str:
    u = snap.usage
    gen = u.generated_tokens if u else 0
    fwd = u.forward_passes if u else snap.step
    rate = gen / elapsed_s if elapsed_s > 0 else 0.0
    return (f"{snap.finish_reason or 'done'} · {gen} tokens · {snap.step} steps · {fwd} forward passes"
            f" · {gen / max(1, fwd):.2f} tokens/forward · {elapsed_s:.2f} s · {rate:.1f} tok/s · seed {snap.seed}")


def snapshot_json(snap: Snapshot) -> str:
    return json.dumps(dataclasses.asdict(snap), ensure_ascii=False)


class LiveView:
    """Redraws the canvas in place on a terminal."""

    def __init__(self, out: TextIO, columns: Optional[int] = None, color: bool = True,
                 stop_ids: frozenset[int] = frozenset()):
        self.out, self.color, self.stop_ids = out, color, stop_ids
        self.columns = columns or shutil.get_terminal_size((100, 24)).columns
        self.t0 = time.perf_counter()
        self._rows = 0
        self.out.write(HIDE_CURSOR)

    def _frame(self, styled: str, plain: str) -> None:
        if self._rows:  # back to the first row of the previous frame, then clear it all
            self.out.write("\r" + (f"\x1b[{self._rows - 1}A" if self._rows > 1 else "") + CLEAR_DOWN)
        self.out.write(styled)
        self.out.flush()
        self._rows = rows(plain, self.columns)

    def draw(self, snap: Snapshot) -> None:
        elapsed = time.perf_counter() - self.t0
        if snap.done:  # the server's decode of the whole text (multi-byte tokens joined properly)
            canvas = plain = sanitize(snap.text)
        else:
            canvas, plain = render_canvas(snap, self.stop_ids, self.color)
        line = final_line(snap, elapsed) if snap.done else status_line(snap, elapsed)
        style = BOLD if snap.done else DIM
        self._frame(f"{canvas}\n{style}{line}{RESET}" if self.color else f"{canvas}\n{line}", f"{plain}\n{line}")

    def close(self) -> None:
        self.out.write("\n" + SHOW_CURSOR)
        self.out.flush()
