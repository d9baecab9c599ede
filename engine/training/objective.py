"""Training objectives of both celeris-tiny models, on padded batches.

Rows are left-padded ([pad | prompt | response]); positions count from each row's first real
token and padding keys are masked out, exactly as the engine serves a prompt, so what a model
sees in training is what it sees when served.

- Full canvas (LLaDA's loss): t ~ U(0, 1) per row, each maskable token masked with probability
  t, cross-entropy on masked positions weighted by 1/t. Maskable = every real token for
  pretraining windows, the response for supervised examples (LLaDA's SFT, EOS padding included).
- Block diffusion (SDAR's): the model reads [noisy copy | clean copy] of a row. A noisy block
  attends to itself and to the clean blocks before it; the clean copy attends block-causally —
  the attention the engine's exact KV cache gives a block being denoised. Each block draws its
  own t, so every block of every row is one denoising example in one forward.
Both losses are normalised per row by the number of maskable positions, then averaged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from celeris.engine.families.family import Family
from celeris.engine.models.attention import rope_tables
from celeris.engine.models.transformer import MaskPredictor

EPS = 1e-3  # LLaDA's floor on the mask ratio, so 1/t stays bounded


def stratified_t(n: int, gen: torch.Generator) -> torch.Tensor:
    """n draws of t ~ U(0, 1), one per 1/n interval (stratified): the same objective with far
    less variance, which matters when 1/t weights reach 1/EPS. Shape (n,)."""
    u = torch.rand(1, generator=gen)
    return ((u + torch.arange(n) / n) % 1.0)[torch.randperm(n, generator=gen)]


def positions_of(real: torch.Tensor) -> torch.Tensor:
    """(B, L) positions counted from each row's first real token (padding gets 0)."""
    return (real.long().cumsum(-1) - 1).clamp_min(0)


def forward_masked(model: MaskPredictor, ids: torch.Tensor, positions: torch.Tensor,
                   allowed: torch.Tensor) -> torch.Tensor:
    """Logits (B, L, V) with an explicit (B, L, L) query-key mask: the training forward."""
    cfg = model.cfg
    cos, sin = rope_tables(positions, cfg.rotary_dim, cfg.rope_theta)
    x = model.transformer.wte(ids)
    if cfg.input_emb_norm:
        x = x * (cfg.d_model ** 0.5)
    # A batch without padding or structure (all keys allowed) attends unmasked: the same
    # result, and the kernel without a mask is the fast one (a long row costs a third less).
    mask = None if bool(allowed.all()) else allowed[:, None]
    for block in model.transformer.blocks:
        x, _ = block(x, cos, sin, mask)
    if cfg.logit_shift:
        x = torch.cat([x[:, :1], x[:, :-1]], dim=1)
    return model.head(x)


def _weighted_ce(logits: torch.Tensor, target: torch.Tensor, masked: torch.Tensor, p_mask: torch.Tensor,
                 maskable: torch.Tensor) -> torch.Tensor:
    ce = F.cross_entropy(logits[masked].float(), target[masked], reduction="none")
    per_row = maskable.sum(1, keepdim=True).clamp_min(1).expand_as(masked)[masked]
    return (ce / (p_mask[masked] * per_row)).sum() / max(1, int((maskable.sum(1) > 0).sum()))


def full_loss(model: MaskPredictor, x: torch.Tensor, real: torch.Tensor, maskable: torch.Tensor,
              mask_id: int, gen: torch.Generator) -> torch.Tensor:
    B, L = x.shape
    p_mask = ((1 - EPS) * stratified_t(B, gen) + EPS)[:, None].expand(B, L)
    masked = (torch.rand(B, L, generator=gen) < p_mask) & maskable
    allowed = real[:, None, :].expand(B, L, L)
    logits = forward_masked(model, torch.where(masked, mask_id, x), positions_of(real), allowed)
    return _weighted_ce(logits, x, masked, p_mask, maskable)


def block_mask(positions: torch.Tensor, real: torch.Tensor, block: int) -> torch.Tensor:
    """(B, 2L, 2L) attention of [noisy | clean]: noisy block k sees noisy block k and clean
    blocks < k; clean block k sees clean blocks <= k; padding keys are never seen."""
    blk = positions // block  # (B, L)
    q, k = blk[:, :, None], blk[:, None, :]
    key_real = real[:, None, :]
    same, before, upto = (q == k) & key_real, (k < q) & key_real, (k <= q) & key_real
    top = torch.cat([same, before], dim=2)  # noisy queries
    bottom = torch.cat([torch.zeros_like(same), upto], dim=2)  # clean queries
    return torch.cat([top, bottom], dim=1)


def block_loss(model: MaskPredictor, x: torch.Tensor, real: torch.Tensor, maskable: torch.Tensor,
               mask_id: int, block: int, gen: torch.Generator) -> torch.Tensor:
    B, L = x.shape
    pos = positions_of(real)
    blk = pos // block
    n_blocks = int(blk.max()) + 1
    t = ((1 - EPS) * stratified_t(B * n_blocks, gen) + EPS).view(B, n_blocks)
    p_mask = torch.gather(t, 1, blk)  # (B, L): each position takes its block's t
    masked = (torch.rand(B, L, generator=gen) < p_mask) & maskable
    ids = torch.cat([torch.where(masked, mask_id, x), x], dim=1)
    logits = forward_masked(model, ids, torch.cat([pos, pos], dim=1), block_mask(pos, real, block))
    return _weighted_ce(logits[:, :L], x, masked, p_mask, maskable)


def model_loss(model: MaskPredictor, family: Family, x: torch.Tensor, real: torch.Tensor, maskable: torch.Tensor,
               mask_id: int, gen: torch.Generator) -> torch.Tensor:
    """The model's own objective, as its family decodes: SDAR's block loss (in its trained block
    size) for a block family, LLaDA's full-canvas loss otherwise."""
    if family.block:
        return block_loss(model, x, real, maskable, mask_id, family.block_length, gen)
    return full_loss(model, x, real, maskable, mask_id, gen)
