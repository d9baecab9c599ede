"""Nemotron-Labs-Diffusion's network: a Ministral3 decoder whose attention is causal or bidirectional.

One set of weights serves both: the published model flips every layer's `diffusion_lm` switch
between a causal forward (autoregressive decoding, and the forwards that write the KV cache) and
a bidirectional one (a block being denoised, or drafted, over its cached prefix). Here the switch
is per row of a batch (`Rows.causal`): rows of every mode share one forward. The draft adapter of
self-speculation, a LoRA on each layer's `o_proj`, is applied on the rows that ask for it
(`Rows.lora`), as PEFT's enabled adapter adds it: o_proj(x) + lora_B(lora_A(x)) * scaling.

Modules are named as the checkpoint names its tensors (`encoder.layers.{i}.self_attn.q_proj`,
`diffusion_head`, ...), so loading is by name. Keys/values of every row live in a
`cache.BlockKVStore` (column = absolute position); each row attends over its slot's first k1
columns as views, one SDPA call a row, so a row's bits do not depend on its batch. Shapes: B
rows, W fresh positions a row, D d_model, H / Hk query / key-value heads, Dh head dim, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from celeris.engine.families.nemotron.config import NemotronConfig, inv_freq, query_scale, rope_tables
from celeris.engine.models.attention import RowSpan, attend
from celeris.engine.models.cache import BlockCache
from celeris.engine.models.transformer import RMSNorm


@dataclass(frozen=True)
class Rows:
    """How each row of a forward attends: its real fresh width, the key end (its first fresh
    position + width), causal or bidirectional, and whether the draft adapter is on."""

    width: tuple[int, ...]
    key_end: tuple[int, ...]
    causal: tuple[bool, ...]
    lora: tuple[bool, ...]

    def spans(self) -> list[RowSpan]:
        """Per-row spans: a causal row's query i sees keys up to its own position."""
        out = []
        for w, e, causal in zip(self.width, self.key_end, self.causal):
            allowed = None
            # (w, e): key j visible to query i iff j <= e - w + i. A one-token row gets its (all
            # true) mask too: the masked kernel then computes a query alike in an ar step and in a
            # verify pass, whose masked keys add exact zeros (self-speculation equals ar).
            if causal:
                allowed = torch.arange(e)[None, :] <= (e - w + torch.arange(w))[:, None]
            out.append(RowSpan(0, w, 0, e, allowed))
        return out


class LoRALinear(nn.Linear):
    """A projection that may carry a LoRA adapter (`lora_A` (r, in), `lora_B` (out, r), as PEFT
    stores them), added on the rows asked for."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__(d_in, d_out, bias=False)
        self.lora_A: Optional[torch.Tensor] = None
        self.lora_B: Optional[torch.Tensor] = None
        self.scaling = 1.0

    def attach(self, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        self.lora_A, self.lora_B, self.scaling = a, b, scaling

    def forward_rows(self, x: torch.Tensor, on: Optional[torch.Tensor]) -> torch.Tensor:
        """x (B, W, in) -> (B, W, out); the adapter's delta added on rows `on` (indices)."""
        out = F.linear(x, self.weight)
        if on is None or self.lora_A is None or not len(on):
            return out
        xs = x[on].to(self.lora_A.dtype)
        delta = F.linear(F.linear(xs, self.lora_A), self.lora_B) * self.scaling
        out[on] = out[on] + delta.to(out.dtype)
        return out


class Attention(nn.Module):
    def __init__(self, cfg: NemotronConfig):
        super().__init__()
        d, dh = cfg.d_model, cfg.head_dim
        self.h, self.hk, self.dh = cfg.n_heads, cfg.n_kv_heads, dh
        self.q_proj = nn.Linear(d, cfg.n_heads * dh, bias=False)
        self.k_proj = nn.Linear(d, cfg.n_kv_heads * dh, bias=False)
        self.v_proj = nn.Linear(d, cfg.n_kv_heads * dh, bias=False)
        self.o_proj = LoRALinear(cfg.n_heads * dh, d)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], qscale: torch.Tensor,
                cache: BlockCache, layer: int, spans: list[RowSpan], lora: Optional[torch.Tensor]) -> torch.Tensor:
        B, W, _ = x.shape
        cos, sin = rope
        q = self.q_proj(x).view(B, W, self.h, self.dh).transpose(1, 2)  # (B, H, W, Dh)
        k = self.k_proj(x).view(B, W, self.hk, self.dh).transpose(1, 2)  # (B, Hk, W, Dh)
        v = self.v_proj(x).view(B, W, self.hk, self.dh).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        q = q * qscale.to(q.dtype)  # Llama-4's per-position query scale, after RoPE
        keys, values = cache.attach(layer, k, v)  # per-row views of the slot's columns [0, k1)
        a = attend(q, keys, values, spans, self.h != self.hk)  # (B, H, W, Dh)
        return self.o_proj.forward_rows(a.transpose(1, 2).reshape(B, W, -1), lora)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in the model dtype (transformers' apply_rotary_pos_emb). x (B, H, W, Dh)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class MLP(nn.Module):
    def __init__(self, cfg: NemotronConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.mlp_hidden_size, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.mlp_hidden_size, bias=False)
        self.down_proj = nn.Linear(cfg.mlp_hidden_size, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: NemotronConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class Encoder(nn.Module):
    def __init__(self, cfg: NemotronConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)


class NemotronLM(nn.Module):
    """`forward(ids, positions, cache, rows) -> logits`: one forward over rows of any mode."""

    def __init__(self, cfg: NemotronConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.diffusion_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)  # untied
        freq, scale = inv_freq(cfg)
        self.register_buffer("inv_freq", freq, persistent=False)
        self.rope_scale = scale

    @property
    def dtype(self) -> torch.dtype:
        return self.diffusion_head.weight.dtype

    def kv_store(self, cls, rows: int, max_len: int, **kw):
        """A KV store of class `cls` for this model's key/value heads."""
        return cls(self.cfg, rows, max_len, self.diffusion_head.weight.device, self.dtype, **kw)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: BlockCache, rows: Rows,
                head_at: Optional[torch.Tensor] = None) -> torch.Tensor:
        """ids, positions (B, W) -> logits (B, W, V), or (B, K, V) at columns head_at (B, K)."""
        rope = rope_tables(positions, self.inv_freq, self.rope_scale, self.dtype)
        qscale = query_scale(positions, self.cfg)
        spans = rows.spans()
        on = [i for i, lo in enumerate(rows.lora) if lo]
        lora = torch.tensor(on, dtype=torch.long, device=ids.device) if on else None
        x = self.encoder.embed_tokens(ids)  # (B, W, D)
        for i, layer in enumerate(self.encoder.layers):
            x = x + layer.self_attn(layer.input_layernorm(x), rope, qscale, cache, i, spans, lora)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if head_at is not None:
            x = torch.gather(x, 1, head_at[..., None].expand(-1, -1, x.shape[-1]))  # (B, K, D)
        return self.diffusion_head(self.encoder.norm(x))


__all__ = ["LoRALinear", "NemotronLM", "Rows"]
