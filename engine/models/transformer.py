"""The mask predictor: a LLaMA-style transformer without a causal mask, for every family.

Full-canvas models (LLaDA, Dream) attend bidirectionally over the whole canvas; block-diffusion
models (SDAR, LLaDA2) use the same blocks with q/k norms, an explicit head_dim, partial rotary
and MoE layers where their configs say so, and attend block-causally through the spans their
runner passes. Parameter names follow LLaDA's published checkpoint
(`transformer.blocks.{i}.q_proj`, ...); `weights.py` maps every other family's names onto
them. Shapes: B batch, L sequence, D d_model, H heads, Hk kv heads, Dh head dim, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from celeris.engine.models.attention import RowSpan, Spans, apply_rope, attend, left_padded_spans, rope_tables
from celeris.engine.config import ModelConfig
from celeris.engine.models.moe import MoE


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (bf16 variance loses too much precision), cast back to the model
        # dtype, then scale by the weight in that dtype: LLaDA's and Dream's published op order,
        # which decides the last bits of every bf16 logit.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


@dataclass
class KVCache:
    """Per-layer keys/values of a whole row (Lc columns, already rotated) from an earlier forward.

    A cached forward computes only the `fresh` columns: their keys/values replace the cached
    ones at those columns, and the queries attend over all Lc columns in canvas order — the
    computation of Fast-dLLM's prefix (fresh = block..end) and dual (fresh = block) caches.
    """

    keys: list[torch.Tensor]  # each (B, Hk, Lc, Dh)
    values: list[torch.Tensor]
    key_mask: Optional[torch.Tensor]  # (B, Lc) bool, False for padding; None when there is none
    fresh: torch.Tensor  # (B, F) columns of the fresh positions

    def attach(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys/values with the fresh k, v (B, Hk, F, Dh) at their columns."""
        cols = self.fresh[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])  # (B, Hk, F, Dh)
        return self.keys[layer].scatter(2, cols, k), self.values[layer].scatter(2, cols, v)  # (B, Hk, Lc, Dh)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        d, dh = cfg.d_model, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, dh
        self.rope_fp32 = cfg.rope_fp32
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(d, cfg.n_heads * dh, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, cfg.n_kv_heads * dh, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, cfg.n_kv_heads * dh, bias=cfg.qkv_bias)
        if cfg.qk_norm:  # SDAR / LLaDA2: per-head RMSNorm of q and k, before RoPE
            self.q_norm = RMSNorm(dh, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(dh, cfg.rms_norm_eps)
        self.attn_out = nn.Linear(cfg.n_heads * dh, d, bias=cfg.out_bias)
        self.tp = None  # engine/parallel's group when the projections are sharded (row-parallel outputs reduce)
        self.ff_norm = RMSNorm(d, cfg.rms_norm_eps)
        if cfg.is_moe_layer(layer):
            self.mlp = MoE(cfg)
        else:
            self.ff_proj = nn.Linear(d, cfg.mlp_hidden_size, bias=False)  # gate
            self.up_proj = nn.Linear(d, cfg.mlp_hidden_size, bias=False)
            self.ff_out = nn.Linear(cfg.mlp_hidden_size, d, bias=False)  # down

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask,
                cache=None, layer: int = 0, rows: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x (B, L, D) -> (B, L, D), or (B, K, D) at the columns `rows` (B, K) only: the keys and
        values are every column's, the queries and the MLP only those rows' (a last layer whose
        other columns no one reads; attn_mask then holds K queries a row)."""
        B, L, _ = x.shape
        h = self.attn_norm(x)
        hq, cq, sq = h, cos, sin
        if rows is not None:
            x, hq = _rows(x, rows), _rows(h, rows)
            cq, sq = _rows(cos[:, 0], rows)[:, None], _rows(sin[:, 0], rows)[:, None]
        Lq = hq.shape[1]
        q = self.q_proj(hq).view(B, Lq, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, Lq, Dh)
        k = self.k_proj(h).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hk, L, Dh)
        v = self.v_proj(h).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cq, sq, self.rope_fp32), apply_rope(k, cos, sin, self.rope_fp32)
        new_kv = (k, v)
        if cache is not None:  # fresh keys/values join the cached ones at their columns
            k, v = cache.attach(layer, k, v)
        # No causal mask: every position sees every (non-padding) position.
        a = attend(q, k, v, attn_mask, self.n_heads != self.n_kv_heads)  # (B, H, Lq, Dh)
        x = x + self._reduce(self.attn_out(a.transpose(1, 2).reshape(B, Lq, -1)))
        h = self.ff_norm(x)
        if hasattr(self, "mlp"):  # a sharded MoE combines its ranks' parts itself
            return x + self.mlp(h), new_kv
        x = x + self._reduce(self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h)))
        return x, new_kv

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output: each rank holds a partial sum; one all-reduce."""
        return partial if self.tp is None else self.tp.all_reduce(partial)


def _rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """t (B, L, D) at the columns rows (B, K) -> (B, K, D)."""
    return torch.gather(t, 1, rows[..., None].expand(-1, -1, t.shape[-1]))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.embedding_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.ln_f = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        if not cfg.weight_tying:
            self.ff_out = nn.Linear(cfg.d_model, cfg.embedding_size, bias=False)


class MaskPredictor(nn.Module):
    """`forward(ids) -> logits`: the probability of each vocabulary token at every position."""

    def __init__(self, cfg: ModelConfig, shard: Optional[ModelConfig] = None):
        """`shard`: the shapes of this rank's slice under tensor parallelism (engine/parallel);
        `cfg` stays the whole model's description either way."""
        super().__init__()
        self.cfg = cfg
        self.shard_cfg = shard or cfg
        self.transformer = Transformer(self.shard_cfg)
        self.tp = None  # engine/parallel's group: vocabulary-parallel embedding and head

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.wte.weight.dtype

    def kv_store(self, cls, rows: int, max_len: int, **kw):
        """A KV cache store of class `cls` for this model's (shard's) key/value heads."""
        return cls(self.shard_cfg, rows, max_len, self.transformer.wte.weight.device, self.dtype, **kw)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        h = t.ln_f(h)
        w = t.wte.weight if self.cfg.weight_tying else t.ff_out.weight
        if self.tp is None:
            logits = F.linear(h, w[: self.cfg.vocab_size])  # drop LLaDA's padded embedding rows
        else:  # each rank's vocabulary slice, gathered in rank order: (..., embedding_size)
            logits = self.tp.gather_last(F.linear(h, w))[..., : self.cfg.vocab_size]
        if self.cfg.scale_logits:  # LLaDA's option, in place after the head as published
            logits = logits * (1 / math.sqrt(self.cfg.d_model))
        return logits.float() if self.cfg.logits_fp32 else logits

    def forward(self, ids: torch.Tensor, key_mask: Optional[torch.Tensor] = None,
                positions: Optional[torch.Tensor] = None, out_index: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None, return_kv: bool = False,
                spans: Optional[list[RowSpan] | Spans] = None, head: bool = True,
                head_rows: Optional[int] = None):
        """ids (B, L) -> logits (B, L, V), or (B, W, V) at `out_index` (B, W) positions.

        key_mask (B, L) is False at (left) padding keys; None means no padding, which keeps the
        attention call the published code's own. positions count from each row's first real
        token (as the published models see an unpadded prompt), so a row's logits and cached
        keys do not depend on how far it is padded. With a cache, ids are the fresh columns
        `cache.fresh` of the cached rows and positions must be given. `spans` (block models)
        say per row which queries and keys are real and may meet (a list: row by row; `Spans`:
        one masked kernel of static shape, with a `cache.BlockCache`); head=False skips the head
        (a prefill only wants the keys/values), head_rows=n runs it on the first n rows only (a
        block step's prefill rows follow the rows that select).
        Dream's logit shift is applied here so callers never see it.
        """
        B, L = ids.shape
        if positions is None:
            if cache is not None:
                raise ValueError("a cached forward needs the fresh columns' positions")
            positions = (torch.arange(L, device=ids.device).expand(B, L) if key_mask is None
                         else (key_mask.long().cumsum(-1) - 1).clamp_min(0))
        cos, sin = rope_tables(positions, self.cfg.rotary_dim, self.cfg.rope_theta)
        if cache is not None:
            key_mask = cache.key_mask
        attn_mask: Optional[torch.Tensor | list[RowSpan] | Spans] = None
        cpu = ids.device.type == "cpu"
        if spans is not None:
            attn_mask = spans
        elif key_mask is not None and cpu:  # row by row: batch-invariant bits
            attn_mask = left_padded_spans(key_mask, L)
        elif key_mask is not None:  # one masked kernel for the batch (GPU; CUDA graphs)
            attn_mask = key_mask[:, None, None, :]  # (B, 1, 1, Lk)
        wte = self.transformer.wte
        x = wte(ids) if self.tp is None else self.tp.embed(wte, ids)  # (B, L, D)
        if self.cfg.input_emb_norm:  # LLaDA's option: scale embeddings by sqrt(d_model)
            x = x * (self.cfg.d_model ** 0.5)
        # On the CPU a plain forward's last layer runs its queries and MLP only at the columns
        # read (`Block.forward`'s rows): the same bits there (row counts stay multiples of
        # ROW_ALIGN; each query row's attention is its own), a fraction of the layer's work.
        last_rows = None
        if out_index is not None and cpu and cache is None and spans is None:
            last_rows = (out_index - 1).clamp_min(0) if self.cfg.logit_shift else out_index  # Dream: p from p-1
        kvs = []
        n = len(self.transformer.blocks)
        for i, block in enumerate(self.transformer.blocks):
            if i == n - 1 and last_rows is not None:
                mask = attn_mask if not isinstance(attn_mask, list) else [
                    RowSpan(0, last_rows.shape[1], s.k0, s.k1) for s in attn_mask]
                x, kv = block(x, cos, sin, mask, cache, i, rows=last_rows)
            else:
                x, kv = block(x, cos, sin, attn_mask, cache, i)
            kvs.append(kv)
        if last_rows is None:
            if self.cfg.logit_shift:  # position p is predicted from hidden state p-1
                x = torch.cat([x[:, :1], x[:, :-1]], dim=1)
            if out_index is not None:
                x = _rows(x, out_index)  # (B, W, D)
        if head_rows is not None:
            x = x[:head_rows]
        logits = self.head(x) if head and x.shape[0] else None
        return (logits, kvs) if return_kv else logits


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
