"""Nemotron-Labs-Diffusion's config.json, and the position tables its Ministral3 backbone reads.

The released config (NemotronLabsDiffusionConfig, model_type `nemotron_labs_diffusion`) is a
Ministral3 text model plus the diffusion keys (`mask_token_id`, `block_size`, `dlm_paradigm`).
Positions enter the attention twice, both from `rope_parameters`:

- YaRN RoPE (`rope_type: yarn`): per-frequency blending of the original and the `factor`-stretched
  inverse frequencies over the ramp [beta_fast, beta_slow], and cos/sin scaled by the attention
  factor (`mscale` / `mscale_all_dim`), as transformers' `_compute_yarn_parameters` defines them;
- the Llama-4 query scale: each query is multiplied by 1 + beta * log(1 + floor(pos / L0)), with
  beta = `llama_4_scaling_beta` and L0 = `original_max_position_embeddings`, after RoPE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from celeris.engine.errors import ModelLoadError
from celeris.engine.families.card import first_id, refuse_unsupported

ARCHITECTURE = "NemotronLabsDiffusionModel"
MODEL_TYPE = "nemotron_labs_diffusion"
# Keys that would change the forward, and the values this model computes.
SUPPORTED: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu",), "attention_bias": (False, None), "mlp_bias": (False, None),
    "sliding_window": (None,), "tie_word_embeddings": (False, None),
}


@dataclass(frozen=True)
class NemotronConfig:
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_layers: int
    mlp_hidden_size: int
    vocab_size: int
    rms_norm_eps: float
    mask_token_id: int
    eos_token_id: int
    block_length: int  # the trained block (`block_size`): the default of generate()'s block_length
    max_sequence_length: int
    rope_theta: float = 1e6
    rope_type: str = "default"  # "default" or "yarn"
    rope_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float = 0.0  # 0: derived from factor and the mscales
    truncate: bool = True
    original_max_positions: int = 0  # YaRN's pretrained length, and the Llama-4 scale's bucket
    llama4_beta: float = 0.0  # 0: no query scale
    name: str = "nemotron"
    arch: str = "nemotron-labs-diffusion"  # its card's name
    draft_adapter: bool = False  # whether the self-speculation adapter was loaded (weights.py)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.eos_token_id,)


def nemotron_config(raw: dict[str, Any], name: str) -> NemotronConfig:
    """A released config.json's model config (`rope_parameters`, or an older `rope_scaling`)."""
    refuse_unsupported(raw, SUPPORTED)
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ModelLoadError(f"config.json: rope_parameters must be an object, got {rope!r}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise ModelLoadError(f"config.json: rope_type {kind!r} is not implemented (supported: default, yarn)")
    heads = int(raw["num_attention_heads"])
    max_pos = int(raw.get("max_position_embeddings", 262144))
    original = int(rope.get("original_max_position_embeddings") or max_pos)
    # transformers: with an original length recorded, YaRN's factor is the ratio of the two lengths
    factor = max_pos / original if "original_max_position_embeddings" in rope else float(rope.get("factor", 1.0))
    if raw.get("mask_token_id") is None or int(raw["mask_token_id"]) < 0:
        raise ModelLoadError("config.json: a Nemotron-Labs-Diffusion checkpoint needs its mask_token_id")
    return NemotronConfig(
        d_model=int(raw["hidden_size"]), n_heads=heads, n_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
        n_layers=int(raw["num_hidden_layers"]), mlp_hidden_size=int(raw["intermediate_size"]),
        vocab_size=int(raw["vocab_size"]), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        mask_token_id=int(raw["mask_token_id"]), eos_token_id=first_id(raw, "eos_token_id", 2),
        block_length=int(raw.get("block_size", 32)), max_sequence_length=max_pos,
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 1e6))), rope_type=kind, rope_factor=factor,
        beta_fast=float(rope.get("beta_fast") or 32.0), beta_slow=float(rope.get("beta_slow") or 1.0),
        mscale=float(rope.get("mscale") or 0.0), mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
        attention_factor=float(rope.get("attention_factor") or 0.0), truncate=bool(rope.get("truncate", True)),
        original_max_positions=original, llama4_beta=float(rope.get("llama_4_scaling_beta") or 0.0),
        name=str(raw.get("name", name)))


def config_json(cfg: NemotronConfig) -> dict[str, Any]:
    """The released config.json's keys for a model config (tests write tiny checkpoints with it)."""
    rope = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor,
            "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow, "mscale": cfg.mscale,
            "mscale_all_dim": cfg.mscale_all_dim, "original_max_position_embeddings": cfg.original_max_positions,
            "llama_4_scaling_beta": cfg.llama4_beta}
    return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "hidden_size": cfg.d_model,
            "intermediate_size": cfg.mlp_hidden_size, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size,
            "hidden_act": "silu", "max_position_embeddings": cfg.max_sequence_length, "rms_norm_eps": cfg.rms_norm_eps,
            "bos_token_id": 1, "eos_token_id": cfg.eos_token_id, "tie_word_embeddings": False, "rope_parameters": rope,
            "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "sliding_window": None,
            "mask_token_id": cfg.mask_token_id, "dlm_paradigm": "bidirectional", "block_size": cfg.block_length,
            "torch_dtype": "float32"}


def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def inv_freq(cfg: NemotronConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (head_dim/2,) float32, the factor cos/sin are scaled by)."""
    dim, base = cfg.head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    if cfg.rope_type != "yarn":
        return 1.0 / pos_freqs, 1.0
    f = cfg.rope_factor
    attention = cfg.attention_factor or (
        _mscale(f, cfg.mscale) / _mscale(f, cfg.mscale_all_dim) if cfg.mscale and cfg.mscale_all_dim else _mscale(f))

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over L0
        return dim * math.log(cfg.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency (fast dims), 0: interpolate (slow dims)
    freq = (1.0 / (f * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return freq, float(attention)


def rope_tables(positions: torch.Tensor, freq: torch.Tensor, scale: float, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (B, 1, L, Dh) of integer positions (B, L), in fp32 then the model dtype."""
    angles = positions.float()[..., None] * freq.to(positions.device)  # (B, L, Dh/2)
    emb = torch.cat([angles, angles], dim=-1)
    return (emb.cos() * scale).to(dtype)[:, None], (emb.sin() * scale).to(dtype)[:, None]


def query_scale(positions: torch.Tensor, cfg: NemotronConfig) -> torch.Tensor:
    """Llama-4's per-position query scale (B, 1, L, 1) in float32 (ones without a beta)."""
    if not cfg.llama4_beta:
        return torch.ones(positions.shape, device=positions.device)[:, None, :, None]
    buckets = torch.floor(positions / cfg.original_max_positions)
    return (1 + cfg.llama4_beta * torch.log(1 + buckets))[:, None, :, None]


__all__ = ["ARCHITECTURE", "MODEL_TYPE", "NemotronConfig", "config_json", "inv_freq", "nemotron_config", "query_scale",
           "rope_tables"]
