"""The block family's architectures: SDAR, LLaDA2.0, LLaDA2.1 and LLaDA2.2 (engine/families/card.py).

SDAR (JetAstra) is the Qwen3 layout (q/k norms, GQA, explicit head_dim) trained in blocks; celeris
writes its own block model (celeris-tiny-block) in SDAR's format. LLaDA2.x (inclusionAI) is MoE with
shared experts and a grouped sigmoid router, block 32. LLaDA2.1's config.json is LLaDA2.0's: what
marks its folder is the generate() it ships (`edits_tokens`), whose loop may replace tokens it wrote.
LLaDA2.2's config.json names its architecture LLaDA2.1's way; what marks it is its two edit
tokens (`delete_token_id`, `split_token_id`), which its loop may write (block/levenshtein.py), and
its block-routed gate (`expert_capacity`, `block_size`: engine/models/moe.py), which any LLaDA2
config that sets them gets. All sample as published: x0 from the softmax, float32 confidences.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from celeris.engine.config import ModelConfig, read_json
from celeris.engine.errors import ModelLoadError
from celeris.engine.families.card import QWEN2_NAMES, ArchCard, first_id, names_any, published, refuse_unsupported, renamer
from celeris.engine.sampling.batch import SelectionRule

SUPPORTED: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu",),
    "rope_scaling": (None,),
    "use_sliding_window": (False, None),
}
# Published tensor names -> the model's (LLaDA's), after the leading `model.` is dropped.
QWEN3_NAMES = (  # Qwen2's and the q/k norms
    QWEN2_NAMES[0],
    (r"^layers\.(\d+)\.self_attn\.([qk])_norm\.", r"transformer.blocks.\1.\2_norm."),
    *QWEN2_NAMES[1:],
)
LLADA2_NAMES = (
    (r"^word_embeddings\.", "transformer.wte."),
    (r"^layers\.(\d+)\.attention\.query_layernorm\.", r"transformer.blocks.\1.q_norm."),
    (r"^layers\.(\d+)\.attention\.key_layernorm\.", r"transformer.blocks.\1.k_norm."),
    (r"^layers\.(\d+)\.attention\.dense\.", r"transformer.blocks.\1.attn_out."),
    # q, k and v in one tensor, rows [q heads | k heads | v heads]: split by the loader (models/weights.py)
    (r"^layers\.(\d+)\.attention\.query_key_value\.(weight|bias)$", r"transformer.blocks.\1.attention.query_key_value.\2"),
    (r"^layers\.(\d+)\.mlp\.gate\.(weight|expert_bias)$", r"transformer.blocks.\1.mlp.gate.\2"),  # the router
    (r"^layers\.(\d+)\.mlp\.(experts\.\d+|shared_experts)\.gate_proj\.", r"transformer.blocks.\1.mlp.\2.ff_proj."),
    (r"^layers\.(\d+)\.mlp\.(experts\.\d+|shared_experts)\.up_proj\.", r"transformer.blocks.\1.mlp.\2.up_proj."),
    (r"^layers\.(\d+)\.mlp\.(experts\.\d+|shared_experts)\.down_proj\.", r"transformer.blocks.\1.mlp.\2.ff_out."),
) + QWEN3_NAMES[2:]  # norms, head, the dense layers' MLP (first_k_dense_replace)
# The model's names -> SDAR's, for writing celeris-tiny-block.
SDAR_PUBLISHED = (
    (r"^transformer\.wte\.", "model.embed_tokens."),
    (r"^transformer\.ln_f\.", "model.norm."),
    (r"^transformer\.ff_out\.", "lm_head."),
    (r"^transformer\.blocks\.(\d+)\.([qk])_norm\.", r"model.layers.\1.self_attn.\2_norm."),
    (r"^transformer\.blocks\.(\d+)\.([qkv])_proj\.", r"model.layers.\1.self_attn.\2_proj."),
    (r"^transformer\.blocks\.(\d+)\.attn_out\.", r"model.layers.\1.self_attn.o_proj."),
    (r"^transformer\.blocks\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^transformer\.blocks\.(\d+)\.ff_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^transformer\.blocks\.(\d+)\.ff_proj\.", r"model.layers.\1.mlp.gate_proj."),
    (r"^transformer\.blocks\.(\d+)\.up_proj\.", r"model.layers.\1.mlp.up_proj."),
    (r"^transformer\.blocks\.(\d+)\.ff_out\.", r"model.layers.\1.mlp.down_proj."),
)

# SDAR's and LLaDA2's samplers: x0 from the softmax, float32 confidences, dynamic threshold.
BLOCK_RULE = functools.partial(SelectionRule, conf_dtype=torch.float32, x0_from_probs=True, block_threshold=True)


def _sdar(raw: dict[str, Any], name: str) -> ModelConfig:
    refuse_unsupported(raw, SUPPORTED)
    heads = int(raw["num_attention_heads"])
    return SDAR.config(
        d_model=int(raw["hidden_size"]), n_heads=heads,
        n_kv_heads=int(raw.get("num_key_value_heads") or heads), n_layers=int(raw["num_hidden_layers"]),
        mlp_hidden_size=int(raw["intermediate_size"]), vocab_size=int(raw["vocab_size"]),
        embedding_size=int(raw["vocab_size"]), rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), mask_token_id=first_id(raw, "mask_token_id", 151669),
        eos_token_id=first_id(raw, "eos_token_id", 151643), weight_tying=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=bool(raw.get("attention_bias", False)), out_bias=bool(raw.get("attention_bias", False)),
        explicit_head_dim=int(raw.get("head_dim") or 0),
        max_sequence_length=int(raw.get("max_position_embeddings", 32768)),
        block_length=int(raw.get("block_size", 4)), name=str(raw.get("name", name)))


def _sdar_json(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "architectures": ["SDARForCausalLM"], "model_type": "sdar", "name": cfg.name,
        "hidden_size": cfg.d_model, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "num_hidden_layers": cfg.n_layers, "intermediate_size": cfg.mlp_hidden_size, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "rms_norm_eps": cfg.rms_norm_eps, "mask_token_id": cfg.mask_token_id, "eos_token_id": cfg.eos_token_id,
        "tie_word_embeddings": cfg.weight_tying, "attention_bias": cfg.qkv_bias, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_sequence_length, "block_size": cfg.block_length,
        "use_sliding_window": False, "torch_dtype": "float32",
    }


def _llada2(card: ArchCard, raw: dict[str, Any], name: str) -> ModelConfig:
    """Its published generate() takes mask and EOS ids as arguments (156895, 156892); a config that
    records `mask_token_id` / `eos_token_id` overrides them."""
    refuse_unsupported(raw, SUPPORTED)
    heads = int(raw["num_attention_heads"])
    return card.config(
        d_model=int(raw["hidden_size"]), n_heads=heads,
        n_kv_heads=int(raw.get("num_key_value_heads") or heads), n_layers=int(raw["num_hidden_layers"]),
        mlp_hidden_size=int(raw.get("intermediate_size") or 0), vocab_size=int(raw["vocab_size"]),
        embedding_size=int(raw["vocab_size"]), rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)), mask_token_id=first_id(raw, "mask_token_id", 156895),
        eos_token_id=first_id(raw, "eos_token_id", 156892), weight_tying=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=bool(raw.get("use_qkv_bias", False)), out_bias=bool(raw.get("use_bias", True)),
        explicit_head_dim=int(raw.get("head_dim") or 0), qk_norm=bool(raw.get("use_qk_norm", True)),
        partial_rotary_factor=float(raw.get("partial_rotary_factor", 0.5)),
        max_sequence_length=int(raw.get("max_position_embeddings", 16384)),
        num_experts=int(raw.get("num_experts") or 0), experts_per_token=int(raw.get("num_experts_per_tok", 2)),
        num_shared_experts=int(raw.get("num_shared_experts") or 0),
        moe_hidden_size=int(raw.get("moe_intermediate_size") or 0),
        first_dense_layers=int(raw.get("first_k_dense_replace", 0)), n_group=int(raw.get("n_group", 8)),
        topk_group=int(raw.get("topk_group", 4)), routed_scaling_factor=float(raw.get("routed_scaling_factor", 2.5)),
        # A block-routed gate only where expert_capacity is set (LLaDA2.0/2.1 configs may carry block_size).
        expert_capacity=int(raw.get("expert_capacity") or 0),
        routing_block=int(raw.get("block_size") or 0) if raw.get("expert_capacity") else 0,
        delete_token_id=_optional_id(raw, "delete_token_id"), split_token_id=_optional_id(raw, "split_token_id"),
        name=str(raw.get("name", name)))


def _optional_id(raw: dict[str, Any], key: str) -> int:
    return -1 if raw.get(key) is None else int(raw[key])


def edits_tokens(folder: Path) -> bool:
    """Whether a LLaDA2.x folder is LLaDA2.1 (token editing). Its config.json is LLaDA2.0's (same
    architecture and keys); what differs is the `generate()` its remote-code modeling file ships,
    whose signature takes `editing_threshold`, and the editing knobs a generation_config.json may
    recommend. Either marks the folder; neither keeps LLaDA2.0's loop."""
    folder = Path(folder)
    try:
        if {"editing_threshold", "max_post_steps"} & set(read_json(folder, "generation_config.json")):
            return True
    except ModelLoadError:
        pass  # model_defaults reports a broken generation_config.json
    return any("editing_threshold" in f.read_text(errors="replace") for f in folder.glob("modeling_*.py"))


