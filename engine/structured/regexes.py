"""Small regex helpers: integer ranges as regexes, and how long a regex's matches can be.

`max_width` bounds a regex before anything compiles it: a slot (or a whole canvas) must have
room for the longest string its regex allows, so a regex with unbounded repetition is refused
unless the caller bounds it. It uses Python's own regex parser, which is linear in the pattern.
"""

from __future__ import annotations

import re

try:  # Python 3.11+
    from re import _parser as sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    import sre_parse  # type: ignore[no-redef]

MAX_PATTERN = 1024  # characters of a regex, checked before parsing


class RegexError(ValueError):
    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def max_width(pattern: str, path: str, ascii_only: bool = False) -> int:
    """Most characters a match of `pattern` can have (raises RegexError if unbounded)."""
    if len(pattern) > MAX_PATTERN:
        raise RegexError(path, f"at most {MAX_PATTERN} characters")
    try:
        _, hi = sre_parse.parse(pattern).getwidth()
    except (re.error, OverflowError, RecursionError) as e:
        raise RegexError(path, f"not a valid regex: {e}") from None
    if hi >= sre_parse.MAXREPEAT or hi >= 2 ** 31 - 1:
        raise RegexError(path, "matches strings of unbounded length: bound every repetition ({m,n}, not * or +)")
    return int(hi)


_META = set("\\.+*?()|[]{}^$&-~/#")


def literal(text: str) -> str:
    """A regex matching exactly `text` (every metacharacter escaped, nothing else: the
    constraint library's regex dialect refuses escapes such as an escaped space)."""
    return "".join("\\" + c if c in _META else c for c in text)


def _same_length(lo: str, hi: str) -> str:
    """Regex of the decimal strings between lo and hi, both of the same length."""
    if not lo:
        return ""
    if lo[0] == hi[0]:
        return lo[0] + _same_length(lo[1:], hi[1:])
    n = len(lo) - 1
    if lo[1:] == "0" * n and hi[1:] == "9" * n:
        return f"[{lo[0]}-{hi[0]}]" + "[0-9]" * n
    parts = [lo[0] + _same_length(lo[1:], "9" * n)]
    if int(hi[0]) - int(lo[0]) > 1:
        parts.append(f"[{int(lo[0]) + 1}-{int(hi[0]) - 1}]" + "[0-9]" * n)
    parts.append(hi[0] + _same_length("0" * n, hi[1:]))
    return "(" + "|".join(parts) + ")"


def _nonneg(lo: int, hi: int) -> list[str]:
    parts = []
    for digits in range(len(str(lo)), len(str(hi)) + 1):
        a = max(lo, 10 ** (digits - 1) if digits > 1 else 0)
        b = min(hi, 10 ** digits - 1)
        if a <= b:
            parts.append(_same_length(str(a), str(b)))
    return parts


def int_range(lo: int, hi: int) -> str:
    """A regex matching exactly the JSON integers in [lo, hi] (no leading zeros, no -0)."""
    parts = []
    if hi >= 0:
        parts += _nonneg(max(lo, 0), hi)
    if lo < 0:
        parts += ["-" + p for p in _nonneg(max(-hi, 1), -lo)]
    return "(" + "|".join(parts) + ")"
