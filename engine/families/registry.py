"""The decoding families, one row each: what the rest of the engine asks instead of the family's kind.

A row lists its family's architecture cards (engine/families/card.py), loads their models, names
the runner that steps its requests and the `Sequence` class that holds each request's state (and
how a request's parameters become that state), and the warm-up request the server runs before it
reports ready. `load` reads a folder's config.json, refuses an architecture no card serves, and
loads with the row of the first card that claims it; a loaded model's `Family` (`family_of`) is
its card's rule and defaults under its row's kind. Adding an architecture is one card in its
family's folder, listed by its row; adding a family is a folder beside canvas/, block/ and revise/
and one row here (docs/architecture.md).

| row      | kind   | cards                            | runner         | request state    |
|----------|--------|----------------------------------|----------------|------------------|
| revise   | revise | DiffusionGemma                   | ReviseRunner   | RevisingSequence |
| block    | block  | SDAR, LLaDA2.2, LLaDA2.1, LLaDA2 | BlockRunner    | BlockSequence    |
| nemotron | causal | Nemotron-Labs-Diffusion          | NemotronRunner | NemotronSequence |
| canvas   | full   | LLaDA, Dream                     | Runner         | CanvasSequence   |
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from celeris.engine.config import EngineConfig, read_json
from celeris.engine.errors import ModelLoadError
from celeris.engine.families.block import cards as block_cards
from celeris.engine.families.block.runner import BlockRunner
from celeris.engine.families.block.sequence import BlockSequence
from celeris.engine.families.canvas import cards as canvas_cards
from celeris.engine.families.canvas.runner import Runner
from celeris.engine.families.canvas.sequence import CanvasSequence
from celeris.engine.families.card import ArchCard
from celeris.engine.families.family import BLOCK, CAUSAL, FULL, REVISE, Family
from celeris.engine.families.nemotron import card as nemotron_card
from celeris.engine.families.nemotron.runner import NemotronRunner
from celeris.engine.families.nemotron.sequence import NemotronSequence
from celeris.engine.families.nemotron.weights import load_nemotron
from celeris.engine.families.revise import card as revise_card
from celeris.engine.families.revise.config import generation_eos
from celeris.engine.families.revise.runner import ReviseRunner
from celeris.engine.families.revise.sequence import RevisingSequence
from celeris.engine.families.revise.weights import load_gemma
from celeris.engine.families.sequence import DecodeSequence
from celeris.engine.models.checkpoint import checkpoint_folder
from celeris.engine.models.weights import Checkpoint, load_checkpoint
from celeris.engine.sampling.params import SamplingParams

# (params, family, engine config) -> (the params as the family decodes them, extra Sequence fields)
Shape = Callable[[SamplingParams, Family, EngineConfig], tuple[SamplingParams, dict[str, Any]]]


@dataclass(frozen=True)
class Row:
    kind: str  # the Family.kind it serves: FULL, BLOCK or REVISE
    cards: tuple[ArchCard, ...]  # its architectures, in claiming order
    loader: Callable[[Path, EngineConfig, ArchCard], Any]  # a folder's model of a card (`.cfg` names the card)
    runner: type  # the StepRunner: runner(model, config, family)
    sequence: type  # the DecodeSequence class of its requests
    shape: Shape  # how a request's parameters become its Sequence (see Shape)
    warmup: tuple[tuple[str, Any], ...] = ()  # the server's warm-up request, over the tiny one below
    # A structure the model may decline (tool_choice "auto", `Structured.lazy`) decoded under its
    # grammar from the first position. False where canvases are denoised free and only committed
    # under a grammar (revising): no position decides first, so "auto" is parsed after the fact.
    lazy_structures: bool = True
    structured: bool = True  # serves structured outputs at all (else they are refused by field)

    def new_sequence(self, family: Family, config: EngineConfig, request_id: str, prompt: list[int],
                     params: SamplingParams, **fields: Any) -> DecodeSequence:
        """A validated request's decoding state (seed already filled in)."""
        params, extra = self.shape(params, family, config)
        return self.sequence(request_id, prompt, params, **extra, **fields)

    def warmup_params(self, family: Optional[Family] = None) -> SamplingParams:
        """One tiny generation through the real path, so the first user request is not the slow one
        (one routing block where the family's experts are chosen per block, LLaDA2.2's)."""
        n = family.routing_block if family is not None and family.routing_block else 1
        return replace(SamplingParams(gen_length=n, steps=1, block_length=n, seed=0), **dict(self.warmup))


