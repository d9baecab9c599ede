"""LLaDA's published forward, op for op, reading tensors by their published names.

Follows `modeling_llada.py` of GSAI-ML/LLaDA-8B-Instruct (the 2025-10-21 version, which takes an
attention_mask) for the plain forward, and NVlabs/Fast-dLLM `llada/model/modeling_llada.py` for the
cache-aware forward (past_key_values, replace_position). Both share LLaDALlamaBlock:

  x -> attn_norm -> q/k/v_proj -> RoPE -> SDPA (no causal mask) -> attn_out -> +x
    -> ff_norm -> act(ff_proj) * up_proj -> ff_out -> +x            ... n_layers, then ln_f -> ff_out|wte

Everything runs in the checkpoint dtype (from_pretrained(torch_dtype=...) casts every tensor), except
where the published code upcasts: RMSLayerNorm normalises in float32, and with rope_full_precision
q/k are rotated in float32. Shapes: B batch, T/L length, H heads, Hk kv heads, hs head dim.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from tests.unit.references.checkpoints import read_checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Output(NamedTuple):
    logits: torch.Tensor  # (B, T, embedding_size), in the model dtype
    past_key_values: Optional[list[tuple[torch.Tensor, torch.Tensor]]]  # per layer (B, Hk, L, hs), NOT rotated


def _unsupported(cfg: dict) -> list[str]:
    """Config values whose published behaviour this reference does not implement."""
    want = {"block_type": "llama", "layer_norm_type": "rms", "activation_type": "silu", "rope": True,
            "alibi": False, "attention_layer_norm": False, "block_group_size": 1, "layer_norm_with_affine": True}
    return [f"{k}={cfg.get(k, v)!r}" for k, v in want.items() if cfg.get(k, v) != v]


class LLaDAReference:
    """`LLaDAModelLM.forward` of the published code. Call it like the published model: `model(x).logits`."""

    def __init__(self, folder, dtype: Optional[torch.dtype] = None, device: str = "cpu"):
        cfg, tensors = read_checkpoint(folder)
        bad = _unsupported(cfg)
        if bad:
            raise NotImplementedError(f"reference does not implement {', '.join(bad)}")
        self.cfg = cfg
        self.dtype = dtype or DTYPES[cfg.get("torch_dtype", "float32")]
        self.device = torch.device(device)
        self.w = {k: v.to(device=self.device, dtype=self.dtype) for k, v in tensors.items()}
        self.d, self.H = cfg["d_model"], cfg["n_heads"]
        # config.effective_n_kv_heads
        self.Hk = 1 if cfg.get("multi_query_attention") else (cfg.get("n_kv_heads") or self.H)
        self.hs = self.d // self.H
        self.n_layers = cfg["n_layers"]
        self.eps = cfg.get("rms_norm_eps", 1e-5)
        self.include_bias = bool(cfg.get("include_bias", False))
        self.qkv_bias = self.include_bias or bool(cfg.get("include_qkv_bias", False))
        nb = cfg.get("bias_for_layer_norm")
        self.norm_bias = self.include_bias if nb is None else bool(nb)  # LayerNormBase: None -> include_bias
        self.rope_full_precision = bool(cfg.get("rope_full_precision", True))
        # RotaryEmbedding.__init__ warms its BufferCache at max_sequence_length on the init device, which
        # LLaDAModelLM sets to "cpu": the sin/cos table is computed on the CPU and moved to the device.
        self._rope = self._rope_table(cfg.get("max_sequence_length", 4096), torch.device("cpu"))

    # ------------------------------------------------------------------ pieces
    def _rope_table(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # RotaryEmbedding.get_rotary_embedding: float32, positions 0..seq_len-1.
        dim = self.hs
        theta = self.cfg.get("rope_theta", 10000.0)
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float) / dim))
        seq = torch.arange(seq_len, device=device, dtype=torch.float)
        freqs = torch.einsum("i , j -> i j", seq, inv_freq)
        positions = torch.cat((freqs, freqs), dim=-1)
        return positions.sin()[None, None, :, :], positions.cos()[None, None, :, :]  # (1, 1, L, hs)

    def _rope_sin_cos(self, key_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        sin, cos = self._rope
        if sin.shape[-2] < key_len:  # the published cache recomputes on the device when too short
            sin, cos = self._rope = self._rope_table(key_len, self.device)
        if sin.device != self.device:
            sin, cos = self._rope = (sin.to(self.device), cos.to(self.device))
        return sin[:, :, :key_len, :], cos[:, :, :key_len, :]

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        # RMSLayerNorm.forward: normalise in float32, cast back to the input dtype, THEN weight * x (+ bias).
        og_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        x = x.to(og_dtype)
        out = self.w[f"{name}.weight"] * x
        return out + self.w[f"{name}.bias"] if self.norm_bias else out

    def linear(self, x: torch.Tensor, name: str, bias: bool) -> torch.Tensor:
        return F.linear(x, self.w[f"{name}.weight"], self.w[f"{name}.bias"] if bias else None)

    @staticmethod
    def _rotate_half(t: torch.Tensor) -> torch.Tensor:
        # RotaryEmbedding.rotate_half: view (..., 2, hs/2), (x1, x2) -> cat(-x2, x1)
        B, nh, T, hs = t.size()
        x1, x2 = t.view(B, nh, T, 2, hs // 2).unbind(dim=-2)
        return torch.cat((-x2, x1), dim=-1)

    def _apply_rope(self, sin: torch.Tensor, cos: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return ((t * cos) + (self._rotate_half(t) * sin)).to(t.dtype)

    def rope(self, q: torch.Tensor, k: torch.Tensor, block_end: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
        # RotaryEmbedding.forward: with rope_full_precision q, k go to float32 first; keys are rotated at
        # 0..key_len-1, queries at the LAST query_len of those (or, with replace_position, at the
        # query_len positions ending at block_end_index = last replaced position + 1).
        q_, k_ = (q.float(), k.float()) if self.rope_full_precision else (q, k)
        query_len, key_len = q_.shape[-2], k_.shape[-2]
        sin, cos = self._rope_sin_cos(key_len)
        sin, cos = sin.type_as(q_), cos.type_as(q_)
        end = key_len if block_end is None else block_end
        q_ = self._apply_rope(sin[:, :, end - query_len:end, :], cos[:, :, end - query_len:end, :], q_)
        k_ = self._apply_rope(sin, cos, k_)
        return q_.type_as(q), k_.type_as(k)

    # ------------------------------------------------------------------ attention and block
    def attention(self, p: str, q, k, v, attention_bias, layer_past, replace_position):
        B, T, C = q.size()
        dtype = k.dtype
        q = q.view(B, T, self.H, self.hs).transpose(1, 2)  # (B, H, T, hs)
        k = k.view(B, T, self.Hk, self.hs).transpose(1, 2)  # (B, Hk, T, hs)
        v = v.view(B, T, self.Hk, self.hs).transpose(1, 2)
        block_end = None
        if layer_past is not None:
            past_key, past_value = layer_past
            if replace_position is None:  # prefix cache: cached keys first, fresh ones after
                k = torch.cat((past_key, k), dim=-2)
                v = torch.cat((past_value, v), dim=-2)
            else:  # dual cache: overwrite the block's columns IN PLACE, attend over the whole canvas
                # Fast-dLLM takes replace_position.nonzero()[1], which is only well-formed for B == 1;
                # row 0's columns are the same thing for a batch of equal-length rows.
                idx = replace_position[0].nonzero(as_tuple=True)[0]
                past_key[:, :, idx] = k
                past_value[:, :, idx] = v
                k, v = past_key, past_value
                block_end = int(idx.max()) + 1
        present = (k, v)  # cached BEFORE rotation; rotation is redone on the whole key set every call
        query_len, key_len = q.shape[-2], k.shape[-2]
        q, k = self.rope(q, k, block_end)
        if attention_bias is not None:  # LLaDABlock._cast_attn_bias: to k's dtype, -inf -> finfo.min
            attention_bias = attention_bias[:, :, key_len - query_len:key_len, :key_len]
            if attention_bias.dtype != dtype:
                attention_bias = attention_bias.to(dtype)
                attention_bias.masked_fill_(attention_bias == float("-inf"), torch.finfo(dtype).min)
        if self.H != self.Hk:  # "torch's sdpa doesn't support GQA": repeat_interleave the kv heads
            k = k.repeat_interleave(self.H // self.Hk, dim=1, output_size=self.H)
            v = v.repeat_interleave(self.H // self.Hk, dim=1, output_size=self.H)
        att = _sdpa(q, k, v, attention_bias)  # (B, H, T, hs), is_causal=False
        att = att.transpose(1, 2).contiguous().view(B, T, C)
        return self.linear(att, f"{p}.attn_out", self.include_bias), present

    def block(self, i: int, x, attention_bias, layer_past, replace_position):
        p = f"model.transformer.blocks.{i}"
        x_normed = self.norm(x, f"{p}.attn_norm")
        q = self.linear(x_normed, f"{p}.q_proj", self.qkv_bias)
        k = self.linear(x_normed, f"{p}.k_proj", self.qkv_bias)
        v = self.linear(x_normed, f"{p}.v_proj", self.qkv_bias)
        att, cache = self.attention(p, q, k, v, attention_bias, layer_past, replace_position)
        x = x + att
        og_x = x
        x = self.norm(x, f"{p}.ff_norm")
        x, x_up = self.linear(x, f"{p}.ff_proj", self.include_bias), self.linear(x, f"{p}.up_proj", self.include_bias)
        x = F.silu(x)  # activation_type "silu" -> nn.SiLU
        x = x * x_up
        x = self.linear(x, f"{p}.ff_out", self.include_bias)
        return og_x + x, cache

    # ------------------------------------------------------------------ model
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                past_key_values: Optional[list] = None, use_cache: bool = False,
                replace_position: Optional[torch.Tensor] = None) -> Output:
        """LLaDAModel.forward. attention_mask (B, L) 1 = keep (GSAI-ML's padding support; Fast-dLLM's
        cache-aware copy passes attn_mask=None to SDPA, so no mask is allowed together with a cache)."""
        B, T = input_ids.shape
        x = F.embedding(input_ids, self.w["model.transformer.wte.weight"])  # (B, T, d) in the model dtype
        if self.cfg.get("input_emb_norm"):
            x = x * (self.d ** 0.5)
        attention_bias = None
        if attention_mask is not None and 0.0 in attention_mask:
            if past_key_values is not None:
                raise ValueError("Fast-dLLM's cached forward ignores attention masks; no padding with a cache")
            # float mask (B, 1, 1, L): 0 where kept, float32 min where padded, added to a zero
            # (bidirectional) bias (1, 1, L, L); then ensure_finite_.
            m = attention_mask.to(dtype=torch.float).view(B, -1)[:, None, None, :]
            m = (1.0 - m) * torch.finfo(m.dtype).min
            L = m.shape[-1]
            attention_bias = torch.zeros((1, 1, L, L), device=x.device, dtype=torch.float) + m
            attention_bias.masked_fill_(attention_bias == float("-inf"), torch.finfo(attention_bias.dtype).min)
        presents = []
        for i in range(self.n_layers):
            layer_past = None if past_key_values is None else past_key_values[i]
            x, cache = self.block(i, x, attention_bias, layer_past, replace_position)
            presents.append(cache)
        x = self.norm(x, "model.transformer.ln_f")
        if self.cfg.get("weight_tying"):
            logits = F.linear(x, self.w["model.transformer.wte.weight"], None)
        else:
            logits = self.linear(x, "model.transformer.ff_out", self.include_bias)
        if self.cfg.get("scale_logits"):
            logits.mul_(1 / math.sqrt(self.d))
        return Output(logits, presents if use_cache else None)

    __call__ = forward


def _sdpa(q, k, v, attn_mask):
    """F.scaled_dot_product_attention(..., dropout_p=0, is_causal=False).

    LLaDAModel.__init__ calls torch.backends.cuda.enable_flash_sdp(True) and
    enable_mem_efficient_sdp(False), a process-wide switch; on CUDA the reference reproduces that
    backend choice locally instead of flipping the global flags."""
    if q.device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=False)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=False)
