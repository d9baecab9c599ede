"""Tiny Nemotron-Labs-Diffusion folders written by tests: the released config keys and tensor names
(engine/families/nemotron), random weights, celeris-tiny's tokenizer, and a random draft adapter
in `linear_spec_lora/` as PEFT writes it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from celeris.engine.families.nemotron.config import NemotronConfig
from celeris.engine.families.nemotron.weights import random_nemotron, write_nemotron
from celeris.engine.llm import EMBEDDED_MODELS

TINY = EMBEDDED_MODELS["celeris-tiny"]


def tiny_nemotron_config(**kw) -> NemotronConfig:
    """YaRN over an original length of 32 (factor 4) and the Llama-4 query scale from position 32
    on, so decodes past it exercise both."""
    vocab = json.loads((TINY / "config.json").read_text())["vocab_size"]
    base = dict(d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, n_layers=2, mlp_hidden_size=128, vocab_size=vocab,
                rms_norm_eps=1e-5, mask_token_id=3, eos_token_id=2, block_length=8, max_sequence_length=128,
                rope_theta=10000.0, rope_type="yarn", rope_factor=4.0, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                mscale_all_dim=0.0, original_max_positions=32, llama4_beta=0.1, name="tiny-nemotron")
    return NemotronConfig(**(base | kw))


def write_tiny_nemotron(folder: Path, adapter: bool = True, seed: int = 3, **kw) -> Path:
    """A tiny folder: config.json, model.safetensors, tokenizer, and (adapter) linear_spec_lora/."""
    model = random_nemotron(tiny_nemotron_config(**kw), seed=seed)
    write_nemotron(model, folder, lora_rank=16 if adapter else 0, lora_alpha=32.0)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TINY / name, folder / name)
    return folder
