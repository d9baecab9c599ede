"""Loading a Nemotron-Labs-Diffusion folder, and the draft adapter beside it.

The checkpoint names its tensors as the model's modules are named (`encoder.*`, `diffusion_head.*`),
so loading is strict by name (`models.checkpoint.StrictState`); RoPE buffers a checkpoint may
carry are left out. Self-speculation's draft adapter is a PEFT LoRA folder,
`linear_spec_lora/` beside config.json: `adapter_config.json` (r, lora_alpha, target_modules,
use_rslora) and `adapter_model.safetensors` with `...layers.{i}.self_attn.o_proj.lora_A.weight`
(r, in) and `lora_B.weight` (out, r), under PEFT's `base_model.model.` prefix. Without that folder
the model serves autoregressive and block-diffusion decoding, and refuses self-speculation by field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from celeris.engine.config import read_json
from celeris.engine.errors import ModelLoadError
from celeris.engine.families.nemotron.config import NemotronConfig, config_json, inv_freq, nemotron_config
from celeris.engine.families.nemotron.model import LoRALinear, NemotronLM
from celeris.engine.models.checkpoint import StrictState, checkpoint_folder, resolve_dtype, tensors

ADAPTER = "linear_spec_lora"  # the adapter's folder, beside the checkpoint's files
_LORA = re.compile(r"(?:.*\.)?layers\.(\d+)\.self_attn\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


def tensor_name(name: str) -> Optional[str]:
    """A checkpoint tensor's name in the model (the same), None for RoPE buffers."""
    return None if name.endswith("rotary_emb.inv_freq") else name


def load_nemotron(folder: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu") -> NemotronLM:
    """A folder's model, strictly, with its draft adapter when `linear_spec_lora/` is there."""
    folder = checkpoint_folder(folder)
    cfg = nemotron_config(read_json(folder, "config.json", required=True), folder.resolve().name)
    with torch.device("meta"):
        model = NemotronLM(cfg).to(resolve_dtype(dtype))
    want = model.state_dict()
    state = StrictState(folder, {n: t.shape for n, t in want.items()},
                        lambda n, t: t.to(device=device, dtype=want[n].dtype, copy=True))
    for name, path, f in tensors(folder):
        ours = tensor_name(name)
        if ours is not None:
            state.put(ours, f.get_tensor(name), name, path)
    model.load_state_dict(state.done(), strict=True, assign=True)
    freq, model.rope_scale = inv_freq(model.cfg)  # the non-persistent RoPE buffer a meta build left empty
    model.inv_freq = freq.to(device)
    if (folder / ADAPTER).is_dir():
        attach_adapter(model, folder / ADAPTER)
    return model.eval()


def attach_adapter(model: NemotronLM, folder: str | Path) -> None:
    """Read a PEFT LoRA folder onto the model's targeted projections (o_proj as released)."""
    folder = Path(folder)
    raw = read_json(folder, "adapter_config.json", required=True)
    if raw.get("peft_type", "LORA") != "LORA":
        raise ModelLoadError(f"{folder}: adapter_config.json peft_type {raw.get('peft_type')!r} is not LORA")
    r, alpha = int(raw["r"]), float(raw.get("lora_alpha", raw["r"]))
    scaling = alpha / math.sqrt(r) if raw.get("use_rslora") else alpha / r
    targets = raw.get("target_modules") or ["o_proj"]
    targets = [targets] if isinstance(targets, str) else list(targets)
    if set(targets) - {"o_proj"}:
        raise ModelLoadError(f"{folder}: the draft adapter targets {targets}; celeris applies it on o_proj only")
    path = folder / "adapter_model.safetensors"
    if not path.is_file():
        raise ModelLoadError(f"{folder}: no adapter_model.safetensors")
    found: dict[tuple[int, str], torch.Tensor] = {}
    with safe_open(path, framework="pt", device="cpu") as f:
        for name in f.keys():
            m = _LORA.fullmatch(name)
            if m is None or m.group(2) != "o_proj":
                raise ModelLoadError(f"unexpected tensor {name!r} in {path.name}")
            found[int(m.group(1)), m.group(3)] = f.get_tensor(name)
    layers = model.encoder.layers
    for i, layer in enumerate(layers):
        proj: LoRALinear = layer.self_attn.o_proj
        a, b = found.get((i, "A")), found.get((i, "B"))
        if a is None or b is None:
            raise ModelLoadError(f"{path}: layer {i}'s o_proj lora_A/lora_B missing")
        if a.shape != (r, proj.in_features) or b.shape != (proj.out_features, r):
            raise ModelLoadError(f"{path}: layer {i}'s adapter has shapes {tuple(a.shape)}, {tuple(b.shape)}; "
                                 f"expected {(r, proj.in_features)}, {(proj.out_features, r)}")
        dev, dt = proj.weight.device, proj.weight.dtype
        proj.attach(a.to(dev, dt), b.to(dev, dt), scaling)
    if len(found) != 2 * len(layers):
        raise ModelLoadError(f"{path}: {len(found)} adapter tensors for {len(layers)} layers")
    model.cfg = dataclasses.replace(model.cfg, draft_adapter=True)


# ------------------------------------------------------------------ tiny checkpoints (tests, benchmarks)


def random_nemotron(cfg: NemotronConfig, seed: int = 0) -> NemotronLM:
    """A float32 model with seeded random weights, large enough that its picks are not ties."""
    torch.manual_seed(seed)
    model = NemotronLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.5 if "embed" in name else 0.15)
    return model.eval()


def write_nemotron(model: NemotronLM, folder: str | Path, lora_rank: int = 0, lora_alpha: float = 0.0,
                   seed: int = 1) -> None:
    """config.json + model.safetensors as released; with lora_rank a random draft adapter in
    linear_spec_lora/ as PEFT writes it (also attached to `model`)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config_json(model.cfg), indent=1))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    if not lora_rank:
        return
    g = torch.Generator().manual_seed(seed)
    cfg, adapter = model.cfg, folder / ADAPTER
    adapter.mkdir(exist_ok=True)
    tensors_out = {}
    for i in range(cfg.n_layers):
        prefix = f"base_model.model.encoder.layers.{i}.self_attn.o_proj"
        tensors_out[f"{prefix}.lora_A.weight"] = torch.randn(lora_rank, cfg.n_heads * cfg.head_dim, generator=g) * 0.1
        tensors_out[f"{prefix}.lora_B.weight"] = torch.randn(cfg.d_model, lora_rank, generator=g) * 0.1
    save_file(tensors_out, str(adapter / "adapter_model.safetensors"))
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": None, "r": lora_rank, "lora_alpha": lora_alpha or lora_rank,
        "lora_dropout": 0.0, "target_modules": ["o_proj"], "bias": "none", "use_rslora": False,
        "base_model_name_or_path": folder.name}, indent=1))
    attach_adapter(model, adapter)


__all__ = ["ADAPTER", "attach_adapter", "load_nemotron", "random_nemotron", "tensor_name", "write_nemotron"]
