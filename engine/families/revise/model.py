"""DiffusionGemma's text model: one set of Gemma-4 weights run two ways.

- encode: a causal pass over the prompt, then over each committed canvas, that appends to a KV cache
  (sliding layers keep only the last `sliding_window - 1` positions, global layers keep all);
- denoise: a bidirectional pass over the canvas that reads the cache without writing it, with the
  previous step's tempered logits mixed in (self-conditioning), ending in soft-capped logits.

Every layer: attention (q/k RMSNorm, a scale-free v RMSNorm, RoPE per layer type, attention scale
1.0, global layers reuse the key projection as the value), then a dense GLU MLP and a routed MoE in
parallel on the same residual. The arithmetic follows the reference op for op in float32 (eager
attention, float32 softmax, the experts as transformers' default `grouped_mm` forward), so logits
are bit-identical to it on CPU. Several requests run in one forward (`encode_rows`, `denoise_rows`),
each row computed as it is alone, so a row's logits do not depend on the batch (rows.py says how).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from celeris.engine.families.revise.config import GemmaConfig, LayerShape
from celeris.engine.families.revise.experts import Experts, unreduced
from celeris.engine.families.revise.rows import Packed, gelu_rows, packs


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        h = h * weight.float()
    return h.type_as(x)


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class GLU(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)
        self.reduce = unreduced  # tensor parallel: the down projection's partial sums, all-reduced

    def forward(self, x: torch.Tensor, rows: Packed) -> torch.Tensor:
        """x (1, N, D), each request's GELU on its own rows (rows.py) -> (1, N, D)"""
        return self.reduce(self.down_proj(gelu_rows(self.gate_proj(x), rows) * self.up_proj(x)))


