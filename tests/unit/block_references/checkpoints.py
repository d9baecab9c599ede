"""Tiny random block-diffusion checkpoints in the published folder formats.

SDAR (JetAstra/SDAR, `training/model/SDAR-*-Chat/`): Qwen3 layout, `architectures:
["SDARForCausalLM"]`, `model_type: "sdar"`, `block_size`, `mask_token_id`; tensors
`model.embed_tokens`, `model.layers.N.self_attn.{q,k,v,o}_proj`, `...self_attn.{q,k}_norm`,
`...{input,post_attention}_layernorm`, `...mlp.{gate,up,down}_proj`, `model.norm`, `lm_head`
(absent when `tie_word_embeddings`).

LLaDA2.x (inclusionAI LLaDA2.0-mini, `modeling_llada2_moe.py`): `architectures:
["LLaDA2MoeModelLM"]`, `model_type: "llada2_moe"`; tensors `model.word_embeddings`,
`model.layers.N.attention.query_key_value` (q heads, then k heads, then v heads),
`...attention.{query,key}_layernorm`, `...attention.dense`, dense layers (N <
first_k_dense_replace) `...mlp.{gate,up,down}_proj`, MoE layers `...mlp.gate.weight`,
`...mlp.gate.expert_bias`, `...mlp.experts.E.{gate,up,down}_proj`,
`...mlp.shared_experts.{gate,up,down}_proj`, `model.norm`, `lm_head`.

The tokenizer is celeris-tiny v1's (ids: 0 pad, 1 bos, 2 eos, 3 mask, vocabulary 1024).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.unit.references.checkpoints import TOKENIZER_DIR

TINY_TOKENIZER = TOKENIZER_DIR / "tokenizer.json"  # celeris-tiny v1's, shared with tests/unit/references
# Special ids of that tokenizer.
PAD_ID, BOS_ID, EOS_ID, MASK_ID = 0, 1, 2, 3
TOKENIZER_VOCAB = 1024


def cut(ids: list[int], n: int) -> list[int]:
    """A decode as the block tests compare it: the first n ids up to the first EOS or mask
    (neither included)."""
    out = []
    for t in ids[:n]:
        if t in (EOS_ID, MASK_ID):
            break
        out.append(t)
    return out


def sdar_config(**overrides) -> dict:
    """A small SDAR config.json with the keys the published SDAR-4B/8B-Chat configs carry."""
    cfg = {
        "architectures": ["SDARForCausalLM"],
        "model_type": "sdar",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": EOS_ID,  # SDAR uses <|endoftext|> as bos and eos
        "eos_token_id": EOS_ID,
        "block_size": 4,
        "mask_token_id": MASK_ID,
        # Training switches the published configs carry (the modeling file reads fuse_cross_entropy).
        "debug": False,
        "ep_size": 1,
        "fuse_cross_entropy": True,
        "micro_forward": False,
        "skip_checkpoint": False,
        "use_deepep": False,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 512,
        "max_window_layers": 3,
        "num_attention_heads": 4,
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": False,
        "use_sliding_window": False,
        "vocab_size": TOKENIZER_VOCAB,
    }
    return cfg | overrides


def llada2_config(**overrides) -> dict:
    """A small LLaDA2-MoE config.json with the keys of the published LLaDA2.0-mini config."""
    cfg = {
        "architectures": ["LLaDA2MoeModelLM"],
        "model_type": "llada2_moe",
        "attention_dropout": 0.0,
        "embedding_dropout": 0.0,
        "output_dropout": 0.0,
        "first_k_dense_replace": 1,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 512,
        "max_window_layers": 3,
        "moe_intermediate_size": 32,
        "moe_router_enable_expert_bias": True,
        "n_group": 4,
        "norm_head": False,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "num_shared_experts": 1,
        "output_router_logits": False,
        "pad_token_id": EOS_ID,  # LLaDA2.0-mini: pad = eos = 156892
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 600000,
        "routed_scaling_factor": 2.5,
        "score_function": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": 2,
        "torch_dtype": "float32",
        "use_bias": False,
        "use_cache": False,
        "use_qk_norm": True,
        "use_qkv_bias": False,
        "use_sliding_window": False,
        "vocab_size": TOKENIZER_VOCAB,
        # Not in the published config: the ids the published generate() takes as arguments
        # (eos_id=156892, mask_id=156895 there), recorded so a loader need not guess.
        "mask_token_id": MASK_ID,
        "eos_token_id": EOS_ID,
    }
    return cfg | overrides


class _Rand:
    """Random tensors with a large std: peaked, well-separated logits like a trained model's."""

    def __init__(self, seed: int, dtype: torch.dtype, std: float = 0.3):
        self.g = torch.Generator().manual_seed(seed)
        self.dtype, self.std = dtype, std

    def mat(self, rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=self.g) * self.std).to(self.dtype)

    def vec(self, n: int, std: float = 0.1) -> torch.Tensor:
        return (torch.randn(n, generator=self.g) * std).to(self.dtype)

    def norm(self, n: int) -> torch.Tensor:  # near one, but not one, so a skipped norm shows
        return (1.0 + torch.randn(n, generator=self.g) * 0.1).to(self.dtype)


