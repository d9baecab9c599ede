"""DiffusionGemma's published folder format: `config.json` (the text model nested under `text_config`,
a vision tower beside it) and `generation_config.json` (the diffusion sampler's defaults).

Celeris serves the text model only. Options that change the text forward and that this engine does
not implement are refused by name; the vision tower is left out and `GemmaConfig.left_out` says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celeris.engine.config import read_json
from celeris.engine.errors import ModelLoadError

ARCHITECTURE = "DiffusionGemmaForBlockDiffusion"
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class LayerShape:
    kind: str  # SLIDING or FULL
    head_dim: int
    n_kv_heads: int
    rope_theta: float
    rotary_fraction: float  # FULL layers rotate part of each head ("proportional" RoPE)

    @property
    def sliding(self) -> bool:
        return self.kind == SLIDING


@dataclass(frozen=True)
class GemmaConfig:
    vocab_size: int
    d_model: int
    n_heads: int
    n_layers: int
    mlp_hidden_size: int
    layers: tuple[LayerShape, ...]
    sliding_window: int
    num_experts: int
    experts_per_token: int
    moe_hidden_size: int
    canvas_length: int
    rms_norm_eps: float = 1e-6
    logit_softcap: float = 30.0
    weight_tying: bool = True
    eos_token_ids: tuple[int, ...] = (1,)
    pad_token_id: int = 0
    max_sequence_length: int = 131072
    name: str = "diffusion-gemma"
    left_out: tuple[str, ...] = field(default=())  # what the folder has that celeris does not serve

    @property
    def arch(self) -> str:
        return "diffusion-gemma"

    @property
    def mask_token_id(self) -> int:
        """No token of the vocabulary: what a position of a canvas not yet started shows (the
        engine's mask), so such positions render as the mask marker and never as text."""
        return self.vocab_size

    @property
    def eos_token_id(self) -> int:
        return self.eos_token_ids[0]

    @property
    def cache_keep(self) -> int:
        """Sliding layers keep the last `sliding_window - 1` encoded positions (what the reference's
        sliding cache keeps, and so what its decoder sees)."""
        return self.sliding_window - 1


# Text-config keys that change the forward, with the values this engine computes.
_SUPPORTED: dict[str, tuple[Any, ...]] = {
    "hidden_activation": ("gelu_pytorch_tanh",),
    "attention_bias": (False,),
    "use_bidirectional_attention": (None, "vision"),  # "vision" is causal for text-only prompts
    "final_logit_softcapping": (30.0, None),
}


_DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                 FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}


def gemma_config(raw: dict[str, Any], name: str = "diffusion-gemma") -> GemmaConfig:
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError(f"{ARCHITECTURE} config.json has no 'text_config' object")
    bad = [f"{k}={text[k]!r}" for k, ok in _SUPPORTED.items() if k in text and text[k] not in ok]
    if bad:
        raise ModelLoadError("DiffusionGemma text_config sets options celeris does not implement: " + "; ".join(bad))
    if not text.get("num_experts"):
        raise ModelLoadError("DiffusionGemma text_config has no experts (num_experts): every layer is MoE")
    n_layers = int(text["num_hidden_layers"])
    layers = tuple(_layer(text, i) for i in range(n_layers))
    eos = text.get("eos_token_id", 1)
    left_out = tuple(k for k in ("vision_config", "audio_config") if raw.get(k))
    return GemmaConfig(
        vocab_size=int(text["vocab_size"]), d_model=int(text["hidden_size"]),
        n_heads=int(text["num_attention_heads"]), n_layers=n_layers,
        mlp_hidden_size=int(text["intermediate_size"]), layers=layers,
        sliding_window=int(text.get("sliding_window", 512)), num_experts=int(text["num_experts"]),
        experts_per_token=int(text["top_k_experts"]), moe_hidden_size=int(text["moe_intermediate_size"]),
        canvas_length=int(raw.get("canvas_length", 256)), rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        logit_softcap=float(text.get("final_logit_softcapping") or 30.0),
        weight_tying=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", True))),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (int(eos),),
        pad_token_id=int(text.get("pad_token_id") or 0),
        max_sequence_length=int(text.get("max_position_embeddings", 131072)), name=str(name), left_out=left_out)


def _layer_types(text: dict[str, Any]) -> list[str]:
    """As transformers fills them in: every sixth layer global unless listed; the last always global."""
    n = int(text["num_hidden_layers"])
    types = list(text.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n)])
    if len(types) != n:
        raise ModelLoadError("DiffusionGemma text_config needs one 'layer_types' entry per layer")
    types[-1] = FULL
    return types


def _overrides(text: dict[str, Any], i: int, kind: str) -> dict[str, Any]:
    """Per-layer head shape: `per_layer_config` when the config carries it, else the global-layer
    keys transformers derives it from."""
    if "per_layer_config" in text:
        return (text["per_layer_config"] or {}).get(str(i), {})
    if kind != FULL:
        return {}
    over = {"head_dim": text.get("global_head_dim", 512)}
    if text.get("num_global_key_value_heads") is not None:
        over["num_key_value_heads"] = text["num_global_key_value_heads"]
    return over


def _layer(text: dict[str, Any], i: int) -> LayerShape:
    kind = _layer_types(text)[i]
    if kind not in (SLIDING, FULL):
        raise ModelLoadError(f"DiffusionGemma layer {i}: unknown layer type {kind!r}")
    over = _overrides(text, i, kind)
    rope = (text.get("rope_parameters") or _DEFAULT_ROPE).get(kind) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("default", "proportional") or rope.get("factor", 1.0) != 1.0:
        raise ModelLoadError(f"DiffusionGemma layer {i}: RoPE {rope!r} is not implemented")
    return LayerShape(kind=kind, head_dim=int(over.get("head_dim", text["head_dim"])),
                      n_kv_heads=int(over.get("num_key_value_heads", text["num_key_value_heads"])),
                      rope_theta=float(rope.get("rope_theta", 10000.0)),
                      rotary_fraction=float(rope.get("partial_rotary_factor", 1.0)))


def generation_eos(folder: Path) -> tuple[int, ...]:
    """The end-of-sequence ids generation_config.json names (transformers stops at any of them)."""
    eos = read_json(folder, "generation_config.json").get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)
