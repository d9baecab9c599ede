"""A progress bar with rate and ETA for batch and bench runs, and small statistics helpers."""

from __future__ import annotations

import math
import sys
import time
from typing import Optional, Sequence, TextIO


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Linear-interpolated percentile (q in 0..100); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def fmt_seconds(s: Optional[float]) -> str:
    if s is None or math.isinf(s) or math.isnan(s):
        return "--"
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 60:
        return f"{s:.2f} s"
    m, sec = divmod(int(round(s)), 60)
    return f"{m // 60}:{m % 60:02d}:{sec:02d}" if m >= 60 else f"{m}:{sec:02d}"


class Progress:
    """`[██████░░░░] 45/100 45% · 3.2/s · ETA 0:17 · 2 failed` on a terminal, redrawn in place;
    on a pipe or file, one plain line every `log_every_s` seconds instead."""

    def __init__(self, total: int, label: str = "", out: Optional[TextIO] = None, width: int = 28,
                 min_interval_s: float = 0.1, log_every_s: float = 5.0, clock=time.monotonic):
        self.total, self.label, self.out, self.width = total, label, out or sys.stderr, width
        self.done = self.failed = 0
        self.clock = clock
        self.t0 = clock()
        self._tty = hasattr(self.out, "isatty") and self.out.isatty()
        self._interval = min_interval_s if self._tty else log_every_s
        self._last_draw = -math.inf

    def update(self, ok: bool = True) -> None:
        self.done += 1
        self.failed += not ok
        if self.done == self.total or self.clock() - self._last_draw >= self._interval:
            self.draw()

    def line(self) -> str:
        elapsed = self.clock() - self.t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else None
        frac = self.done / self.total if self.total else 1.0
        filled = int(round(frac * self.width))
        bar = "█" * filled + "░" * (self.width - filled)
        parts = [f"{self.label}[{bar}] {self.done}/{self.total} {frac:4.0%}", f"{rate:.2f}/s",
                 f"ETA {fmt_seconds(eta) if self.done < self.total else '0 ms'}"]
        if self.failed:
            parts.append(f"{self.failed} failed")
        return " · ".join(parts)

    def draw(self) -> None:
        self._last_draw = self.clock()
        if self._tty:
            self.out.write("\r\x1b[2K" + self.line())
        else:
            self.out.write(self.line() + "\n")
        self.out.flush()

    def close(self) -> None:
        if self._tty:
            self.draw()
            self.out.write("\n")
            self.out.flush()
