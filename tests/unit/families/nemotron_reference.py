"""A plain-torch transcription of Nemotron-Labs-Diffusion's published decoding, batch 1, for tests.

Written from the reference's description (the model repository's modeling file: the Ministral3
backbone with YaRN RoPE and the Llama-4 query scale, and `NemotronLabsDiffusionModel.ar_generate`,
`generate`, `linear_spec_generate`), independently of celeris's model: a list of per-layer
(keys, values) as transformers' DynamicCache keeps them (concatenated, cropped), repeat_kv and
one SDPA call with an explicit mask, causal or bidirectional as the layers' `diffusion_lm` switch
says, and the LoRA delta on o_proj while PEFT's adapter is enabled. Temperature 0 only.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


class Reference:
    def __init__(self, folder: Path, adapter: bool = True):
        self.raw = json.loads((folder / "config.json").read_text())
        self.w = load_file(str(folder / "model.safetensors"))
        self.lora, self.scaling = {}, 1.0
        lora_dir = folder / "linear_spec_lora"
        if adapter and lora_dir.is_dir():
            acfg = json.loads((lora_dir / "adapter_config.json").read_text())
            self.scaling = acfg["lora_alpha"] / acfg["r"]
            self.lora = load_file(str(lora_dir / "adapter_model.safetensors"))
        self.mask_id, self.eos = self.raw["mask_token_id"], self.raw["eos_token_id"]
        self.inv_freq, self.attn_factor = self._yarn()

    # ------------------------------------------------------------------ the backbone

    def _yarn(self) -> tuple[torch.Tensor, float]:
        """transformers' `_compute_yarn_parameters`, for this config."""
        rp, dim = self.raw["rope_parameters"], self.raw["head_dim"]
        base = rp["rope_theta"]
        original = rp["original_max_position_embeddings"]
        factor = self.raw["max_position_embeddings"] / original

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if rp.get("mscale") and rp.get("mscale_all_dim"):
            attn = get_mscale(factor, rp["mscale"]) / get_mscale(factor, rp["mscale_all_dim"])
        else:
            attn = get_mscale(factor)

        def corr(rot):
            return (dim * math.log(original / (rot * 2 * math.pi))) / (2 * math.log(base))

        low, high = max(math.floor(corr(rp["beta_fast"])), 0), min(math.ceil(corr(rp["beta_slow"])), dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
        extra = 1 - ramp
        inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
        return inv, attn

    def forward(self, ids: list[int], past: list, causal: bool, lora: bool = False, use_cache: bool = False):
        """ids at positions past_len.. -> (logits (L, V), the cache with them if use_cache)."""
        r, w = self.raw, self.w
        H, Hk, Dh = r["num_attention_heads"], r["num_key_value_heads"], r["head_dim"]
        past_len = past[0][0].shape[2] if past else 0
        L = len(ids)
        pos = torch.arange(past_len, past_len + L)
        freqs = (self.inv_freq[:, None] @ pos[None, :].float()).T  # (L, Dh/2)
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos() * self.attn_factor, emb.sin() * self.attn_factor
        rp = r["rope_parameters"]
        qscale = (1 + rp["llama_4_scaling_beta"] * torch.log(1 + torch.floor(pos / rp["original_max_position_embeddings"])))
        x = w["encoder.embed_tokens.weight"][torch.tensor(ids)][None]  # (1, L, D)
        new_past = []
        for i in range(r["num_hidden_layers"]):
            p = f"encoder.layers.{i}."
            h = _rms(x, w[p + "input_layernorm.weight"], r["rms_norm_eps"])
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(1, L, H, Dh).transpose(1, 2)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).view(1, L, Hk, Dh).transpose(1, 2)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(1, L, Hk, Dh).transpose(1, 2)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            q = q * qscale[:, None]
            if past:
                k, v = torch.cat([past[i][0], k], 2), torch.cat([past[i][1], v], 2)
            new_past.append((k, v))
            kk, vv = k.repeat_interleave(H // Hk, 1), v.repeat_interleave(H // Hk, 1)
            mask = None
            if causal:
                mask = torch.arange(past_len + L)[None, :] <= (past_len + torch.arange(L))[:, None]
            a = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask).transpose(1, 2).reshape(1, L, -1)
            out = a @ w[p + "self_attn.o_proj.weight"].T
            if lora and self.lora:
                lp = f"base_model.model.{p}self_attn.o_proj."
                out = out + (a @ self.lora[lp + "lora_A.weight"].T @ self.lora[lp + "lora_B.weight"].T) * self.scaling
            x = x + out
            h = _rms(x, w[p + "post_attention_layernorm.weight"], r["rms_norm_eps"])
            gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
            x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        x = _rms(x, w["encoder.norm.weight"], r["rms_norm_eps"])
        return (x @ w["diffusion_head.weight"].T)[0], (new_past if use_cache else past)

    # ------------------------------------------------------------------ the three published loops

    def ar_generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        logits, past = self.forward(prompt, [], causal=True, use_cache=True)
        out = []
        for step in range(max_new_tokens):
            t = int(logits[-1].argmax())
            out.append(t)
            if t == self.eos:
                break
            logits, past = self.forward([t], past, causal=True, use_cache=True)
        return out

    def generate(self, prompt: list[int], max_new_tokens: int, block_length: int, threshold=None) -> list[int]:
        logits, past = self.forward(prompt, [], causal=True, use_cache=True)
        seed = int(logits[-1].argmax())
        x = list(prompt)
        P = len(prompt)
        for nb in range(max_new_tokens // block_length):
            block = [seed] + [self.mask_id] * (block_length - 1)
            x += block
            s = P + nb * block_length
            m0 = sum(t == self.mask_id for t in x[s:s + block_length])
            schedule = [m0 // block_length + (1 if i < m0 % block_length else 0) for i in range(block_length)]
            for i in range(block_length):
                masked = [j for j in range(block_length) if x[s + j] == self.mask_id]
                if not masked:
                    break
                lg, _ = self.forward(x[s:s + block_length], past, causal=False)
                p = torch.softmax(lg, -1)
                x0 = lg.argmax(-1)
                conf = torch.full((block_length,), -math.inf)
                for j in masked:
                    conf[j] = p[j, x0[j]]
                k = len(masked) if threshold is not None else schedule[i]
                order = torch.topk(conf, k).indices.tolist()
                chosen = [order[0]] + [j for j in order[1:] if threshold is None or conf[j] >= threshold]
                for j in chosen[:k]:
                    x[s + j] = int(x0[j])
                blk = x[s:s + block_length]
                if self.eos in blk and self.mask_id not in blk[:blk.index(self.eos)]:
                    break
            logits, past = self.forward(x[s:s + block_length], past, causal=True, use_cache=True)
            seed = int(logits[-1].argmax())
            gen = x[P:]
            if self.eos in gen:
                return gen[:gen.index(self.eos) + 1]
        return x[P:]

    def linear_spec_generate(self, prompt: list[int], max_new_tokens: int, block_length: int,
                             threshold: float = 0.0) -> tuple[list[int], list[int]]:
        """-> (tokens, accepted count of each verify pass)."""
        logits, past = self.forward(prompt, [], causal=True, use_cache=True)
        nxt = int(logits[-1].argmax())
        if nxt == self.eos:
            return [nxt], []
        out, accepts = [nxt], []
        while len(out) < max_new_tokens:
            cache_len = past[0][0].shape[2]
            block = [nxt] + [self.mask_id] * (block_length - 1)
            while self.mask_id in block:
                lg, _ = self.forward(block, past, causal=False, lora=True)
                probs = torch.softmax(lg, -1)
                draft = lg.argmax(-1)
                is_mask = [t == self.mask_id for t in block]
                if threshold > 0:
                    conf = [float(probs[j, draft[j]]) if is_mask[j] else -math.inf for j in range(block_length)]
                    unmask = [c >= threshold for c in conf]
                    if not any(unmask):
                        unmask[max(range(block_length), key=lambda j: conf[j])] = True
                    block = [int(draft[j]) if unmask[j] else block[j] for j in range(block_length)]
                else:
                    block = [int(draft[j]) if is_mask[j] else block[j] for j in range(block_length)]
                    break
            lg, past = self.forward(block, past, causal=True, use_cache=True)
            ar = lg.argmax(-1).tolist()
            accepted = 1
            for i in range(block_length - 1):
                if ar[i] != block[i + 1]:
                    break
                accepted += 1
            past = [(k[:, :, :cache_len + accepted], v[:, :, :cache_len + accepted]) for k, v in past]
            got = ar[:accepted]
            nxt = got[-1]
            accepts.append(accepted)
            if self.eos in got:
                out += got[:got.index(self.eos) + 1]
                break
            out += got
        return out, accepts


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)