# ------------------------------------------------------------------ loading


def _load_masked(folder: Path, config: EngineConfig, card: ArchCard) -> Any:
    """A mask model (canvas or block family), on this process or over tensor/expert-parallel workers."""
    cfg = card.parse(read_json(folder, "config.json", required=True), folder.resolve().name)
    if cfg.delete_token_id >= 0:  # LLaDA2.2: generation_config.json lists its two stop ids
        cfg = replace(cfg, eos_token_ids=tuple(dict.fromkeys(cfg.eos_token_ids + generation_eos(folder))))
    ckpt = Checkpoint(folder, cfg, card.tensor_name)
    if config.tensor_parallel_size != 1 or config.expert_parallel:
        from celeris.engine.parallel.launch import start  # worker processes, torch.distributed

        return start(ckpt, config)
    return load_checkpoint(ckpt, dtype=config.dtype, device=config.device)


def _load_revising(folder: Path, config: EngineConfig, card: ArchCard) -> Any:
    """A DiffusionGemma folder's text model (what is left out is logged), with the stop ids its
    generation_config.json adds: on this process (the CPU or one CUDA device) or over tensor/expert
    parallel workers (revise/parallel.py)."""
    if torch.device(config.device).type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"DiffusionGemma: device {config.device!r} asked for, but torch sees no CUDA device here")
    if config.tensor_parallel_size != 1 or config.expert_parallel:
        from celeris.engine.families.revise.parallel import start_gemma  # worker processes, torch.distributed

        model = start_gemma(folder, config)
    else:
        model = load_gemma(folder, dtype=config.dtype, device=config.device)
    eos = tuple(dict.fromkeys(model.cfg.eos_token_ids + generation_eos(folder)))
    model.cfg = replace(model.cfg, eos_token_ids=eos)  # the tokenizer's stop ids
    return model


def _load_nemotron(folder: Path, config: EngineConfig, card: ArchCard) -> Any:
    """A Nemotron-Labs-Diffusion folder (and its draft adapter, when there is one), on one process."""
    if config.tensor_parallel_size != 1 or config.expert_parallel:
        raise ModelLoadError("Nemotron-Labs-Diffusion is served on one process only (no tensor parallel yet)")
    return load_nemotron(folder, dtype=config.dtype, device=config.device)


# ------------------------------------------------------------------ request state


def _canvas_shape(p: SamplingParams, family: Family, config: EngineConfig) -> tuple[SamplingParams, dict]:
    """The engine's default cache recorded, so every surface can report it."""
    return (replace(p, kv_cache=family.kv_cache(config.kv_cache)) if p.kv_cache is None else p), {}


def _block_shape(p: SamplingParams, family: Family, config: EngineConfig) -> tuple[SamplingParams, dict]:
    return p, {"prefill_chunk": config.prefill_chunk, "edits": family.edits}


