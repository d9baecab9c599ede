"""Attention primitives shared by both model families: RoPE tables, rotation, and attention
over per-row key ranges.

Full-canvas rows are left-padded (real keys are a suffix of the row); block-diffusion rows
attend to a prefix of their context (the cached blocks, then the fresh one). A prompt is
prefilled one block a row (`BlockRunner._parts`), so every row attends bidirectionally over its
keys. `RowSpan` says, per row, which queries and keys are real and which of them may meet. Shapes: B batch, H heads, Hk kv heads, Lq queries, Lk keys, Dh head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F


def rope_tables(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for integer positions (B, L) -> (B, 1, L, dim), computed in fp32.

    Every published implementation (LLaDA's RotaryEmbedding, Qwen2/Qwen3's, LLaDA2's partial
    one) multiplies the fp32 position by the fp32 inverse frequency once, so these tables are
    bit-identical to theirs.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim))
    freqs = positions.float()[..., None] * inv_freq  # (B, L, dim/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (B, L, dim)
    return emb.cos()[:, None], emb.sin()[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fp32: bool) -> torch.Tensor:
    """Rotate-half RoPE over the first cos.shape[-1] dims of each head. x: (B, H, L, Dh).

    fp32=True rotates in fp32 and casts back (LLaDA's `rope_full_precision`); False casts the
    tables to the model dtype and rotates there (Qwen2/Dream, SDAR, LLaDA2). Identical in fp32
    models. Dims past the rotary width (LLaDA2's partial rotary) pass through.
    """
    rd = cos.shape[-1]
    if rd < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rd], cos, sin, fp32), x[..., rd:]], dim=-1)
    half = rd // 2
    if fp32:
        xf = x.float()
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


@dataclass(frozen=True)
class RowSpan:
    """The real queries [q0, q1) and keys [k0, k1) of one row, and which of them may meet:
    `allowed` (q1-q0, k1-k0) bool, or None for all (bidirectional)."""

    q0: int
    q1: int
    k0: int
    k1: int
    allowed: Optional[torch.Tensor] = None


def left_padded_spans(key_mask: torch.Tensor, n_queries: int) -> list[RowSpan]:
    """Spans of left-padded rows: a full forward pads its queries like its keys; a cached one
    has only real (fresh) queries."""
    Lk = key_mask.shape[1]
    pads = (~key_mask).sum(-1).tolist()
    return [RowSpan(p if n_queries == Lk else 0, n_queries, p, Lk) for p in pads]


@dataclass(frozen=True)
class Spans:
    """Per-row spans of block-diffusion rows as tensors of static shape (no host loop, no sync).

    Row b's real queries are its first q_len[b] and see keys [0, k_end[b]), all of them (a
    block attends bidirectionally over its cached context). Padded queries see every real key
    of their row too, so no row of the softmax is empty."""

    q_len: torch.Tensor  # (B,) long
    k_end: torch.Tensor  # (B,) long, >= 1

    def mask(self, Lq: int, Lk: int) -> torch.Tensor:
        """The (B, 1, Lq, Lk) boolean mask of one batched kernel."""
        dev = self.k_end.device
        j = torch.arange(Lk, device=dev)[None, None, :]  # (1, 1, Lk)
        real_key = j < self.k_end[:, None, None]  # (B, 1, Lk)
        return real_key.expand(-1, Lq, -1)[:, None]

    def rows(self) -> list[RowSpan]:
        """The same spans row by row (one host read), for the per-row kernel calls."""
        return [RowSpan(0, w, 0, e) for w, e in zip(self.q_len.tolist(), self.k_end.tolist())]


def attend(q: torch.Tensor, k: torch.Tensor | Sequence[torch.Tensor], v: torch.Tensor | Sequence[torch.Tensor],
           mask: Optional[torch.Tensor | Sequence[RowSpan] | Spans], gqa: bool) -> torch.Tensor:
    """Attention of q (B, H, Lq, Dh) over k, v (B, Hk, Lk, Dh): no mask, a boolean mask
    (B, 1, Lq|1, Lk), or per-row spans.

    With spans each row attends alone over its real keys, without a mask where it needs none:
    the very call a lone unpadded request makes, so a row's bits do not depend on the batch it
    shares (the masked batched kernel rounds differently in bfloat16). Padded queries give zeros.
    k and v may then be per-row tensors (1, Hk, >= k1, Dh), views of a cache read in place.
    `Spans` give one masked kernel over the batch, of static shape (CUDA graphs).
    """
    if isinstance(mask, Spans):
        mask = mask.mask(q.shape[2], k.shape[2])
    if mask is None or isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    out = q.new_zeros(q.shape)
    for i, s in enumerate(mask):
        allowed = None if s.allowed is None else s.allowed.to(q.device)
        ki, vi = (k[i], v[i]) if isinstance(k, (list, tuple)) else (k[i:i + 1], v[i:i + 1])
        out[i:i + 1, :, s.q0:s.q1] = F.scaled_dot_product_attention(
            q[i:i + 1, :, s.q0:s.q1], ki[:, :, s.k0:s.k1], vi[:, :, s.k0:s.k1],
            attn_mask=allowed, enable_gqa=gqa)
    return out

