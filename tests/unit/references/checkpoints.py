"""Tiny random checkpoints in the peers' published formats: config.json + model.safetensors + tokenizer.

LLaDA: GSAI-ML/LLaDA-8B-Instruct's config keys (d_model, n_heads, ..., rope_full_precision) and its
tensor names (`model.transformer.blocks.N.q_proj.weight`, ...). Dream: Dream-org/Dream-v0's Qwen2
config keys (hidden_size, num_attention_heads, ...) and names (`model.layers.N.self_attn.q_proj.bias`,
`lm_head.weight`, ...). The tokenizer is celeris-tiny v1's (1,024 ids, mask 3, EOS 2).

Norm weights are random around 1, not ones: with ones, "multiply by the weight, then cast" and
"cast, then multiply" agree, and a bfloat16 test could not tell them apart.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

# celeris-tiny v1's tokenizer (1,024 ids), kept here so the references' fixed outputs do not move
# when the embedded model is retrained.
TOKENIZER_DIR = Path(__file__).resolve().parent / "tokenizer"
TINY_VOCAB, TINY_MASK, TINY_EOS, TINY_PAD = 1024, 3, 2, 0


def _copy_tokenizer(folder: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / name, folder / name)


def _random(shape, gen: torch.Generator, std: float, mean: float = 0.0) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean


def _save(folder: Path, config: dict, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # Drawn in float32 from one generator, then rounded once to the checkpoint dtype.
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    _copy_tokenizer(folder)
    return folder


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]


def llada_config(**cfg) -> dict:
    """LLaDA-8B-Instruct's config.json with tiny sizes; keyword arguments override any key."""
    base = {
        "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "architectures": ["LLaDAModelLM"],
        "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
        "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "d_model": 64,
        "embedding_dropout": 0.0, "embedding_size": TINY_VOCAB, "eos_token_id": TINY_EOS, "flash_attention": False,
        "include_bias": False, "include_qkv_bias": False, "init_device": "meta", "init_fn": "mitchell",
        "init_std": 0.02, "input_emb_norm": False, "layer_norm_type": "rms", "layer_norm_with_affine": True,
        "mask_token_id": TINY_MASK, "max_sequence_length": 512, "mlp_hidden_size": 96, "mlp_ratio": 4,
        "model_type": "llada", "multi_query_attention": None, "n_heads": 4, "n_kv_heads": 4, "n_layers": 2,
        "pad_token_id": TINY_EOS, "precision": "amp_bf16", "residual_dropout": 0.0, "rms_norm_eps": 1e-05,
        "rope": True, "rope_full_precision": True, "rope_theta": 500000.0, "scale_logits": False,
        "use_cache": False, "vocab_size": TINY_VOCAB, "weight_tying": False,
    }
    return base | cfg


def write_llada_checkpoint(folder, dtype: torch.dtype = torch.float32, seed: int = 0, std: float = 0.3,
                           **cfg) -> Path:
    """A random LLaDA-format checkpoint. std 0.3 gives peaked logits like a trained model's."""
    c = llada_config(**cfg, torch_dtype=_dtype_name(dtype))
    gen = torch.Generator().manual_seed(seed)
    d, dh = c["d_model"], c["d_model"] // c["n_heads"]
    kv = 1 if c["multi_query_attention"] else (c["n_kv_heads"] or c["n_heads"])
    hidden, emb = c["mlp_hidden_size"], c["embedding_size"] or c["vocab_size"]
    bias = c["include_bias"]
    qkv_bias = bias or c["include_qkv_bias"]
    norm_bias = c["bias_for_layer_norm"] if c["bias_for_layer_norm"] is not None else bias
    t: dict[str, torch.Tensor] = {"model.transformer.wte.weight": _random((emb, d), gen, std)}

    def norm(name: str) -> None:
        t[f"{name}.weight"] = _random((d,), gen, 0.2, mean=1.0)
        if norm_bias:
            t[f"{name}.bias"] = _random((d,), gen, 0.1)

    def linear(name: str, n_out: int, n_in: int, with_bias: bool) -> None:
        t[f"{name}.weight"] = _random((n_out, n_in), gen, std)
        if with_bias:
            t[f"{name}.bias"] = _random((n_out,), gen, std)

    for i in range(c["n_layers"]):
        p = f"model.transformer.blocks.{i}"
        norm(f"{p}.attn_norm")
        linear(f"{p}.q_proj", d, d, qkv_bias)
        linear(f"{p}.k_proj", kv * dh, d, qkv_bias)
        linear(f"{p}.v_proj", kv * dh, d, qkv_bias)
        linear(f"{p}.attn_out", d, d, bias)
        norm(f"{p}.ff_norm")
        linear(f"{p}.ff_proj", hidden, d, bias)
        linear(f"{p}.up_proj", hidden, d, bias)
        linear(f"{p}.ff_out", d, hidden, bias)
    norm("model.transformer.ln_f")
    if not c["weight_tying"]:
        linear("model.transformer.ff_out", emb, d, bias)
    return _save(folder, c, t, dtype)


def dream_config(**cfg) -> dict:
    """Dream-v0-Instruct-7B's config.json (Qwen2 keys) with tiny sizes; keyword arguments override."""
    base = {
        "architectures": ["DreamModel"], "attention_dropout": 0.0, "bos_token_id": TINY_EOS,
        "eos_token_id": TINY_EOS, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
        "intermediate_size": 96, "mask_token_id": TINY_MASK, "max_position_embeddings": 512,
        "max_window_layers": 2, "model_type": "Dream", "num_attention_heads": 4, "num_hidden_layers": 2,
        "num_key_value_heads": 2, "pad_token_id": TINY_EOS, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False, "use_cache": False,
        "use_sliding_window": False, "vocab_size": TINY_VOCAB,
    }
    return base | cfg


def write_dream_checkpoint(folder, dtype: torch.dtype = torch.float32, seed: int = 0, std: float = 0.3,
                           **cfg) -> Path:
    """A random Dream-format (Qwen2-named) checkpoint, q/k/v with biases as Qwen2 has."""
    c = dream_config(**cfg, torch_dtype=_dtype_name(dtype))
    gen = torch.Generator().manual_seed(seed)
    d, nh, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    dh, hidden, V = d // nh, c["intermediate_size"], c["vocab_size"]
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": _random((V, d), gen, std)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = _random((d,), gen, 0.2, mean=1.0)
        for name, n_out in (("q_proj", nh * dh), ("k_proj", kv * dh), ("v_proj", kv * dh)):
            t[f"{p}.self_attn.{name}.weight"] = _random((n_out, d), gen, std)
            t[f"{p}.self_attn.{name}.bias"] = _random((n_out,), gen, std)
        t[f"{p}.self_attn.o_proj.weight"] = _random((d, nh * dh), gen, std)
        t[f"{p}.post_attention_layernorm.weight"] = _random((d,), gen, 0.2, mean=1.0)
        t[f"{p}.mlp.gate_proj.weight"] = _random((hidden, d), gen, std)
        t[f"{p}.mlp.up_proj.weight"] = _random((hidden, d), gen, std)
        t[f"{p}.mlp.down_proj.weight"] = _random((d, hidden), gen, std)
    t["model.norm.weight"] = _random((d,), gen, 0.2, mean=1.0)
    if not c["tie_word_embeddings"]:
        t["lm_head.weight"] = _random((V, d), gen, std)
    return _save(folder, c, t, dtype)


def read_checkpoint(folder) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and every tensor under its published name (single file or sharded index)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else ["model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(folder / f))
    return config, tensors