def rope_tables(shape: LayerShape, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin over the whole head; a global layer's unrotated part has frequency 0.  (B, T) -> (B, T, hd)"""
    hd = shape.head_dim
    n_rot = int(shape.rotary_fraction * hd // 2)
    dev = positions.device
    inv = 1.0 / (shape.rope_theta ** (torch.arange(0, 2 * n_rot, 2, dtype=torch.float, device=dev) / hd))
    inv = torch.cat([inv, torch.zeros(hd // 2 - n_rot, device=dev)])
    freqs = positions[..., None].float() * inv
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, T, H, hd); cos/sin: (B, T, hd) float32, cast to x's dtype as the reference casts them (in
    bf16 q and k stay bf16, as v is; float32 is unchanged)"""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos[:, :, None] + turned * sin[:, :, None]


class Attention(nn.Module):
    def __init__(self, cfg: GemmaConfig, shape: LayerShape):
        super().__init__()
        self.shape, self.n_heads, self.eps = shape, cfg.n_heads, cfg.rms_norm_eps
        hd, kvh = shape.head_dim, shape.n_kv_heads
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, kvh * hd, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, kvh * hd, bias=False) if shape.sliding else None
        self.o_proj = nn.Linear(cfg.n_heads * hd, cfg.d_model, bias=False)
        self.q_norm = Norm(hd, cfg.rms_norm_eps)
        self.k_norm = Norm(hd, cfg.rms_norm_eps)
        self.reduce = unreduced  # tensor parallel: the output projection's partial sums, all-reduced

    def out(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The output projection of each request's attention, packed back.  (1, T_r, H * hd) each -> (1, N, D)"""
        return self.reduce(self.o_proj(torch.cat(parts, 1)))

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q (B, H, T, hd), k and v (B, KVH, T, hd)"""
        B, T, _ = x.shape
        hd = self.shape.head_dim
        q = rotate(self.q_norm(self.q_proj(x).view(B, T, -1, hd)), cos, sin).transpose(1, 2)
        k_raw = self.k_proj(x).view(B, T, -1, hd)
        v_raw = self.v_proj(x).view(B, T, -1, hd) if self.v_proj is not None else k_raw
        k = rotate(self.k_norm(k_raw), cos, sin).transpose(1, 2)
        v = rms_norm(v_raw, None, self.eps).transpose(1, 2)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """Eager attention, scale 1.0 (the q/k norms set the scale), before the output projection.
        q (B, H, T, hd), k and v (B, KVH, Tk, hd), bias (B, 1, T, Tk) or None -> (B, T, H * hd)"""
        B, H, T, hd = q.shape
        rep = H // k.shape[1]
        k = k[:, :, None].expand(B, k.shape[1], rep, k.shape[2], hd).reshape(B, H, -1, hd)
        v = v[:, :, None].expand(B, v.shape[1], rep, v.shape[2], hd).reshape(B, H, -1, hd)
        w = torch.matmul(q, k.transpose(2, 3))
        if bias is not None:
            w = w + bias
        w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(w, v).transpose(1, 2).reshape(B, T, H * hd)


class Router(nn.Module):
    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.d_model, cfg.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.d_model))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))
        self.k, self.eps, self.root = cfg.experts_per_token, cfg.rms_norm_eps, cfg.d_model ** -0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, D) -> weights (N, k), expert ids (N, k)"""
        h = rms_norm(x, None, self.eps) * self.scale * self.root
        probs = torch.softmax(self.proj(h), dim=-1, dtype=torch.float32)
        w, idx = torch.topk(probs, k=self.k, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        return w * self.per_expert_scale[idx], idx


class Layer(nn.Module):
    def __init__(self, cfg: GemmaConfig, shape: LayerShape):
        super().__init__()
        eps, d = cfg.rms_norm_eps, cfg.d_model
        self.self_attn = Attention(cfg, shape)
        self.mlp = GLU(d, cfg.mlp_hidden_size)
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                  "pre_feedforward_layernorm_2"):
            setattr(self, n, Norm(d, eps))
        # The encoder and the denoiser share every weight but this one (the published folder has both).
        self.register_buffer("layer_scalar", torch.ones(1))
        self.register_buffer("encoder_layer_scalar", torch.ones(1))

    def feed_forward(self, h: torch.Tensor, scalar: torch.Tensor, rows: Packed) -> torch.Tensor:
        """Dense GLU and routed experts in parallel on the post-attention residual.  (1, N, D)"""
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(h), rows))
        flat = h.reshape(-1, h.shape[-1])
        w, idx = self.router(flat)
        routed = self.experts(self.pre_feedforward_layernorm_2(flat), w, idx, rows).reshape(h.shape)
        out = h + self.post_feedforward_layernorm(dense + self.post_feedforward_layernorm_2(routed))
        return out * scalar


class KVCache:
    """One request's encoded context: per layer keys and values (1, KVH, T, hd) and their positions.
    Sliding layers drop what falls out of the window after each encode, as the reference's cache does."""

    def __init__(self, cfg: GemmaConfig):
        self.cfg = cfg
        self.k: list[Optional[torch.Tensor]] = [None] * cfg.n_layers
        self.v: list[Optional[torch.Tensor]] = [None] * cfg.n_layers
        self.length = 0  # positions encoded so far

    def joined(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k[i] is None:
            return k, v
        return torch.cat([self.k[i], k], dim=2), torch.cat([self.v[i], v], dim=2)

    def store(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.cfg.layers[i].sliding:
            keep = self.cfg.cache_keep
            k, v = k[:, :, -keep:], v[:, :, -keep:]
        self.k[i], self.v[i] = k, v

    def key_positions(self, i: int, new: int, device: torch.device) -> torch.Tensor:
        """Absolute positions of layer i's cached keys followed by `new` fresh ones.  (Tk,)"""
        cached = 0 if self.k[i] is None else self.k[i].shape[2]
        return torch.arange(self.length - cached, self.length + new, device=device)


@dataclass
class ForwardCounts:
    """Forwards a model has run, by pass (a runner reads each step's difference: its step stats)."""

    encode: int = 0
    denoise: int = 0


class DiffusionGemma(nn.Module):
    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Layer(cfg, s) for s in cfg.layers)
        self.norm = Norm(cfg.d_model, cfg.rms_norm_eps)
        self.self_conditioning = GLU(cfg.d_model, cfg.mlp_hidden_size)
        self.self_conditioning_pre_norm = Norm(cfg.d_model, cfg.rms_norm_eps)
        self.lm_head = None if cfg.weight_tying else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # Several requests in one forward (rows.py). None: where a row keeps its bits in any batch, the
        # CPU; on CUDA each request runs its own forward unless the server asks for the shared one.
        self.shared_forward: Optional[bool] = None
        self.calls = ForwardCounts()

    @property
    def device(self) -> torch.device:
        """Where the weights live: every tensor a request's step makes is made there."""
        return self.embed.weight.device

    @property
    def shares_forwards(self) -> bool:
        return self.device.type == "cpu" if self.shared_forward is None else self.shared_forward

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.embed.weight
        return F.embedding(ids, w) * torch.tensor(self.cfg.d_model ** 0.5, dtype=w.dtype)

    @torch.no_grad()
    def encode(self, ids: torch.Tensor, cache: KVCache) -> None:
        """Causal pass over one request's new context tokens.  ids: (1, T)"""
        self.encode_rows([ids[0]], [cache])

    @torch.no_grad()
    def encode_rows(self, ids: list[torch.Tensor], caches: list[KVCache]) -> None:
        """Causal pass over new context tokens (a prompt, a committed canvas) of several requests, each
        appended to its own cache: one forward per pack (rows.packs).  ids: (T_r,) each"""
        for pack in packs([len(t) for t in ids], self.shares_forwards):
            self._encode([ids[r] for r in pack], [caches[r] for r in pack])
            self.calls.encode += 1

    def _encode(self, ids: list[torch.Tensor], caches: list[KVCache]) -> None:
        rows = Packed(tuple(len(t) for t in ids))
        pos = torch.cat([torch.arange(c.length, c.length + len(t), device=t.device) for t, c in zip(ids, caches)])
        h = self.embed_ids(torch.cat(ids)[None])  # (1, N, D)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            cos, sin = rope_tables(attn.shape, pos[None])
            q, k, v = attn.project(layer.input_layernorm(h), cos, sin)  # (1, H, N, hd), (1, KVH, N, hd) x2
            parts = []
            for q_r, k_r, v_r, p, cache in zip(*(rows.split(t, 2) for t in (q, k, v)), rows.split(pos, 0), caches):
                k_all, v_all = cache.joined(i, k_r, v_r)
                parts.append(attn.attend(q_r, k_all, v_all, self._causal(cache, i, p, h.dtype)))
                cache.store(i, k_all, v_all)
            h = h + layer.post_attention_layernorm(attn.out(parts))
            h = layer.feed_forward(h, layer.encoder_layer_scalar, rows)
        for cache, n in zip(caches, rows.lengths):
            cache.length += n  # the encoder's final norm feeds nothing: only its cache is used

    def _causal(self, cache: KVCache, i: int, pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Layer i's additive mask for fresh positions `pos` (T,) over the cache and themselves (before
        they are stored): causal, and within the window on a sliding layer.  -> (1, 1, T, Tk)"""
        kpos = cache.key_positions(i, pos.shape[0], pos.device)
        allowed = kpos[None, :] <= pos[:, None]  # (T, Tk)
        if self.cfg.layers[i].sliding:
            allowed &= kpos[None, :] > pos[:, None] - self.cfg.sliding_window
        bias = torch.zeros(allowed.shape, device=pos.device).masked_fill(~allowed, torch.finfo(torch.float32).min)
        return bias.to(dtype)[None, None]

    @torch.no_grad()
    def denoise(self, canvas: torch.Tensor, cache: KVCache, sc_probs: Optional[torch.Tensor]) -> torch.Tensor:
        """Bidirectional pass over one request's canvas.  canvas: (1, L), sc_probs: (1, L, V) or None ->
        logits (1, L, V) float32. `sc_probs` is the previous step's softmax of its tempered logits in the
        weights' dtype (sampler.conditioning_input), what the reference forms inside its forward."""
        return self.denoise_rows(canvas, [cache], [None if sc_probs is None else sc_probs[0]])

    @torch.no_grad()
    def denoise_rows(self, canvas: torch.Tensor, caches: list[KVCache],
                     sc_probs: list[Optional[torch.Tensor]]) -> torch.Tensor:
        """Several requests' canvases, each reading its own cache and conditioned on its own previous
        step (`denoise`'s sc_probs, (L, V); None on a canvas's first step).  canvas: (B, L) -> (B, L, V)"""
        h = self.denoise_hidden(canvas, caches, sc_probs)
        return torch.cat([self.head(h[r:r + 1]) for r in range(h.shape[0])])

    @torch.no_grad()
    def denoise_hidden(self, canvas: torch.Tensor, caches: list[KVCache], sc_probs: list[Optional[torch.Tensor]],
                       soft: Optional[list[Optional[torch.Tensor]]] = None) -> torch.Tensor:
        """`denoise_rows` up to the final norm: one forward for every row (per pack, rows.packs), each
        row's bits those it gets alone (rows.py). `head` makes a row's logits: a row at a time, so one
        (L, V) buffer is live, not B. `soft`: the rows' `soft_inputs`, when already made (a worker
        rank gets them, not the probabilities).  canvas: (B, L) -> (B, L, D)"""
        B, L = canvas.shape
        soft = self.soft_inputs(sc_probs) if soft is None else soft
        out: list[Optional[torch.Tensor]] = [None] * B
        for pack in packs([L] * B, self.shares_forwards):
            h = self._denoise(canvas[pack], [caches[r] for r in pack], [soft[r] for r in pack])
            for j, r in enumerate(pack):
                out[r] = h[j]
            self.calls.denoise += 1
        return torch.stack(out) if B > 1 else out[0][None]

    @torch.no_grad()
    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Soft-capped logits of one request's final hidden states.  (1, L, D) -> (1, L, V) float32"""
        w = self.embed.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(h, w).float()  # (1, L, V): in bf16 a fresh fp32 copy, so the rest is in place
        cap = self.cfg.logit_softcap
        return logits.div_(cap).tanh_().mul_(cap)  # tanh(logits / cap) * cap, bit for bit, one buffer

    def _denoise(self, canvas: torch.Tensor, caches: list[KVCache],
                 soft: list[Optional[torch.Tensor]]) -> torch.Tensor:
        """One forward over a pack of canvases.  canvas: (R, L), soft: (L, D) or None each -> (R, L, D)"""
        R, L = canvas.shape
        rows = Packed((L,) * R)
        pos = torch.cat([torch.arange(c.length, c.length + L, device=canvas.device) for c in caches])[None]  # (1, N)
        h = self._conditioned(self.embed_ids(canvas.reshape(1, -1)), soft, rows)  # (1, N, D)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            cos, sin = rope_tables(attn.shape, pos)
            q, k, v = attn.project(layer.input_layernorm(h), cos, sin)
            # each row reads its own cache, never stored: the canvas is not context yet
            parts = [attn.attend(q_r, *cache.joined(i, k_r, v_r), None)
                     for q_r, k_r, v_r, cache in zip(*(rows.split(t, 2) for t in (q, k, v)), caches)]
            h = h + layer.post_attention_layernorm(attn.out(parts))
            h = layer.feed_forward(h, layer.layer_scalar, rows)
        return self.norm(h).view(R, L, -1)

    def soft_inputs(self, sc_probs: list[Optional[torch.Tensor]]) -> list[Optional[torch.Tensor]]:
        """Each row's expected embedding under its previous step's probabilities (None on a canvas's
        first step): a row at a time, (L, V) @ (V, D), as alone, with no (B, L, V) stack.  -> (L, D) each"""
        w = self.embed.weight
        scale = torch.tensor(self.cfg.d_model ** 0.5, dtype=w.dtype)
        return [None if sc is None else (torch.matmul(sc[None].to(w.dtype), w) * scale)[0] for sc in sc_probs]

    def _conditioned(self, x: torch.Tensor, soft_rows: list[Optional[torch.Tensor]], rows: Packed) -> torch.Tensor:
        """Self-conditioning: the previous step's expected embedding through a GLU, added to the input
        (zeros on a canvas's first step, as the reference masks it).  x: (1, N, D), soft_rows (L, D) each"""
        soft = torch.zeros_like(x)
        for part, row in zip(rows.split(soft), soft_rows):
            if row is not None:
                part.copy_(row[None])
        signal = self.self_conditioning(self.self_conditioning_pre_norm(soft), rows)
        return rms_norm(x + signal, None, self.cfg.rms_norm_eps)
