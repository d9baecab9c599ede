"""The revise family's architecture: DiffusionGemma (engine/families/card.py).

Its folder is transformers' (the text model nested under `text_config`, revise/config.py), its
tensors are named as revise/weights.py reads them, and it selects by its own sampler
(revise/sampler.py), so its card has no selection rule; its defaults are its kind's (one canvas).
"""

from __future__ import annotations

from celeris.engine.families.card import ArchCard, names_any
from celeris.engine.families.revise.config import ARCHITECTURE, gemma_config
from celeris.engine.families.revise.weights import celeris_name

GEMMA = ArchCard(
    name="diffusion-gemma", architectures=(ARCHITECTURE,),
    claims=lambda raw, folder: names_any(raw, ARCHITECTURE), parse=gemma_config, tensor_name=celeris_name)

CARDS = (GEMMA,)
__all__ = ["CARDS", "GEMMA"]
