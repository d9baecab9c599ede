"""DiffusionGemma's text model: one set of Gemma-4 weights run two ways.

- encode: a causal pass over the prompt, then over each committed canvas, that appends to a KV cache
  (sliding layers keep only the last `sliding_window - 1` positions, global layers keep all);
- denoise: a bidirectional pass over the canvas that reads the cache without writing it, with the
  previous step's tempered logits mixed in (self-conditioning), ending in soft-capped logits.

Every layer: attention (q/k RMSNorm, a scale-free v RMSNorm, RoPE per layer type, attention scale
1.0, global layers reuse the key projection as the value), then a dense GLU MLP and a routed MoE in
parallel on the same residual. The arithmetic follows the reference op for op in float32 (eager
attention, float32 softmax, the experts as transformers' default `grouped_mm` forward), so logits
are bit-identical to it on CPU. Batched requests each run their own forward (`denoise_rows`), so a
row's logits do not depend on the batch.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from celeris.engine.families.revise.config import GemmaConfig, LayerShape


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        h = h * weight.float()
    return h.type_as(x)


def gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu(self.gate_proj(x)) * self.up_proj(x))


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
        """Eager attention, scale 1.0 (the q/k norms set the scale).  bias: (B, 1, Tq, Tk) or None"""
        B, H, T, hd = q.shape
        rep = H // k.shape[1]
        k = k[:, :, None].expand(B, k.shape[1], rep, k.shape[2], hd).reshape(B, H, -1, hd)
        v = v[:, :, None].expand(B, v.shape[1], rep, v.shape[2], hd).reshape(B, H, -1, hd)
        w = torch.matmul(q, k.transpose(2, 3))
        if bias is not None:
            w = w + bias
        w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(w, v).transpose(1, 2).reshape(B, T, H * hd)
        return self.o_proj(out)


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


class Experts(nn.Module):
    def __init__(self, cfg: GemmaConfig):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(cfg.num_experts, 2 * cfg.moe_hidden_size, cfg.d_model))
        self.down_proj = nn.Parameter(torch.zeros(cfg.num_experts, cfg.d_model, cfg.moe_hidden_size))

    def forward(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Each token's k experts, weighed and summed over its k slots in slot order.  x: (N, D), w and
        idx: (N, k) -> (N, D)

        As transformers' default experts forward (`grouped_mm`): the (token, slot) pairs sorted by
        expert, one grouped matmul per projection (each expert's matmul over exactly the rows routed
        to it), then each token's k outputs summed. A row's bits depend only on the rows that share
        its matmuls, so callers that want a row to round as it does alone pass one request's rows."""
        N, k = idx.shape
        flat = idx.reshape(-1)  # (N*k,) token-major
        # (N*k,) by expert, with torch.sort as the reference sorts: a row's place in its group
        # changes its bits (small-M kernels), so the order is the reference's, not a stable one
        order = torch.sort(flat).indices
        # (E,) rows per expert; not torch.bincount, whose output size costs a host sync on a device
        counts = torch.zeros(self.gate_up_proj.shape[0], dtype=torch.long, device=flat.device)
        counts.index_add_(0, flat, torch.ones_like(flat))
        gate, up = grouped_linear(x[order // k], self.gate_up_proj, counts).chunk(2, dim=-1)  # (N*k, I) each
        y = grouped_linear(gelu(gate) * up, self.down_proj, counts) * w.reshape(-1)[order, None]  # (N*k, D)
        out = torch.empty_like(y)
        out[order] = y  # back to (token, slot) order
        return out.view(N, k, -1).sum(dim=1).to(x.dtype)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Consecutive runs of rows, run e through F.linear(rows, weight[e]).  x: (M, D), weight (E, F, D),
    counts (E,) summing to M -> (M, F). torch's grouped matmul does the loop in one call (on the CPU
    it is one mm per group: bit-equal to F.linear over the same rows); older torch loops here. A weight
    packed to FP8 (engine/models/fp8.py's Fp8Grouped, `--quantization fp8`) runs its own grouped matmul."""
    if not isinstance(weight, torch.Tensor):
        return weight.grouped_linear(x, counts)
    if hasattr(torch, "_grouped_mm") and (x.device.type == "cpu" or x.dtype == torch.bfloat16):  # CUDA's: bf16
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=counts.cumsum(0).to(torch.int32))
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        out.append(F.linear(x[start:start + n], weight[e]))
        start += n
    return torch.cat(out)


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

    def feed_forward(self, h: torch.Tensor, scalar: torch.Tensor) -> torch.Tensor:
        """Dense GLU and routed experts in parallel on the post-attention residual.  (B, T, D)"""
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(h)))
        flat = h.reshape(-1, h.shape[-1])
        w, idx = self.router(flat)
        routed = self.experts(self.pre_feedforward_layernorm_2(flat), w, idx).reshape(h.shape)
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

    @property
    def device(self) -> torch.device:
        """Where the weights live: every tensor a request's step makes is made there."""
        return self.embed.weight.device

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.embed.weight
        return F.embedding(ids, w) * torch.tensor(self.cfg.d_model ** 0.5, dtype=w.dtype)

    @torch.no_grad()
    def encode(self, ids: torch.Tensor, cache: KVCache) -> None:
        """Causal pass over new context tokens (the prompt, then each committed canvas).  ids: (1, T)"""
        T = ids.shape[1]
        pos = torch.arange(cache.length, cache.length + T, device=ids.device)
        h = self.embed_ids(ids)
        for i, layer in enumerate(self.layers):
            shape = layer.self_attn.shape
            cos, sin = rope_tables(shape, pos[None])
            q, k, v = layer.self_attn.project(layer.input_layernorm(h), cos, sin)
            k_all, v_all = cache.joined(i, k, v)
            kpos = cache.key_positions(i, T, ids.device)
            allowed = kpos[None, :] <= pos[:, None]  # (T, Tk)
            if shape.sliding:
                allowed &= kpos[None, :] > pos[:, None] - self.cfg.sliding_window
            bias = torch.zeros(allowed.shape, device=ids.device).masked_fill(~allowed, torch.finfo(torch.float32).min)
            a = layer.self_attn.attend(q, k_all, v_all, bias.to(h.dtype)[None, None])
            cache.store(i, k_all, v_all)
            h = h + layer.post_attention_layernorm(a)
            h = layer.feed_forward(h, layer.encoder_layer_scalar)
        cache.length += T  # the encoder's final norm feeds nothing: only its cache is used

    @torch.no_grad()
    def denoise(self, canvas: torch.Tensor, cache: KVCache, sc_probs: Optional[torch.Tensor]) -> torch.Tensor:
        """Bidirectional pass over one request's canvas.  canvas: (1, L), sc_probs: (1, L, V) or None ->
        logits (1, L, V) float32. `sc_probs` is the previous step's softmax of its tempered logits in the
        weights' dtype (sampler.conditioning_input), what the reference forms inside its forward."""
        return self._denoise_one(canvas, cache, None if sc_probs is None else sc_probs[0])

    @torch.no_grad()
    def denoise_rows(self, canvas: torch.Tensor, caches: list[KVCache],
                     sc_probs: list[Optional[torch.Tensor]]) -> torch.Tensor:
        """Several requests' canvases, each reading its own cache and conditioned on its own previous
        step (`denoise`'s sc_probs, (L, V); None on a canvas's first step).  canvas: (B, L) -> (B, L, V)

        Each row runs the very forward it runs alone, so its logits are bitwise the same in any batch
        (issue #40). One forward over the batch cannot promise that on the CPU: a matmul's rounding
        depends on its row count and its operands' memory alignment (MKL picks kernels by both), an
        expert's matmul would run over every row routed to it, and a key axis padded to a longer
        row changes softmax's summation; rounding that self-conditioning then amplifies until the
        canvases diverge. The rows share the step, not the kernels (docs/revising-models.md)."""
        rows = zip(canvas.split(1), caches, sc_probs)
        return torch.cat([self._denoise_one(c, cache, sc) for c, cache, sc in rows])

    def _denoise_one(self, canvas: torch.Tensor, cache: KVCache, sc_probs: Optional[torch.Tensor]) -> torch.Tensor:
        """One request's denoising forward.  canvas: (1, L), sc_probs: (L, V) or None -> (1, L, V)"""
        L = canvas.shape[1]
        pos = torch.arange(cache.length, cache.length + L, device=canvas.device)[None]  # (1, L)
        h = self._conditioned(self.embed_ids(canvas), sc_probs)
        for i, layer in enumerate(self.layers):
            cos, sin = rope_tables(layer.self_attn.shape, pos)
            q, k, v = layer.self_attn.project(layer.input_layernorm(h), cos, sin)
            k_all, v_all = cache.joined(i, k, v)  # read, never stored: the canvas is not context yet
            h = h + layer.post_attention_layernorm(layer.self_attn.attend(q, k_all, v_all, None))
            h = layer.feed_forward(h, layer.layer_scalar)
        h = self.norm(h)
        w = self.embed.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(h, w).float()  # (1, L, V): in bf16 a fresh fp32 copy, so the rest is in place
        cap = self.cfg.logit_softcap
        return logits.div_(cap).tanh_().mul_(cap)  # tanh(logits / cap) * cap, bit for bit, one buffer

    def _conditioned(self, x: torch.Tensor, sc_probs: Optional[torch.Tensor]) -> torch.Tensor:
        """Self-conditioning: the previous step's expected embedding through a GLU, added to the input
        (zeros on a canvas's first step, as the reference masks it).  x: (1, L, D), sc_probs (L, V)"""
        soft = torch.zeros_like(x)
        if sc_probs is not None:
            w = self.embed.weight
            scale = torch.tensor(self.cfg.d_model ** 0.5, dtype=x.dtype)
            soft = torch.matmul(sc_probs[None].to(w.dtype), w) * scale
        signal = self.self_conditioning(self.self_conditioning_pre_norm(soft))
        return rms_norm(x + signal, None, self.cfg.rms_norm_eps)