def _revise_shape(p: SamplingParams, family: Family, config: EngineConfig) -> tuple[SamplingParams, dict]:
    """Whole canvases, as transformers writes them, over its exact cache."""
    L = family.block_length
    G = -(-p.gen_length // L) * L
    return replace(p, gen_length=G, block_length=L, steps=G // L, kv_cache="exact"), {}


def _nemotron_shape(p: SamplingParams, family: Family, config: EngineConfig) -> tuple[SamplingParams, dict]:
    """The request's mode (unset: the family's default), over its exact causal cache."""
    mode = p.decoding or family.modes[0]
    return replace(p, decoding=mode, kv_cache="exact"), {"mode": mode, "prefill_chunk": config.prefill_chunk}


# ------------------------------------------------------------------ the rows, in claiming order

ROWS: tuple[Row, ...] = (
    Row(REVISE, revise_card.CARDS, _load_revising, ReviseRunner, RevisingSequence, _revise_shape,
        warmup=(("max_denoising_steps", 1),), lazy_structures=False),  # warm-up: one denoising step of one canvas
    Row(BLOCK, block_cards.CARDS, _load_masked, BlockRunner, BlockSequence, _block_shape),
    # left to right, its tokens final once committed: structured outputs would need a grammar
    # over its causal order (not yet), so they are refused by field
    Row(CAUSAL, nemotron_card.CARDS, _load_nemotron, NemotronRunner, NemotronSequence, _nemotron_shape,
        structured=False, lazy_structures=False),
    Row(FULL, canvas_cards.CARDS, _load_masked, Runner, CanvasSequence, _canvas_shape),
)


def known_architectures() -> tuple[str, ...]:
    """The config.json `architectures` names some card serves, in claiming order."""
    return tuple(dict.fromkeys(a for row in ROWS for card in row.cards for a in card.architectures))


def refuse_unknown_architectures(raw: dict[str, Any]) -> None:
    """A config naming an architecture no card serves is refused rather than guessed from its keys
    (a relabelled Qwen2-style config used to be served as Dream)."""
    archs, known = raw.get("architectures") or [], known_architectures()
    if not isinstance(archs, list):
        raise ModelLoadError(f"config.json: 'architectures' must be a list, got {archs!r}")
    unknown = [a for a in archs if a not in known]
    if unknown:
        raise ModelLoadError(f"config.json names architecture {', '.join(map(repr, unknown))}, which celeris does "
                             f"not serve (supported: {', '.join(known)})")


def first_card(raw: dict[str, Any], folder: Optional[Path] = None) -> tuple[Row, ArchCard]:
    """(row, card) of a raw config.json (and its folder, when there is one): the first card that
    claims it, once no name in its `architectures` is refused."""
    refuse_unknown_architectures(raw)
    for row in ROWS:
        for card in row.cards:
            if card.claims(raw, folder):
                return row, card
    raise ModelLoadError(f"config.json is of no architecture celeris serves: it names none in 'architectures' "
                         f"({', '.join(known_architectures())}) and no card claims its keys")


def claim_card(folder: str | Path) -> tuple[Row, ArchCard, dict[str, Any]]:
    """(row, card, raw config.json) of a checkpoint folder."""
    folder = checkpoint_folder(folder)
    raw = read_json(folder, "config.json", required=True)
    return (*first_card(raw, folder), raw)


def claim(folder: str | Path) -> Row:
    """The row whose family a checkpoint folder holds."""
    return claim_card(folder)[0]


def load(folder: str | Path, config: EngineConfig) -> Any:
    """A checkpoint folder's model, loaded by the row of the card that claims it."""
    row, card, _ = claim_card(folder)
    return row.loader(Path(folder), config, card)


def card_named(name: str) -> ArchCard:
    """The architecture card of that name."""
    for row in ROWS:
        for card in row.cards:
            if card.name == name:
                return card
    raise ModelLoadError(f"no architecture card is named {name!r}")


def card_of(cfg: Any) -> ArchCard:
    """A model config's architecture card (by the name its card gave it)."""
    return card_named(cfg.arch)


def row_of(family: Family) -> Row:
    """A loaded model's row."""
    return next(r for r in ROWS if r.kind == family.kind)


def family_of(cfg: Any) -> Family:
    """The family of a model config (a ModelConfig, or DiffusionGemma's GemmaConfig): its row's kind,
    its card's rule, defaults and token editing, and the block (or canvas) length it decodes in."""
    card = card_of(cfg)
    row = next(r for r in ROWS if card in r.cards)
    length = getattr(cfg, "canvas_length", 0) if row.kind == REVISE else cfg.block_length if row.kind in (
        BLOCK, CAUSAL) else 0
    rule = card.rule(cfg.mask_token_id) if card.rule is not None else None
    modes = card.modes(cfg) if card.modes is not None else ()
    return Family(card.name, row.kind, rule, length, card.edits, card.defaults,
                  routing_block=getattr(cfg, "routing_block", 0), modes=modes)


__all__ = ["ROWS", "Row", "card_named", "card_of", "claim", "claim_card", "family_of", "first_card", "known_architectures", "load",
           "refuse_unknown_architectures", "row_of"]
