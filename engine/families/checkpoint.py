"""A mask model's checkpoint folder, read and written through its architecture card.

`read_config` finds the card that claims a folder (engine/families/registry.py) and parses its
config.json; `load_model` loads its weights under the card's tensor names; `save_model` writes a
model in its card's format (celeris-tiny in LLaDA's, celeris-tiny-block in SDAR's). The loading
mechanics (strict, memory-mapped) are engine/models/weights.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from celeris.engine.errors import ModelLoadError
from celeris.engine.families import registry
from celeris.engine.models.transformer import MaskPredictor
from celeris.engine.models.weights import Checkpoint, load_checkpoint, write_checkpoint


def read_config(folder: str | Path) -> Any:
    """A checkpoint folder's model config, parsed by the card that claims it."""
    _, card, raw = registry.claim_card(folder)
    return card.parse(raw, Path(folder).resolve().name)


def parse_config(raw: dict[str, Any], name: str = "model", folder: Optional[Path] = None) -> Any:
    """A raw config.json's model config (without its folder, a card that claims by the folder's other
    files, LLaDA2.1's, does not claim it)."""
    return registry.first_card(raw, folder)[1].parse(raw, name)


def open_checkpoint(folder: str | Path) -> Checkpoint:
    """A mask model's checkpoint folder with its config and tensor names, as its card reads them."""
    _, card, raw = registry.claim_card(folder)
    return Checkpoint(Path(folder), card.parse(raw, Path(folder).resolve().name), card.tensor_name)


def load_model(folder: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu") -> MaskPredictor:
    """A mask model's checkpoint folder, on this process."""
    return load_checkpoint(open_checkpoint(folder), dtype=dtype, device=device)


def save_model(model: MaskPredictor, folder: str | Path, extra_config: Optional[dict[str, Any]] = None) -> None:
    """Write config.json + model.safetensors in the model's card's format."""
    card = registry.card_of(model.cfg)
    if card.writes is None or card.published_name is None:
        raise ModelLoadError(f"celeris reads {card.name} checkpoints but does not write them (it writes "
                             f"{', '.join(c.name for r in registry.ROWS for c in r.cards if c.writes)})")
    write_checkpoint(model, folder, card.writes(model.cfg) | (extra_config or {}), card.published_name)


__all__ = ["load_model", "open_checkpoint", "parse_config", "read_config", "save_model"]