def _is_llada2(raw: dict[str, Any]) -> bool:
    return raw.get("model_type") == "llada2_moe" or names_any(raw, "LLaDA2MoeModelLM")


def _is_llada22(raw: dict[str, Any]) -> bool:
    """LLaDA2.2: a LLaDA2 config that names both edit tokens."""
    return _is_llada2(raw) and raw.get("delete_token_id") is not None and raw.get("split_token_id") is not None


SDAR = ArchCard(
    name="sdar", architectures=("SDARForCausalLM",),
    claims=lambda raw, folder: raw.get("model_type") == "sdar" or names_any(raw, "SDARForCausalLM"),
    parse=_sdar, tensor_name=renamer(QWEN3_NAMES), rule=BLOCK_RULE,
    traits=(("rope_fp32", False), ("qk_norm", True)),
    writes=_sdar_json, published_name=functools.partial(published, SDAR_PUBLISHED, "SDAR"))
_LLADA2_TRAITS = (("rope_fp32", False), ("logits_fp32", True), ("block_length", 32))  # it returns float32 logits
LLADA22 = ArchCard(
    name="llada2.2", architectures=("LLaDA2MoeModelLM",), claims=lambda raw, folder: _is_llada22(raw),
    parse=lambda raw, name: _llada2(LLADA22, raw, name), tensor_name=renamer(LLADA2_NAMES), rule=BLOCK_RULE,
    # Its published generate(): threshold 0.5, editing_threshold 0.0, steps 32, max_post_steps 16.
    defaults=(("threshold", 0.5), ("editing_threshold", 0.0), ("max_post_steps", 16)),
    edits=True, traits=_LLADA2_TRAITS)
