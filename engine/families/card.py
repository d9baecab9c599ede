"""An architecture card: everything the engine knows of one architecture, in one record.

A card says which raw `config.json` files are its architecture's (`claims`), how one becomes the
model config the shared model code reads (`parse`), what its checkpoint calls each tensor
(`tensor_name`, and `published_name` / `writes` for the formats celeris writes), how its published
sampler picks tokens (`rule`) and which sampling parameters its published loop starts from
(`defaults`). Cards live in their family's folder (canvas/cards.py, block/cards.py, revise/card.py)
and each registry row lists its own (engine/families/registry.py), so a new architecture is one card
in one folder: nothing outside families/ asks for an architecture's name.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from celeris.engine.config import ModelConfig
from celeris.engine.errors import ModelLoadError
from celeris.engine.sampling.batch import SelectionRule

Rules = tuple[tuple[str, str], ...]  # (regex, replacement) pairs: the first that matches renames


@dataclass(frozen=True)
class ArchCard:
    name: str  # ModelConfig.arch, and the architecture the server reports
    architectures: tuple[str, ...]  # config.json `architectures` names it serves (any other is refused)
    # Whether a raw config.json (and its folder, when there is one) is of this architecture.
    claims: Callable[[dict, Optional[Path]], bool]
    parse: Callable[[dict, str], Any]  # raw config.json and the folder's name -> the model config
    # A checkpoint tensor's name -> the model's parameter name (None: a tensor celeris leaves out);
    # picklable (module-level, or `renamer`'s): tensor-parallel workers receive it.
    tensor_name: Callable[[str], Optional[str]]
    # Its published sampler's selection, given the mask id (None: the family selects its own way).
    rule: Optional[Callable[[int], SelectionRule]] = None
    # SamplingParams its published loop starts from, over its family's (Family.base_params).
    defaults: tuple[tuple[str, Any], ...] = ()
    edits: bool = False  # its loop may replace tokens it already wrote (LLaDA2.1's token editing)
    # ModelConfig fields every model of it has (arch is the card's name): what `config` starts from.
    traits: tuple[tuple[str, Any], ...] = ()
    # The formats celeris writes (celeris-tiny, celeris-tiny-block): its config.json, and the
    # checkpoint's name of each of the model's parameters. None: celeris reads it only.
    writes: Optional[Callable[[ModelConfig], dict[str, Any]]] = None
    published_name: Optional[Callable[[str], str]] = None
    # Decoding modes a loaded model's config serves, its default first (Nemotron-Labs-Diffusion's
    # ar / diffusion / linear_spec); () for an architecture with one way to decode.
    modes: Optional[Callable[[Any], tuple[str, ...]]] = None

    def config(self, **fields: Any) -> ModelConfig:
        """A model config of this architecture: its traits, then `fields`."""
        return ModelConfig(**({"arch": self.name, **dict(self.traits)} | fields))


def names_any(raw: dict[str, Any], *names: str) -> bool:
    """Whether config.json's `architectures` lists one of `names`."""
    return any(a in names for a in raw.get("architectures") or ())


def rename(rules: Rules, name: str) -> str:
    """A checkpoint tensor's name in the model's (LLaDA's) naming: the leading `model.` dropped,
    then the first rule that matches; a name already in the model's naming passes as it is."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("transformer."):
        return name
    for pattern, repl in rules:
        new, n = re.subn(pattern, repl, name)
        if n:
            return new
    return name


# Qwen2's tensor names -> the model's (LLaDA's), after the leading `model.` is dropped
# (Dream's names; SDAR's are these and the q/k norms: both families' cards use it).
QWEN2_NAMES = (
    (r"^embed_tokens\.", "transformer.wte."),
    (r"^norm\.", "transformer.ln_f."),
    (r"^lm_head\.", "transformer.ff_out."),
    (r"^layers\.(\d+)\.input_layernorm\.", r"transformer.blocks.\1.attn_norm."),
    (r"^layers\.(\d+)\.post_attention_layernorm\.", r"transformer.blocks.\1.ff_norm."),
    (r"^layers\.(\d+)\.self_attn\.o_proj\.", r"transformer.blocks.\1.attn_out."),
    (r"^layers\.(\d+)\.self_attn\.([qkv])_proj\.", r"transformer.blocks.\1.\2_proj."),
    (r"^layers\.(\d+)\.mlp\.gate_proj\.", r"transformer.blocks.\1.ff_proj."),
    (r"^layers\.(\d+)\.mlp\.up_proj\.", r"transformer.blocks.\1.up_proj."),
    (r"^layers\.(\d+)\.mlp\.down_proj\.", r"transformer.blocks.\1.ff_out."),
)


def renamer(rules: Rules) -> Callable[[str], str]:
    """`rename` over fixed rules, as a picklable call (tensor-parallel workers receive it)."""
    return functools.partial(rename, rules)


def published(rules: Rules, what: str, name: str) -> str:
    """One of the model's parameter names in a published naming (for writing a checkpoint)."""
    for pattern, repl in rules:
        new, n = re.subn(pattern, repl, name)
        if n:
            return new
    raise ModelLoadError(f"no {what} name for parameter {name}")


def refuse_unsupported(raw: dict[str, Any], supported: dict[str, tuple[Any, ...]]) -> None:
    """Config keys that change the forward, checked against the values the model computes
    correctly: a checkpoint that sets one to anything else is refused rather than served wrongly."""
    bad = [f"{k}={raw[k]!r} (supported: {', '.join(map(repr, ok))})"
           for k, ok in supported.items() if k in raw and raw[k] not in ok]
    if bad:
        raise ModelLoadError("config.json sets options this model does not implement: " + "; ".join(bad))


def first_id(raw: dict[str, Any], key: str, default: int) -> int:
    """A special token id that a config may record as a list (its first is the id)."""
    v = raw.get(key, default)
    return int(v[0] if isinstance(v, list) else v)
