"""Nemotron-Labs-Diffusion's architecture card (engine/families/card.py).

Its folder is the released one (config.json of `NemotronLabsDiffusionModel`, tensors named as the
model's modules, nemotron/weights.py), and it selects by its own rules (nemotron/sequence.py), so
its card has no selection rule. Its modes are the published model's three `generate` methods;
self-speculation is served only where the draft adapter (`linear_spec_lora/`) was loaded.
"""

from __future__ import annotations

from typing import Any

from celeris.engine.families.card import ArchCard, names_any
from celeris.engine.families.nemotron.config import ARCHITECTURE, MODEL_TYPE, nemotron_config
from celeris.engine.families.nemotron.sequence import AR, DIFFUSION, LINEAR_SPEC
from celeris.engine.families.nemotron.weights import tensor_name


def modes(cfg: Any) -> tuple[str, ...]:
    """The decoding modes a loaded model serves, its default first."""
    return (DIFFUSION, AR, LINEAR_SPEC) if getattr(cfg, "draft_adapter", False) else (DIFFUSION, AR)


NEMOTRON = ArchCard(
    name="nemotron-labs-diffusion", architectures=(ARCHITECTURE,),
    claims=lambda raw, folder: raw.get("model_type") == MODEL_TYPE or names_any(raw, ARCHITECTURE),
    parse=nemotron_config, tensor_name=tensor_name, modes=modes)

CARDS = (NEMOTRON,)
__all__ = ["CARDS", "NEMOTRON", "modes"]
