"""Counter-based randomness, and Gumbel-max draws computed only where a token can be drawn.

The uniform number of (seed, step, position, vocab id) is a hash, so a request draws the same
noise alone or inside any batch, on any device. A draw is LLaDA's Gumbel-max: the argmax over the
vocabulary of log(exp(logits) / (-log U)^T).

On the CPU the noise of a whole window (B x W x a 126k vocabulary of hashes, logs and doubles) cost
more than the layers of a small model's step, and most of it is never read: only candidate
positions are drawn (`row_scores`), and under top-k / top-p / a structure only the tokens left
above -inf can win: `sampled_argmax` hashes exactly those (row, token) pairs; a token at -inf
scores -inf whatever its noise, so the argmax is the dense one's (first maximum, first NaN).
"""

from __future__ import annotations

from typing import Optional

import torch

NEG_INF = float("-inf")
_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xorshift-multiply); int64 holds the uint32, constants < 2^31
    keep every product below 2^63 so nothing overflows."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _M32
    return x ^ (x >> 16)


def position_hash(seed: torch.Tensor, step: torch.Tensor, pos: torch.Tensor, stream: int) -> torch.Tensor:
    """The hash of (seed, step, position) a position's draws start from.  seed, step (B,); pos (B, W) -> (B, W)"""
    s = _mix32((seed ^ (seed >> 32)) & _M32) ^ stream
    return _mix32(_mix32(s[:, None] ^ (step & _M32)[:, None]) ^ (pos & _M32))


def _uniform(h: torch.Tensor) -> torch.Tensor:
    """U(0,1) in float64 with 48 random bits from a 32-bit hash."""
    hi, lo = h >> 8, _mix32(h ^ 0x2545F491) >> 8  # two 24-bit halves
    return (hi.double() * 2.0**24 + lo.double() + 0.5) / 2.0**48


def uniform_noise(seed: torch.Tensor, step: torch.Tensor, pos: torch.Tensor, vocab: Optional[int], stream: int) -> torch.Tensor:
    """U(0,1) in float64 with 48 random bits, a pure function of its integer coordinates.

    seed, step: (B,) int64; pos: (B, W) int64. Returns (B, W, vocab), or (B, W) if vocab is None.
    """
    h = position_hash(seed, step, pos, stream)  # (B, W)
    if vocab is not None:
        v = torch.arange(vocab, device=pos.device, dtype=torch.int64)
        h = _mix32(h[..., None] ^ v)  # (B, W, V)
    return _uniform(h)


def gumbel_scores(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """log of LLaDA's exp(logits) / (-log U)^T, in float64: the same argmax without overflow."""
    return logits.double() - temperature.double()[:, None, None] * torch.log(-torch.log(u))


def row_scores(rows: torch.Tensor, h: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """`gumbel_scores` of rows (N, V) given each row's `position_hash` h (N,) and temperature (N,)."""
    u = _uniform(_mix32(h[:, None] ^ torch.arange(rows.shape[-1], device=rows.device)))  # (N, V)
    return rows.double() - temperature.double()[:, None] * torch.log(-torch.log(u))


def sampled_argmax(rows: torch.Tensor, h: torch.Tensor, temperature: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """The first argmax of each row's `row_scores` over its `live` tokens (N, V) bool, hashing
    only those. Every token not live must be at -inf in rows or excluded by the caller (the mask
    id). rows (N, V) logits; h (N,); temperature (N,) -> (N,) long. A row with nothing live
    draws token 0, as the dense argmax of an all -inf row does; a NaN wins, the first one."""
    N, V = rows.shape
    r, v = live.nonzero(as_tuple=True)  # (K,) row-major: by row, then by token id
    u = _uniform(_mix32(h[r] ^ v))
    s = rows[r, v].double() - temperature.double()[r] * torch.log(-torch.log(u))  # (K,)
    nan = s.isnan()
    big = torch.full((N,), V, dtype=torch.long)
    first_nan = big.scatter_reduce(0, r[nan], v[nan], "amin")
    best = torch.full((N,), NEG_INF, dtype=torch.float64).scatter_reduce(0, r[~nan], s[~nan], "amax")
    at_best = ~nan & (s == best[r]) & (best[r] > NEG_INF)
    first_best = big.scatter_reduce(0, r[at_best], v[at_best], "amin")
    x0 = torch.where(first_nan < V, first_nan, first_best)
    return torch.where(x0 < V, x0, torch.zeros_like(x0))
