"""The canvas family's architectures: LLaDA and Dream (engine/families/card.py).

A LLaDA config uses LLaDA's own naming (`d_model`, `n_heads`, ...); a Dream config either Qwen2's
(`hidden_size`, `num_attention_heads`, ...), as published, or LLaDA's, as celeris writes a Dream
model. Both load into the same model code; what differs is kept here: RoPE precision, Dream's
logit shift, checkpoint names, and each published sampler's selection rule.
"""

from __future__ import annotations

import functools
from dataclasses import asdict
from typing import Any

import torch

from celeris.engine.config import ModelConfig
from celeris.engine.errors import ModelLoadError
from celeris.engine.families.card import QWEN2_NAMES, ArchCard, refuse_unsupported, renamer
from celeris.engine.sampling.batch import SelectionRule

# Config keys that change the forward, with the values this model computes correctly; keys that
# only matter for training (dropout, init) or that the model implements are not listed.
LLADA_SUPPORTED: dict[str, tuple[Any, ...]] = {
    "activation_type": ("silu", "swiglu"),
    "block_type": ("llama",),
    "layer_norm_type": ("rms",),
    "layer_norm_with_affine": (True,),
    "bias_for_layer_norm": (False, None),
    "attention_layer_norm": (False, None),
    "include_bias": (False,),
    "alibi": (False,),
    "rope": (True,),
    "rope_full_precision": (True,),
    "clip_qkv": (None,),
    "multi_query_attention": (False, None),
    "block_group_size": (1,),
}
QWEN2_SUPPORTED: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu",),
    "rope_scaling": (None,),
    "use_sliding_window": (False,),
}
# The keys celeris writes for a canvas model (celeris-tiny's config.json).
LLADA_KEYS = ("arch", "d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size", "vocab_size",
              "embedding_size", "rope_theta", "rms_norm_eps", "mask_token_id", "eos_token_id", "weight_tying",
              "qkv_bias", "input_emb_norm", "scale_logits", "max_sequence_length", "name")



def _llada_naming(raw: dict[str, Any], mask_id: int = 126336, eos_id: int = 126081) -> dict[str, Any]:
    """The shared fields of a config in LLaDA's naming."""
    refuse_unsupported(raw, LLADA_SUPPORTED)
    vocab = int(raw["vocab_size"])
    return dict(
        d_model=int(raw["d_model"]), n_heads=int(raw["n_heads"]), n_kv_heads=int(raw.get("n_kv_heads") or raw["n_heads"]),
        n_layers=int(raw["n_layers"]), mlp_hidden_size=int(raw["mlp_hidden_size"]), vocab_size=vocab,
        embedding_size=int(raw.get("embedding_size") or vocab), rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)), mask_token_id=int(raw.get("mask_token_id", mask_id)),
        eos_token_id=int(raw.get("eos_token_id", eos_id)), weight_tying=bool(raw.get("weight_tying", False)),
        qkv_bias=bool(raw.get("qkv_bias", raw.get("include_qkv_bias", False))),
        input_emb_norm=bool(raw.get("input_emb_norm", False)), scale_logits=bool(raw.get("scale_logits", False)),
        max_sequence_length=int(raw.get("max_sequence_length", 4096)))


def _qwen2_naming(raw: dict[str, Any]) -> dict[str, Any]:
    """The shared fields of a config in Qwen2's naming (Dream as published)."""
    refuse_unsupported(raw, QWEN2_SUPPORTED)
    vocab, heads = int(raw["vocab_size"]), int(raw["num_attention_heads"])
    return dict(
        d_model=int(raw["hidden_size"]), n_heads=heads, n_kv_heads=int(raw.get("num_key_value_heads") or heads),
        n_layers=int(raw["num_hidden_layers"]), mlp_hidden_size=int(raw["intermediate_size"]), vocab_size=vocab,
        embedding_size=vocab, rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), mask_token_id=int(raw.get("mask_token_id", 151666)),
        eos_token_id=int(raw.get("eos_token_id", 151643)), weight_tying=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=True, max_sequence_length=int(raw.get("max_position_embeddings", 32768)))


def _is_dream(raw: dict[str, Any]) -> bool:
    return raw.get("model_type") == "Dream" or any("dream" in a.lower() for a in raw.get("architectures") or ())


def _llada_json(cfg: ModelConfig) -> dict[str, Any]:
    """celeris-tiny's config.json: LLaDA's keys, under the architecture's published name."""
    return {k: v for k, v in asdict(cfg).items() if k in LLADA_KEYS} | {"architectures": [CARD_NAMES[cfg.arch]]}


def _parse_llada(raw: dict[str, Any], name: str) -> ModelConfig:
    return LLADA.config(**_llada_naming(raw), name=str(raw.get("name", name)))


def _parse_dream(raw: dict[str, Any], name: str) -> ModelConfig:
    if "d_model" in raw:  # as celeris writes a Dream model
        return DREAM.config(**_llada_naming(raw), name=str(raw.get("name", name)))
    if "hidden_size" not in raw:
        raise ModelLoadError("config.json has neither LLaDA ('d_model') nor Qwen2/Dream ('hidden_size') keys")
    return DREAM.config(**_qwen2_naming(raw), name=str(raw.get("name", name)))


def _model_name(name: str) -> str:
    return f"model.{name}"


LLADA = ArchCard(
    name="llada", architectures=("LLaDAModelLM",),
    claims=lambda raw, folder: "d_model" in raw and not _is_dream(raw), parse=_parse_llada,
    tensor_name=renamer(()),  # LLaDA's checkpoints use the model's own names
    # LLaDA's first published generate() and Fast-dLLM: float64 confidences over the raw logits.
    rule=functools.partial(SelectionRule, conf_dtype=torch.float64),
    traits=(("rope_fp32", True),),  # LLaDA rotates q/k in fp32 (`rope_full_precision`)
    writes=_llada_json, published_name=_model_name)

# Dream's diffusion_generate reads top_k from the model's GenerationConfig, whose transformers
# default is 50 unless generation_config.json sets it: confidences are then ranked over the 50
# most likely tokens' renormalised probabilities.
DREAM_TOP_K = 50

DREAM = ArchCard(
    name="dream", architectures=("DreamModel",),
    claims=lambda raw, folder: _is_dream(raw) or "hidden_size" in raw, parse=_parse_dream,
    tensor_name=renamer(QWEN2_NAMES),
    # Dream's sampler: softmax argmax, confidences in the logits' dtype, after top-k.
    rule=functools.partial(SelectionRule, conf_dtype=None, x0_from_probs=True, conf_after_filter=True),
    defaults=(("top_k", DREAM_TOP_K),),
    # Qwen2 rotates in the model dtype; Dream predicts token i from position i-1 (AR-initialised).
    traits=(("rope_fp32", False), ("logit_shift", True)),
    writes=_llada_json, published_name=_model_name)

CARDS = (LLADA, DREAM)  # in claiming order
CARD_NAMES = {c.name: c.architectures[0] for c in CARDS}
__all__ = ["CARDS", "DREAM", "DREAM_TOP_K", "LLADA", "QWEN2_NAMES"]
