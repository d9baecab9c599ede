"""Plain reference forwards for SDAR and LLaDA2-MoE, loading tensors by their published names.

Written from the published modeling files (JetAstra/SDAR `modeling_sdar.py`, inclusionAI
`modeling_llada2_moe.py`), independently of `engine/`. Eager attention, explicit masks, and a
per-layer KV cache of post-norm, post-RoPE keys and values, so a caller can prefill a prefix and
then run a block over the cached context. Shapes: B batch, L fresh positions, Lc cached, D
hidden, H heads, Hk kv heads, Dh head dim, V vocabulary.

Both architectures share the block layout (pre-norm residual attention + MLP, per-head q/k
RMSNorm before RoPE, rotate-half RoPE, GQA, final norm, head with no logit shift). They differ in:
SDAR: separate q/k/v/o projections (`self_attn.*`), q_norm/k_norm, full rotary, dense SwiGLU MLP.
LLaDA2: fused `attention.query_key_value` (q heads | k heads | v heads), query/key_layernorm,
`attention.dense` (+bias if use_bias), partial rotary (first head_dim*partial_rotary_factor dims),
dense MLP in the first `first_k_dense_replace` layers and a sigmoid-routed MoE after.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values, each (B, Hk, Lc, Dh)


def block_causal_mask(q_start: int, n_query: int, n_keys: int, block_length: int) -> torch.Tensor:
    """(n_query, n_keys) bool, True = may attend. Queries sit at absolute positions q_start.., keys
    at 0..n_keys-1; a query sees every key whose block index is <= its own (causal across blocks,
    bidirectional inside a block). Equals the published tril(num_blocks) expanded by block_length."""
    qb = torch.arange(q_start, q_start + n_query) // block_length
    kb = torch.arange(n_keys) // block_length
    return kb[None, :] <= qb[:, None]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32, cast back, then scale (the published Qwen3/LLaDA2 RMSNorm order)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """Rotate-half RoPE on the first rotary_dim dims of x (B, h, L, Dh); the rest pass through.
    The tables are built in float32 and cast to x's dtype before use, as published."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    freqs = positions.float()[..., None] * inv_freq  # (B, L, rd/2) or (L, rd/2)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    if cos.dim() == 3:  # (B, L, rd) -> (B, 1, L, rd)
        cos, sin = cos[:, None], sin[:, None]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Eager GQA attention: q (B, H, L, Dh), k/v (B, Hk, Lk, Dh), mask (L, Lk) bool -> (B, L, H*Dh)."""
    B, H, L, Dh = q.shape
    rep = H // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # kv head j serves q heads j*rep..
    scores = torch.matmul(q, k.transpose(2, 3)) * Dh ** -0.5  # (B, H, L, Lk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v).transpose(1, 2).reshape(B, L, H * Dh)


def swiglu(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w[f"{prefix}.gate_proj.weight"])) * F.linear(x, w[f"{prefix}.up_proj.weight"]),
                    w[f"{prefix}.down_proj.weight"])


class BlockModel:
    """Common skeleton; subclasses give the attention projections, the MLP and the tensor names."""

    embed_name = ""

    def __init__(self, folder: str | Path, dtype: Optional[torch.dtype] = None):
        folder = Path(folder)
        self.cfg = json.loads((folder / "config.json").read_text())
        w = load_file(str(folder / "model.safetensors"))
        self.w = {k: (v.to(dtype) if dtype is not None else v) for k, v in w.items()}
        expected = set(self.expected_names())
        missing, unexpected = expected - set(self.w), set(self.w) - expected
        if missing or unexpected:
            raise ValueError(f"checkpoint names: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
        c = self.cfg
        self.eps = float(c["rms_norm_eps"])
        self.H, self.Hk = c["num_attention_heads"], c["num_key_value_heads"]
        self.Dh = c.get("head_dim") or c["hidden_size"] // self.H
        self.theta = float(c["rope_theta"])
        self.n_layers = c["num_hidden_layers"]
        self.forwards = 0  # every call of forward(), for the generate loops' accounting

    @property
    def dtype(self) -> torch.dtype:
        return self.w[self.embed_name].dtype

    def expected_names(self) -> list[str]:
        raise NotImplementedError

    def qkv(self, i: int, h: torch.Tensor, positions: torch.Tensor):
        raise NotImplementedError

    def attn_out(self, i: int, a: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def head_weight(self) -> torch.Tensor:
        return self.w[self.embed_name] if self.cfg.get("tie_word_embeddings", False) else self.w["lm_head.weight"]

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, past: Optional[KV] = None,
                mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, KV]:
        """ids (B, L) at absolute positions (L,) -> (float32 logits (B, L, V), fresh keys/values).

        past: cached keys/values of positions 0..Lc-1; mask: (L, Lc + L) bool or None (attend to all).
        The fresh keys/values are returned, not stored: the caller decides what to commit.
        """
        self.forwards += 1
        x = F.embedding(ids, self.w[self.embed_name])  # (B, L, D)
        fresh: KV = []
        for i in range(self.n_layers):
            p = f"model.layers.{i}"
            h = rms_norm(x, self.w[f"{p}.input_layernorm.weight"], self.eps)
            q, k, v = self.qkv(i, h, positions)  # post-norm, post-RoPE
            fresh.append((k, v))
            if past is not None:
                k, v = torch.cat([past[i][0], k], dim=2), torch.cat([past[i][1], v], dim=2)
            x = x + self.attn_out(i, attention(q, k, v, mask))
            h = rms_norm(x, self.w[f"{p}.post_attention_layernorm.weight"], self.eps)
            x = x + self.mlp(i, h)
        x = rms_norm(x, self.w["model.norm.weight"], self.eps)
        return F.linear(x, self.head_weight()).float(), fresh

    def forward_full(self, ids: torch.Tensor, block_length: int) -> torch.Tensor:
        """Logits of a whole sequence at positions 0..L-1 under the block-causal mask, no cache."""
        L = ids.shape[1]
        return self.forward(ids, torch.arange(L), None, block_causal_mask(0, L, L, block_length))[0]


class SDARModel(BlockModel):
    embed_name = "model.embed_tokens.weight"

    def expected_names(self) -> list[str]:
        c = self.cfg
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not c.get("tie_word_embeddings", False):
            names.append("lm_head.weight")
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}"
            names += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight",
                      f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight"]
            for n in "qkvo":
                names.append(f"{p}.self_attn.{n}_proj.weight")
                if c.get("attention_bias", False):
                    names.append(f"{p}.self_attn.{n}_proj.bias")
            names += [f"{p}.mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
        return names

    def _lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[f"{name}.weight"], self.w.get(f"{name}.bias"))

    def qkv(self, i, h, positions):
        B, L, _ = h.shape
        p = f"model.layers.{i}.self_attn"
        # Per-head RMSNorm on (B, L, h, Dh) right after the projection, then RoPE (full head_dim).
        q = rms_norm(self._lin(h, f"{p}.q_proj").view(B, L, self.H, self.Dh), self.w[f"{p}.q_norm.weight"], self.eps)
        k = rms_norm(self._lin(h, f"{p}.k_proj").view(B, L, self.Hk, self.Dh), self.w[f"{p}.k_norm.weight"], self.eps)
        v = self._lin(h, f"{p}.v_proj").view(B, L, self.Hk, self.Dh)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return rope(q, positions, self.Dh, self.theta), rope(k, positions, self.Dh, self.theta), v

    def attn_out(self, i, a):
        return self._lin(a, f"model.layers.{i}.self_attn.o_proj")

    def mlp(self, i, h):
        return swiglu(h, self.w, f"model.layers.{i}.mlp")


class LLaDA2Model(BlockModel):
    embed_name = "model.word_embeddings.weight"

    def __init__(self, folder: str | Path, dtype: Optional[torch.dtype] = None):
        super().__init__(folder, dtype)
        c = self.cfg
        self.rotary_dim = int(self.Dh * float(c.get("partial_rotary_factor", 1.0)))
        self.top_k, self.n_group, self.topk_group = c["num_experts_per_tok"], c["n_group"], c["topk_group"]
        self.scaling = float(c["routed_scaling_factor"])

    def is_moe(self, i: int) -> bool:
        return self.cfg.get("num_experts") is not None and i >= self.cfg.get("first_k_dense_replace", 0)

    def expected_names(self) -> list[str]:
        c = self.cfg
        names = ["model.word_embeddings.weight", "model.norm.weight"]
        if not c.get("tie_word_embeddings", False):
            names.append("lm_head.weight")
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}"
            names += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight",
                      f"{p}.attention.query_key_value.weight", f"{p}.attention.dense.weight"]
            if c.get("use_qkv_bias", False):
                names.append(f"{p}.attention.query_key_value.bias")
            if c.get("use_bias", True):
                names.append(f"{p}.attention.dense.bias")
            if c.get("use_qk_norm", False):
                names += [f"{p}.attention.query_layernorm.weight", f"{p}.attention.key_layernorm.weight"]
            mlps = [f"{p}.mlp"]
            if c.get("num_experts") is not None and i >= c.get("first_k_dense_replace", 0):
                names += [f"{p}.mlp.gate.weight", f"{p}.mlp.gate.expert_bias"]
                mlps = [f"{p}.mlp.experts.{e}" for e in range(c["num_experts"])]
                if c.get("num_shared_experts") is not None:
                    mlps.append(f"{p}.mlp.shared_experts")
            names += [f"{m}.{n}_proj.weight" for m in mlps for n in ("gate", "up", "down")]
        return names

    def qkv(self, i, h, positions):
        B, L, _ = h.shape
        p = f"model.layers.{i}.attention"
        qkv = F.linear(h, self.w[f"{p}.query_key_value.weight"], self.w.get(f"{p}.query_key_value.bias"))
        q, k, v = qkv.view(B, L, self.H + 2 * self.Hk, self.Dh).split([self.H, self.Hk, self.Hk], dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, h, L, Dh)
        if self.cfg.get("use_qk_norm", False):
            q = rms_norm(q, self.w[f"{p}.query_layernorm.weight"], self.eps)
            k = rms_norm(k, self.w[f"{p}.key_layernorm.weight"], self.eps)
        return (rope(q, positions, self.rotary_dim, self.theta), rope(k, positions, self.rotary_dim, self.theta), v)

    def attn_out(self, i, a):
        p = f"model.layers.{i}.attention.dense"
        return F.linear(a, self.w[f"{p}.weight"], self.w.get(f"{p}.bias"))

    def route(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h (N, D) -> expert ids (N, k) and float32 weights (N, k), as the published gate.

        logits = h W^T in float32; scores = sigmoid(logits); selection uses scores + expert_bias:
        a group's score is the sum of its 2 best experts, the best topk_group groups stay, then the
        top_k experts among them; weights are the *unbiased* scores of those experts, divided by
        their sum (+1e-20) when top_k > 1, times routed_scaling_factor.
        """
        p = f"model.layers.{i}.mlp.gate"
        logits = F.linear(h.float(), self.w[f"{p}.weight"].float())  # (N, E)
        scores = torch.sigmoid(logits)
        biased = scores + self.w[f"{p}.expert_bias"].float()
        N, E = biased.shape
        group_scores = biased.view(N, self.n_group, E // self.n_group).topk(2, dim=-1).values.sum(-1)  # (N, G)
        groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        keep = keep[:, :, None].expand(N, self.n_group, E // self.n_group).reshape(N, E)
        idx = biased.masked_fill(~keep, float("-inf")).topk(self.top_k, dim=-1).indices  # (N, k)
        weights = scores.gather(1, idx)
        if self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, weights * self.scaling

    def moe(self, i: int, h: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{i}.mlp"
        B, L, D = h.shape
        flat = h.reshape(-1, D)
        idx, weights = self.route(i, flat)
        out = torch.zeros(flat.shape[0], self.top_k, D, dtype=h.dtype)  # each token's k expert outputs
        for e in range(self.cfg["num_experts"]):
            rows, slots = (idx == e).nonzero(as_tuple=True)
            if rows.numel():
                out[rows, slots] = swiglu(flat[rows], self.w, f"{p}.experts.{e}")
        y = (out.to(weights.dtype) * weights[..., None]).sum(dim=1).to(h.dtype)  # weighted, summed over k
        if self.cfg.get("num_shared_experts") is not None:
            y = y + swiglu(flat, self.w, f"{p}.shared_experts")
        return y.view(B, L, D)

    def mlp(self, i, h):
        return self.moe(i, h) if self.is_moe(i) else swiglu(h, self.w, f"model.layers.{i}.mlp")


def load_block_model(folder: str | Path, dtype: Optional[torch.dtype] = None) -> BlockModel:
    arch = json.loads((Path(folder) / "config.json").read_text())["architectures"][0]
    models = {"SDARForCausalLM": SDARModel, "LLaDA2MoeModelLM": LLaDA2Model}
    if arch not in models:
        raise ValueError(f"not a block-diffusion architecture: {arch}")
    return models[arch](folder, dtype)
