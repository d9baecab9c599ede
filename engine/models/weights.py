"""Checkpoint loading and saving.

Folders are Hugging Face style: `config.json`, `model.safetensors` or a sharded
`model.safetensors.index.json`, plus `tokenizer.json`. The model is built on the meta device
and the tensors are memory-mapped from safetensors and assigned directly, so an 8B checkpoint
never exists twice in memory. Loading is strict (`checkpoint.StrictState`): a missing,
unexpected or mis-shaped tensor is an error naming the tensor and its file.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from safetensors.torch import save_file

from celeris.engine.config import ModelConfig
from celeris.engine.errors import ModelLoadError
from celeris.engine.models.checkpoint import StrictState, checkpoint_folder, resolve_dtype, tensors
from celeris.engine.models.transformer import MaskPredictor

# Qwen2/Dream, Qwen3/SDAR and LLaDA2 names -> our (LLaDA) names. Applied after the leading
# "model." is stripped; the first rule that matches wins.
_QWEN2_RULES = [
    (r"^embed_tokens\.", "transformer.wte."),
    (r"^word_embeddings\.", "transformer.wte."),  # LLaDA2
    (r"^layers\.(\d+)\.self_attn\.([qk])_norm\.", r"transformer.blocks.\1.\2_norm."),  # SDAR
    (r"^layers\.(\d+)\.attention\.query_layernorm\.", r"transformer.blocks.\1.q_norm."),  # LLaDA2
    (r"^layers\.(\d+)\.attention\.key_layernorm\.", r"transformer.blocks.\1.k_norm."),
    (r"^layers\.(\d+)\.attention\.dense\.", r"transformer.blocks.\1.attn_out."),
    (r"^layers\.(\d+)\.mlp\.gate\.(weight|expert_bias)$", r"transformer.blocks.\1.mlp.gate.\2"),  # the router
    (r"^layers\.(\d+)\.mlp\.(experts\.\d+|shared_experts)\.gate_proj\.", r"transformer.blocks.\1.mlp.\2.ff_proj."),
    (r"^layers\.(\d+)\.mlp\.(experts\.\d+|shared_experts)\.up_proj\.", r"transformer.blocks.\1.mlp.\2.up_proj."),
    (r"^layers\.(\d+)\.mlp\.(experts\.\d+|shared_experts)\.down_proj\.", r"transformer.blocks.\1.mlp.\2.ff_out."),
    (r"^norm\.", "transformer.ln_f."),
    (r"^lm_head\.", "transformer.ff_out."),
    (r"^layers\.(\d+)\.input_layernorm\.", r"transformer.blocks.\1.attn_norm."),
    (r"^layers\.(\d+)\.post_attention_layernorm\.", r"transformer.blocks.\1.ff_norm."),
    (r"^layers\.(\d+)\.self_attn\.o_proj\.", r"transformer.blocks.\1.attn_out."),
    (r"^layers\.(\d+)\.self_attn\.([qkv])_proj\.", r"transformer.blocks.\1.\2_proj."),
    (r"^layers\.(\d+)\.mlp\.gate_proj\.", r"transformer.blocks.\1.ff_proj."),
    (r"^layers\.(\d+)\.mlp\.up_proj\.", r"transformer.blocks.\1.up_proj."),
    (r"^layers\.(\d+)\.mlp\.down_proj\.", r"transformer.blocks.\1.ff_out."),
]


def canonical_name(name: str) -> str:
    """Map a checkpoint tensor name (LLaDA or Qwen2/Dream) to this model's parameter name."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("transformer."):
        return name
    for pattern, repl in _QWEN2_RULES:
        new, n = re.subn(pattern, repl, name)
        if n:
            return new
    m = re.match(r"^layers\.(\d+)\.attention\.query_key_value\.(weight|bias)$", name)
    if m:  # split by the loader
        return f"transformer.blocks.{m.group(1)}.attention.query_key_value.{m.group(2)}"
    return name


_FUSED_QKV = re.compile(r"^transformer\.blocks\.(\d+)\.attention\.query_key_value\.(weight|bias)$")