LLADA21 = ArchCard(
    name="llada2.1", architectures=("LLaDA2MoeModelLM",),
    claims=lambda raw, folder: _is_llada2(raw) and folder is not None and edits_tokens(folder),
    parse=lambda raw, name: _llada2(LLADA21, raw, name), tensor_name=renamer(LLADA2_NAMES), rule=BLOCK_RULE,
    # Its published generate(): threshold 0.95, editing_threshold 0.9, max_post_steps 16.
    defaults=(("threshold", 0.95), ("editing_threshold", 0.9), ("max_post_steps", 16)),
    edits=True, traits=_LLADA2_TRAITS)
LLADA2 = ArchCard(
    name="llada2", architectures=("LLaDA2MoeModelLM",), claims=lambda raw, folder: _is_llada2(raw),
    parse=lambda raw, name: _llada2(LLADA2, raw, name), tensor_name=renamer(LLADA2_NAMES), rule=BLOCK_RULE,
    traits=_LLADA2_TRAITS)

# In claiming order: LLaDA2.2's and LLaDA2.1's folders are LLaDA2.0 folders and more.
CARDS = (SDAR, LLADA22, LLADA21, LLADA2)
__all__ = ["CARDS", "LLADA2", "LLADA21", "LLADA22", "SDAR", "edits_tokens"]
