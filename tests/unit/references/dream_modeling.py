"""Dream's published forward (Qwen2 layout), op for op, reading tensors by their published names.

Follows Dream-org's `modeling_dream.py` (DreamSdpaAttention, DreamRMSNorm, DreamRotaryEmbedding,
DreamMLP) for the plain forward and NVlabs/Fast-dLLM `dream/model/modeling_dream.py` for the cache-aware
forward (past_key_values, dual_cache + replace_position):

  h -> input_layernorm -> q/k/v_proj (+bias) -> RoPE (in the MODEL dtype) -> SDPA (no causal mask)
    -> o_proj -> +h -> post_attention_layernorm -> down(silu(gate) * up) -> +h  ... then norm -> lm_head

The logits come back UNSHIFTED and in the model dtype, as the published model returns them; Dream's
generate shifts them right by one (position i is predicted from hidden state i-1).
Shapes: B batch, L length, H heads, Hk kv heads, dh head dim.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F

from tests.unit.references.checkpoints import read_checkpoint
from tests.unit.references.llada_modeling import DTYPES


class Output(NamedTuple):
    logits: torch.Tensor  # (B, L, V), model dtype, not shifted
    past_key_values: Optional[list[tuple[torch.Tensor, torch.Tensor]]]  # per layer (B, L, Hk*dh), NOT rotated


class DreamReference:
    """`DreamModel.forward`. Call it like the published code: `model(x, attention_mask, tok_idx).logits`."""

    def __init__(self, folder, dtype: Optional[torch.dtype] = None, device: str = "cpu"):
        cfg, tensors = read_checkpoint(folder)
        if cfg.get("rope_scaling") or cfg.get("use_sliding_window") or cfg.get("hidden_act", "silu") != "silu":
            raise NotImplementedError("reference implements default RoPE, no sliding window, silu only")
        self.cfg = cfg
        self.dtype = dtype or DTYPES[cfg.get("torch_dtype", "float32")]
        self.device = torch.device(device)
        self.w = {k: v.to(device=self.device, dtype=self.dtype) for k, v in tensors.items()}
        if "lm_head.weight" not in self.w:  # tie_word_embeddings
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]
        self.d, self.H = cfg["hidden_size"], cfg["num_attention_heads"]
        self.Hk = cfg.get("num_key_value_heads") or self.H
        self.dh = self.d // self.H
        self.eps = cfg.get("rms_norm_eps", 1e-6)
        # ROPE_INIT_FUNCTIONS["default"]: int64 arange -> float, a float32 buffer that moves with the model.
        base = cfg.get("rope_theta", 10000.0)
        arange = torch.arange(0, self.dh, 2, dtype=torch.int64).float()
        self.inv_freq = (1.0 / (base ** (arange / self.dh))).to(self.device)

    def norm(self, h: torch.Tensor, name: str) -> torch.Tensor:
        # DreamRMSNorm: float32 normalise, cast to the input dtype, THEN weight * h.
        input_dtype = h.dtype
        h = h.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        return self.w[f"{name}.weight"] * h.to(input_dtype)

    def rotary(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # DreamRotaryEmbedding.forward: inv_freq @ positions in float32 (autocast off), cos/sin of
        # cat(freqs, freqs), times attention_scaling (1.0 for default RoPE), CAST TO THE MODEL DTYPE.
        inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        pos = position_ids[:, None, :].float()
        freqs = (inv.float() @ pos.float()).transpose(1, 2)  # (B, L, dh/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * 1.0, emb.sin() * 1.0
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)

    def apply_rope(self, q, k, cos, sin, block_end: Optional[int]):
        # apply_rotary_pos_emb (Fast-dLLM's copy): keys at every position of cos/sin; queries at the
        # last query_len of them, or the query_len ending at block_end_index in dual-cache mode.
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        query_len, key_len = q.shape[-2], k.shape[-2]
        end = key_len if block_end is None else block_end
        q_embed = (q * cos[:, :, end - query_len:end, :]) + (self._rotate_half(q) * sin[:, :, end - query_len:end, :])
        k_embed = (k * cos) + (self._rotate_half(k) * sin)
        return q_embed, k_embed

    def attention(self, p: str, h, attention_mask, cos, sin, past, dual_cache, replace_position):
        bsz, q_len, _ = h.size()
        q = F.linear(h, self.w[f"{p}.q_proj.weight"], self.w[f"{p}.q_proj.bias"])
        k = F.linear(h, self.w[f"{p}.k_proj.weight"], self.w[f"{p}.k_proj.bias"])
        v = F.linear(h, self.w[f"{p}.v_proj.weight"], self.w[f"{p}.v_proj.bias"])
        block_end = None
        if past is not None:  # Fast-dLLM caches the projections (B, L, Hk*dh), before rotation
            past_key, past_value = past
            if dual_cache:  # overwrite the block's columns in place; keys = the whole canvas
                idx = replace_position[0].nonzero(as_tuple=True)[0]  # published: nonzero()[1], B == 1
                past_key[:, idx] = k
                past_value[:, idx] = v
                k, v = past_key, past_value
                block_end = int(idx.max()) + 1
            else:
                k = torch.cat([past_key, k], dim=-2)
                v = torch.cat([past_value, v], dim=-2)
        present = (k, v)
        q = q.view(bsz, q_len, self.H, self.dh).transpose(1, 2)  # (B, H, Lq, dh)
        k = k.view(bsz, -1, self.Hk, self.dh).transpose(1, 2)  # (B, Hk, Lk, dh)
        v = v.view(bsz, -1, self.Hk, self.dh).transpose(1, 2)
        q, k = self.apply_rope(q, k, cos, sin, block_end)
        n_rep = self.H // self.Hk  # repeat_kv: expand + reshape (== repeat_interleave on dim 1)
        if n_rep > 1:
            k = k[:, :, None].expand(bsz, self.Hk, n_rep, k.shape[2], self.dh).reshape(bsz, self.H, -1, self.dh)
            v = v[:, :, None].expand(bsz, self.Hk, n_rep, v.shape[2], self.dh).reshape(bsz, self.H, -1, self.dh)
        mask = attention_mask if isinstance(attention_mask, torch.Tensor) else None  # "full" -> None
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
        a = a.transpose(1, 2).contiguous().view(bsz, q_len, self.d)
        return F.linear(a, self.w[f"{p}.o_proj.weight"]), present

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, attention_mask: Union[None, str, torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, past_key_values: Optional[list] = None,
                use_cache: bool = False, dual_cache: bool = False,
                replace_position: Optional[torch.Tensor] = None) -> Output:
        """attention_mask: None/"full", or Dream's bool (B, 1, Lq, Lk) mask; position_ids: Dream's tok_idx.

        Without a cache, position_ids default to 0..L-1 (Dream-org). With a cache, Fast-dLLM's copy
        ignores position_ids: keys sit at 0..past+L-1 (prefix) or 0..past-1 (dual, past = whole canvas).
        """
        h = F.embedding(input_ids, self.w["model.embed_tokens.weight"])
        if past_key_values is not None:
            past_seen = past_key_values[0][0].shape[1]
            n = past_seen if dual_cache else past_seen + h.shape[1]
            position_ids = torch.arange(n, device=h.device).unsqueeze(0)
        elif position_ids is None:
            position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        cos, sin = self.rotary(h, position_ids)  # shared by every layer
        presents = []
        for i in range(self.cfg["num_hidden_layers"]):
            p = f"model.layers.{i}"
            past = None if past_key_values is None else past_key_values[i]
            residual = h
            h = self.norm(h, f"{p}.input_layernorm")
            h, present = self.attention(f"{p}.self_attn", h, attention_mask, cos, sin, past, dual_cache,
                                        replace_position)
            h = residual + h
            residual = h
            h = self.norm(h, f"{p}.post_attention_layernorm")
            gate = F.linear(h, self.w[f"{p}.mlp.gate_proj.weight"])
            up = F.linear(h, self.w[f"{p}.mlp.up_proj.weight"])
            h = residual + F.linear(F.silu(gate) * up, self.w[f"{p}.mlp.down_proj.weight"])
            presents.append(present)
        h = self.norm(h, "model.norm")
        logits = F.linear(h, self.w["lm_head.weight"])  # no float upcast
        return Output(logits, presents if use_cache else None)

    __call__ = forward
