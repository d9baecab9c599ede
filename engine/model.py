"""The mask predictor: a LLaMA-style transformer with the causal mask removed (LLaDA, Dream).

Parameter names follow LLaDA's published checkpoint (`transformer.blocks.{i}.q_proj`, ...);
`weights.py` maps Qwen2/Dream names onto them. Shapes: B batch, L sequence, D d_model,
H heads, Hk kv heads, Dh head dim, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the model dtype: bf16 variance loses too much precision.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for integer positions (B, L) -> (B, 1, L, Dh), computed in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # (B, L, Dh/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (B, L, Dh)
    return emb.cos()[:, None], emb.sin()[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (LLaMA/Qwen2/LLaDA convention). x: (B, H, L, Dh)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


@dataclass
class KVCache:
    """Per-layer keys/values of a fixed context (the prefix, or prefix + suffix), already rotated."""

    keys: list[torch.Tensor]  # each (B, Hk, Lc, Dh)
    values: list[torch.Tensor]
    key_mask: torch.Tensor  # (B, Lc) bool, False for padding


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, dh = cfg.d_model, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, dh
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(d, cfg.n_heads * dh, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, cfg.n_kv_heads * dh, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, cfg.n_kv_heads * dh, bias=cfg.qkv_bias)
        self.attn_out = nn.Linear(cfg.n_heads * dh, d, bias=False)
        self.ff_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ff_proj = nn.Linear(d, cfg.mlp_hidden_size, bias=False)  # gate
        self.up_proj = nn.Linear(d, cfg.mlp_hidden_size, bias=False)
        self.ff_out = nn.Linear(cfg.mlp_hidden_size, d, bias=False)  # down

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: Optional[torch.Tensor],
                past: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        B, L, _ = x.shape
        h = self.attn_norm(x)
        q = self.q_proj(h).view(B, L, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, L, Dh)
        k = self.k_proj(h).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hk, L, Dh)
        v = self.v_proj(h).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        new_kv = (k, v)
        if past is not None:  # attend over cached context followed by the fresh positions
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        # No causal mask: every position sees every (non-padding) position.
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                           enable_gqa=self.n_heads != self.n_kv_heads)  # (B, H, L, Dh)
        x = x + self.attn_out(a.transpose(1, 2).reshape(B, L, -1))
        h = self.ff_norm(x)
        x = x + self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h))
        return x, new_kv


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.embedding_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        if not cfg.weight_tying:
            self.ff_out = nn.Linear(cfg.d_model, cfg.embedding_size, bias=False)


class MaskPredictor(nn.Module):
    """`forward(ids) -> logits`: the probability of each vocabulary token at every position."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.transformer = Transformer(cfg)

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.wte.weight.dtype

    def head(self, h: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        h = t.ln_f(h)
        w = t.wte.weight if self.cfg.weight_tying else t.ff_out.weight
        return F.linear(h, w[: self.cfg.vocab_size])  # drop LLaDA's padded embedding rows

    def forward(self, ids: torch.Tensor, key_mask: Optional[torch.Tensor] = None,
                positions: Optional[torch.Tensor] = None, out_index: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None, return_kv: bool = False):
        """ids (B, L) -> logits (B, L, V), or (B, W, V) at `out_index` (B, W) positions.

        key_mask (B, L) is False at padding keys; with a cache, its own key_mask covers the cached
        keys. positions default to 0..L-1 after the cache; RoPE is relative, so left padding leaves
        real-token logits intact.
        Dream's logit shift is applied here so callers never see it.
        """
        B, L = ids.shape
        past_len = 0 if cache is None else cache.keys[0].shape[2]
        if positions is None:
            positions = torch.arange(past_len, past_len + L, device=ids.device).expand(B, L)
        cos, sin = rope_tables(positions, self.cfg.head_dim, self.cfg.rope_theta)
        if cache is not None:  # keys = cached context, then the fresh positions
            fresh = key_mask if key_mask is not None else torch.ones(B, L, dtype=torch.bool, device=ids.device)
            key_mask = torch.cat([cache.key_mask, fresh], dim=1)
        attn_mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, 1, 1, Lk)
        x = self.transformer.wte(ids)  # (B, L, D)
        kvs = []
        for i, block in enumerate(self.transformer.blocks):
            past = None if cache is None else (cache.keys[i], cache.values[i])
            x, kv = block(x, cos, sin, attn_mask, past)
            kvs.append(kv)
        if self.cfg.logit_shift:  # position p is predicted from hidden state p-1
            x = torch.cat([x[:, :1], x[:, :-1]], dim=1)
        if out_index is not None:
            x = torch.gather(x, 1, out_index[..., None].expand(-1, -1, x.shape[-1]))  # (B, W, D)
        logits = self.head(x)
        return (logits, kvs) if return_kv else logits


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