def _mlp(r: _Rand, prefix: str, d: int, inter: int) -> dict[str, torch.Tensor]:
    return {f"{prefix}.gate_proj.weight": r.mat(inter, d), f"{prefix}.up_proj.weight": r.mat(inter, d),
            f"{prefix}.down_proj.weight": r.mat(d, inter)}


def sdar_tensors(cfg: dict, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    r = _Rand(seed, dtype)
    d, dh, V = cfg["hidden_size"], cfg["head_dim"], cfg["vocab_size"]
    H, Hk = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    t = {"model.embed_tokens.weight": r.mat(V, d), "model.norm.weight": r.norm(d)}
    if not cfg.get("tie_word_embeddings", False):
        t["lm_head.weight"] = r.mat(V, d)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = r.norm(d)
        t[f"{p}.post_attention_layernorm.weight"] = r.norm(d)
        for name, rows in (("q", H * dh), ("k", Hk * dh), ("v", Hk * dh)):
            t[f"{p}.self_attn.{name}_proj.weight"] = r.mat(rows, d)
            if cfg.get("attention_bias", False):
                t[f"{p}.self_attn.{name}_proj.bias"] = r.vec(rows)
        t[f"{p}.self_attn.o_proj.weight"] = r.mat(d, H * dh)
        if cfg.get("attention_bias", False):
            t[f"{p}.self_attn.o_proj.bias"] = r.vec(d)
        t[f"{p}.self_attn.q_norm.weight"] = r.norm(dh)
        t[f"{p}.self_attn.k_norm.weight"] = r.norm(dh)
        t |= _mlp(r, f"{p}.mlp", d, cfg["intermediate_size"])
    return t


def llada2_tensors(cfg: dict, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    r = _Rand(seed, dtype)
    d, dh, V = cfg["hidden_size"], cfg["head_dim"], cfg["vocab_size"]
    H, Hk = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    E, mi = cfg["num_experts"], cfg["moe_intermediate_size"]
    t = {"model.word_embeddings.weight": r.mat(V, d), "model.norm.weight": r.norm(d)}
    if not cfg.get("tie_word_embeddings", False):
        t["lm_head.weight"] = r.mat(V, d)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = r.norm(d)
        t[f"{p}.post_attention_layernorm.weight"] = r.norm(d)
        t[f"{p}.attention.query_key_value.weight"] = r.mat((H + 2 * Hk) * dh, d)
        if cfg.get("use_qkv_bias", False):
            t[f"{p}.attention.query_key_value.bias"] = r.vec((H + 2 * Hk) * dh)
        if cfg.get("use_qk_norm", False):
            t[f"{p}.attention.query_layernorm.weight"] = r.norm(dh)
            t[f"{p}.attention.key_layernorm.weight"] = r.norm(dh)
        t[f"{p}.attention.dense.weight"] = r.mat(d, H * dh)
        if cfg.get("use_bias", True):
            t[f"{p}.attention.dense.bias"] = r.vec(d)
        if cfg.get("num_experts") is None or i < cfg.get("first_k_dense_replace", 0):
            t |= _mlp(r, f"{p}.mlp", d, cfg["intermediate_size"])
            continue
        t[f"{p}.mlp.gate.weight"] = r.mat(E, d)
        # A persistent buffer of the published gate, so it is saved with the checkpoint; small, so
        # it sways routing without deciding it.
        t[f"{p}.mlp.gate.expert_bias"] = r.vec(E, std=0.05)
        for e in range(E):
            t |= _mlp(r, f"{p}.mlp.experts.{e}", d, mi)
        if cfg.get("num_shared_experts") is not None:
            t |= _mlp(r, f"{p}.mlp.shared_experts", d, mi * cfg["num_shared_experts"])
    return t


def _write_tokenizer(folder: Path, tokenizer_config: dict, generation_config: dict) -> None:
    shutil.copyfile(TINY_TOKENIZER, folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps(generation_config, indent=2))


def _write(folder: Path, cfg: dict, tensors: dict[str, torch.Tensor]) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if cfg["vocab_size"] < TOKENIZER_VOCAB:
        raise ValueError(f"vocab_size {cfg['vocab_size']} < the tokenizer's {TOKENIZER_VOCAB}")
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return folder


def write_sdar_checkpoint(folder: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """A random SDAR-format folder: config.json, model.safetensors, tokenizer files.

    overrides replace config keys (e.g. block_size=8, tie_word_embeddings=True, num_hidden_layers=2).
    """
    cfg = sdar_config(**overrides)
    _write(folder, cfg, sdar_tensors(cfg, seed, dtype))
    # SDAR-*-Chat: eos "<|endoftext|>", pad = eos, bos null, mask_token "<|MASK|>"; generation_config
    # lists the stop ids [<|im_end|>, <|endoftext|>]. celeris-tiny has one end token.
    _write_tokenizer(Path(folder),
                     {"add_bos_token": False, "bos_token": None, "eos_token": "<|eos|>", "pad_token": "<|eos|>",
                      "mask_token": "<|mask|>", "tokenizer_class": "Qwen2Tokenizer"},
                     {"bos_token_id": cfg["eos_token_id"], "eos_token_id": [cfg["eos_token_id"]],
                      "pad_token_id": cfg["eos_token_id"], "do_sample": False})
    return Path(folder)


def write_llada2_checkpoint(folder: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """A random LLaDA2-MoE-format folder: config.json, model.safetensors, tokenizer files.

    overrides replace config keys (e.g. num_experts=4, n_group=2, first_k_dense_replace=0).
    """
    cfg = llada2_config(**overrides)
    _write(folder, cfg, llada2_tensors(cfg, seed, dtype))
    _write_tokenizer(Path(folder),
                     {"add_bos_token": False, "bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|eos|>",
                      "mask_token": "<|mask|>"},
                     {"bos_token_id": BOS_ID, "eos_token_id": cfg["eos_token_id"], "pad_token_id": cfg["pad_token_id"]})
    return Path(folder)


# What marks a LLaDA2.1 folder (engine/families/block/cards.py: edits_tokens): its config.json is LLaDA2.0's; the
# remote-code modeling file it ships has a generate() that takes editing_threshold. This stub
# stands for that file (a signature only: celeris reads, never runs, a folder's Python).
LLADA21_MODELING_STUB = '''"""Stand-in for LLaDA2.1's modeling_llada2_moe.py (its generate() signature only)."""


def generate(self, inputs=None, temperature=0.0, block_length=32, steps=32, gen_length=2048, top_p=None,
             top_k=None, eos_early_stop=False, minimal_topk=1, threshold=0.95, editing_threshold=0.9,
             max_post_steps=16, eos_id=156892, mask_id=156895, num_to_transfer=1):
    raise NotImplementedError
'''


def write_llada21_checkpoint(folder: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """A LLaDA2.1 folder: a LLaDA2 checkpoint with LLaDA2.1's modeling file beside it."""
    folder = write_llada2_checkpoint(folder, seed, dtype, **overrides)
    (folder / "modeling_llada2_moe.py").write_text(LLADA21_MODELING_STUB)
    return folder
