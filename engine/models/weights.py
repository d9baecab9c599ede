"""Checkpoint loading and saving.

Folders are Hugging Face style: `config.json`, `model.safetensors` or a sharded
`model.safetensors.index.json`, plus `tokenizer.json`. The model is built on the meta device
and the tensors are memory-mapped from safetensors and assigned directly, so an 8B checkpoint
never exists twice in memory. Loading is strict (`checkpoint.StrictState`): a missing,
unexpected or mis-shaped tensor is an error naming the tensor and its file. What the folder's
config means and what its checkpoint calls each tensor is its architecture card's: these take the
parsed config and the card's naming (engine/families/checkpoint.py reads a folder through its card).
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from safetensors.torch import save_file

from celeris.engine.config import ModelConfig
from celeris.engine.errors import ModelLoadError
from celeris.engine.models.checkpoint import StrictState, checkpoint_folder, resolve_dtype, tensors
from celeris.engine.models.transformer import MaskPredictor

TensorName = Callable[[str], Optional[str]]  # a checkpoint tensor's name -> the model's (an ArchCard's)


@dataclass(frozen=True)
class Checkpoint:
    """A mask model's folder as its architecture card reads it (engine/families/checkpoint.py):
    picklable, so tensor-parallel workers receive it whole."""

    folder: Path
    cfg: ModelConfig
    tensor_name: TensorName  # a checkpoint tensor's name -> the model's (None: left out)

_FUSED_QKV = re.compile(r"^transformer\.blocks\.(\d+)\.attention\.query_key_value\.(weight|bias)$")


def checkpoint_parts(ckpt_name: str, f, cfg: ModelConfig,
                     tensor_name: TensorName) -> list[tuple[str, Optional[tuple[int, int]]]]:
    """Our names of checkpoint tensor `ckpt_name` (in the open safetensors file `f`), as the
    architecture's card names it (`tensor_name`), with the rows each takes (None: all of them). A
    fused `attention.query_key_value` (LLaDA2's) is three tensors, its rows [q heads | k heads | v
    heads]; every other tensor is one."""
    name = tensor_name(ckpt_name)
    if name is None:  # a tensor the architecture leaves out
        return []
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
    """Skip torch.nn.init on meta tensors while `load_checkpoint` builds its model. The loader builds on
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


def load_checkpoint(ckpt: Checkpoint, dtype: str | torch.dtype = "float32", device: str = "cpu") -> MaskPredictor:
    """The mask model of a checkpoint, on this process."""
    folder, cfg = checkpoint_folder(ckpt.folder), ckpt.cfg
    torch_dtype = resolve_dtype(dtype)
    with torch.device("meta"), skip_meta_init():
        model = MaskPredictor(cfg)

    def convert(name: str, t: torch.Tensor) -> torch.Tensor:
        return (router_bias(t, torch_dtype) if name.endswith("expert_bias") else t.to(torch_dtype)).to(device=device)

    state = StrictState(folder, {name: p.shape for name, p in model.state_dict().items()}, convert)
    for ckpt_name, path, f in tensors(folder):  # memory-mapped
        t = f.get_tensor(ckpt_name)
        for name, rows in checkpoint_parts(ckpt_name, f, cfg, ckpt.tensor_name):
            state.put(name, t if rows is None else t[rows[0]:rows[1]], ckpt_name, path)
    model.load_state_dict(state.done(), strict=True, assign=True)
    return model.eval().requires_grad_(False)


def write_checkpoint(model: MaskPredictor, folder: str | Path, config: dict[str, Any],
                     published_name: Callable[[str], str]) -> None:
    """Write `config` as config.json and the weights as model.safetensors, each tensor under its
    published name (the card's writer: engine/families/checkpoint.py)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {published_name(k): v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
