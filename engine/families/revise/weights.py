"""Strict loading of a published DiffusionGemma folder (text model only).

The folder stores the shared text weights under `model.decoder.` (the encoder's are tied to them),
the encoder's own `layer_scalar`s under `model.encoder.language_model.`, and a vision tower under
`model.encoder.vision_tower.` / `model.encoder.embed_vision.`, which celeris leaves out and says so.
Every other tensor must map onto the model, and every model tensor must be present.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Optional

import torch

from celeris.engine.config import read_json
from celeris.engine.errors import ModelLoadError
from celeris.engine.families.revise.model import DiffusionGemma
from celeris.engine.families.revise.config import ARCHITECTURE, GemmaConfig, gemma_config
from celeris.engine.models.checkpoint import StrictState, checkpoint_folder, resolve_dtype, tensors

log = logging.getLogger(__name__)
LEFT_OUT = ("model.encoder.vision_tower.", "model.encoder.embed_vision.", "model.encoder.embed_audio.",
            "model.encoder.audio_tower.")
_SC = "model.decoder.self_conditioning."


def celeris_name(name: str) -> Optional[str]:
    """The model's name for a checkpoint tensor; None for what is left out."""
    if name.startswith(LEFT_OUT):
        return None
    m = re.fullmatch(r"model\.encoder\.language_model\.layers\.(\d+)\.layer_scalar", name)
    if m:
        return f"layers.{m.group(1)}.encoder_layer_scalar"
    if name.startswith(_SC + "pre_norm."):
        return "self_conditioning_pre_norm." + name[len(_SC + "pre_norm."):]
    if name.startswith(_SC):
        return "self_conditioning." + name[len(_SC):]
    for prefix in ("model.decoder.", "model.encoder.language_model."):
        if name.startswith(prefix):
            rest = name[len(prefix):]
            return "embed.weight" if rest == "embed_tokens.weight" else rest
    if name == "lm_head.weight":
        return name
    raise ModelLoadError(f"checkpoint tensor {name!r} is not part of a DiffusionGemma text model")


def load_gemma(folder: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu") -> DiffusionGemma:
    folder = checkpoint_folder(folder)
    raw = read_json(folder, "config.json", required=True)
    if ARCHITECTURE not in (raw.get("architectures") or []):
        raise ModelLoadError(f"{folder}: config.json does not name {ARCHITECTURE}")
    cfg = gemma_config(raw, name=folder.resolve().name)
    with torch.device("meta"):  # no random init, and no float32 copy of the model on the host
        model = DiffusionGemma(cfg).to(resolve_dtype(dtype))
    want = model.state_dict()
    state = StrictState(folder, {name: t.shape for name, t in want.items()},
                        # each tensor straight there, as its own allocation: the file's buffer may be
                        # aligned otherwise, and MKL's matmul rounding depends on its operands' alignment
                        lambda name, t: t.to(device=device, dtype=want[name].dtype, copy=True))
    skipped = 0
    for name, path, f in tensors(folder):
        ours = celeris_name(name)
        if ours is None:
            skipped += 1
            continue
        if ours in state and name.startswith("model.encoder.language_model."):
            continue  # an encoder copy of a shared weight the decoder already gave
        state.put(ours, f.get_tensor(name), name, path)
    model.load_state_dict(state.done(), strict=True, assign=True)
    if cfg.left_out or skipped:
        log.warning("%s: serving the text model only; left out: %s (%d tensors)", folder.name,
                    ", ".join(cfg.left_out) or "non-text towers", skipped)
    return model.eval()


def random_gemma(cfg: GemmaConfig, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
                 seed: int = 0) -> DiffusionGemma:
    """A model of `cfg`'s shapes with random weights, made in place on the device in its dtype (no
    float32 copy on the way: the 26B-A4B shapes fit one GPU only so), for benchmarks and device
    tests: a step's cost and memory depend on shapes, not values. Norms and scalars are ones."""
    with torch.device("meta"):
        model = DiffusionGemma(cfg).to(resolve_dtype(dtype))
    model = model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if "norm" in name or name.endswith(("scalar", "scale")):
                t.fill_(1.0)
            else:
                t.normal_(0.0, 0.02, generator=g)
    return model.eval()
