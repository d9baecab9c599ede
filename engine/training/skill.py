"""Two-digit addition: a skill with exact answers, so training progress is checkable.

Prose loss alone says little about whether celeris-tiny learned anything; "37+45=" -> "82" is
either right or wrong. Operands are 10..99, so answers are 20..198 (two or three digits).

The held-out split is a fixed rule on the unordered pair {a, b}, not a random draw: it is the
same on every machine and run, train and eval can never share a pair, and eval cannot be solved
by remembering the commuted training example (45+37 for 37+45).
"""

from __future__ import annotations

import random
import zlib

SEED = 1234
OPERANDS = range(10, 100)
HELDOUT_PERCENT = 10


def is_heldout(a: int, b: int) -> bool:
    """True for about HELDOUT_PERCENT% of pairs, chosen by a stable hash of the unordered pair."""
    # crc32, unlike hash(), does not change between Python processes.
    key = f"{min(a, b)}+{max(a, b)}".encode()
    return zlib.crc32(key) % 100 < HELDOUT_PERCENT


def format_pair(a: int, b: int) -> tuple[str, str]:
    """The (prompt, answer) texts for a + b."""
    return f"{a}+{b}=", str(a + b)


def _operand_pairs(heldout: bool) -> list[tuple[int, int]]:
    return [(a, b) for a in OPERANDS for b in OPERANDS if is_heldout(a, b) == heldout]


def make_addition(rng: random.Random, n: int, heldout: bool = False) -> list[tuple[str, str]]:
    """n (prompt, answer) pairs drawn with replacement from the train (or held-out) split."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    pool = _operand_pairs(heldout)
    return [format_pair(*rng.choice(pool)) for _ in range(n)]


def train_pairs(n: int = 20_000, seed: int = SEED) -> list[tuple[str, str]]:
    """A fixed sample of n training examples; the same list on every call."""
    return make_addition(random.Random(seed), n)


def heldout_pairs() -> list[tuple[str, str]]:
    """Every held-out pair, in order: eval is exhaustive, so no seed is needed."""
    return [format_pair(a, b) for a, b in _operand_pairs(heldout=True)]


def is_correct(prompt: str, answer: str) -> bool:
    """Whether answer is the exact sum for a prompt like "37+45=" (surrounding spaces allowed)."""
    a, b = prompt.rstrip("=").split("+")
    return answer.strip() == str(int(a) + int(b))