def checkpoint_parts(ckpt_name: str, f, cfg: ModelConfig) -> list[tuple[str, Optional[tuple[int, int]]]]:
    """Our names of checkpoint tensor `ckpt_name` (in the open safetensors file `f`) with the rows
    each takes (None: all of them). LLaDA2's fused `attention.query_key_value` is three tensors,
    its rows [q heads | k heads | v heads]; every other tensor is one."""
    name = canonical_name(ckpt_name)
    m = _FUSED_QKV.match(name)
    if m is None:
        return [(name, None)]
    layer, kind = m.groups()
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    rows = f.get_slice(ckpt_name).get_shape()[0]
    if rows != q + 2 * kv:
        raise ModelLoadError(f"fused query_key_value of layer {layer} has {rows} rows, expected {q + 2 * kv}")
    bounds = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}
    return [(f"transformer.blocks.{layer}.{p}_proj.{kind}", bounds[p]) for p in "qkv"]


INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "kaiming_uniform_",
                  "kaiming_normal_", "xavier_uniform_", "xavier_normal_")


@contextlib.contextmanager
def skip_meta_init() -> Iterator[None]:
    """Skip torch.nn.init on meta tensors while `load_model` builds its model. The loader builds on
    the meta device and assigns the checkpoint's tensors, so the random init never reaches a
    weight; but torch runs it anyway, and the first meta `normal_` imports torch._dynamo (about
    1 s of `celeris run`'s start-up on a small model). Real tensors are initialized as usual.
    (It swaps torch.nn.init's functions for the duration: load models from one thread.)"""
    saved = {name: getattr(torch.nn.init, name) for name in INIT_FUNCTIONS}

    def skipping(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def init(tensor, *args, **kwargs):
            return tensor if getattr(tensor, "is_meta", False) else fn(tensor, *args, **kwargs)
        return init

    for name, fn in saved.items():
        setattr(torch.nn.init, name, skipping(fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def router_bias(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The MoE router's expert_bias as the published LLaDA2 model holds it: a buffer, so
    `model.to(dtype)` rounds it to the model dtype (bf16 on the published checkpoints), and the
    router adds it to its float32 scores. Kept in a float32 tensor holding those rounded values."""
    return t.to(dtype).to(torch.float32)


def load_model(folder: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu") -> MaskPredictor:
    folder = checkpoint_folder(folder)
    cfg = ModelConfig.from_dir(folder)
    torch_dtype = resolve_dtype(dtype)
    with torch.device("meta"), skip_meta_init():
        model = MaskPredictor(cfg)

    def convert(name: str, t: torch.Tensor) -> torch.Tensor:
        return (router_bias(t, torch_dtype) if name.endswith("expert_bias") else t.to(torch_dtype)).to(device=device)

    state = StrictState(folder, {name: p.shape for name, p in model.state_dict().items()}, convert)
    for ckpt_name, path, f in tensors(folder):  # memory-mapped
        t = f.get_tensor(ckpt_name)
        for name, rows in checkpoint_parts(ckpt_name, f, cfg):
            state.put(name, t if rows is None else t[rows[0]:rows[1]], ckpt_name, path)
    model.load_state_dict(state.done(), strict=True, assign=True)
    return model.eval().requires_grad_(False)


# Our names -> SDAR's (Qwen3's) published names, for writing celeris-tiny-block.
_SDAR_NAMES = [
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
]


def _sdar_name(name: str) -> str:
    for pattern, repl in _SDAR_NAMES:
        new, n = re.subn(pattern, repl, name)
        if n:
            return new
    raise ModelLoadError(f"no SDAR name for parameter {name}")


def save_model(model: MaskPredictor, folder: str | Path, extra_config: dict | None = None) -> None:
    """Write config.json + model.safetensors: LLaDA naming for full-canvas models (celeris-tiny),
    SDAR's published naming for SDAR models (celeris-tiny-block)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.cfg.to_json() | (extra_config or {})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    rename = _sdar_name if model.cfg.arch == "sdar" else (lambda k: f"model.{k}")
    tensors = {rename(k): v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
