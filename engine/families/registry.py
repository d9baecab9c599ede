"""The decoding families, one row each: what the rest of the engine asks instead of the family's kind.

A row claims a checkpoint folder, loads its model, names the runner that steps its requests and
the `Sequence` class that holds each request's state (and how a request's parameters become that
state), and the warm-up request the server runs before it reports ready. `LLM.load` walks the rows
in order and loads with the first that claims the folder; a loaded model's `Family` (decided once
from its config, engine/families/family.py) finds its row by kind. Adding a family is a folder
beside canvas/, block/ and revise/ and one row here (docs/architecture.md).

| row    | models                 | runner      | request state    |
|--------|------------------------|-------------|------------------|
| revise | DiffusionGemma         | ReviseRunner| RevisingSequence |
| block  | SDAR, LLaDA2, LLaDA2.1 | BlockRunner | BlockSequence    |
| canvas | LLaDA, Dream           | Runner      | Sequence         |
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from celeris.engine.config import EngineConfig, ModelConfig
from celeris.engine.errors import ModelLoadError
from celeris.engine.families.block.runner import BlockRunner
from celeris.engine.families.block.sequence import BlockSequence
from celeris.engine.families.canvas.runner import Runner
from celeris.engine.families.family import BLOCK, FULL, REVISE, Family
from celeris.engine.families.revise.config import generation_eos
from celeris.engine.families.revise.runner import ReviseRunner
from celeris.engine.families.revise.sequence import RevisingSequence
from celeris.engine.families.revise.weights import is_gemma_folder, load_gemma
from celeris.engine.loop.sequence import Sequence
from celeris.engine.models.weights import load_model
from celeris.engine.sampling.params import SamplingParams

# (params, family, engine config) -> (the params as the family decodes them, extra Sequence fields)
Shape = Callable[[SamplingParams, Family, EngineConfig], tuple[SamplingParams, dict[str, Any]]]


@dataclass(frozen=True)
class Row:
    kind: str  # the Family.kind it serves: FULL, BLOCK or REVISE
    claims: Callable[[Path], bool]  # whether a checkpoint folder is this family's
    loader: Callable[[Path, EngineConfig], Any]  # the folder's model (its `.cfg` names the family)
    runner: type  # the StepRunner: runner(model, config, family)
    sequence: type  # the Sequence class of its requests
    shape: Shape  # how a request's parameters become its Sequence (see Shape)
    warmup: tuple[tuple[str, Any], ...] = ()  # the server's warm-up request, over the tiny one below
    documents: bool = True  # serves structured outputs' whole-document path (else the skeleton only)
    # Scores a choice's options for typed decisions (engine/sampling/choice.py: its runner ends a
    # step with selection.select_step); else such a request is refused by name.
    choice_probabilities: bool = True

    def load(self, folder: Path, config: EngineConfig) -> Any:
        return self.loader(folder, config)

    def new_sequence(self, family: Family, config: EngineConfig, request_id: str, prompt: list[int],
                     params: SamplingParams, **fields: Any) -> Sequence:
        """A validated request's decoding state (seed already filled in)."""
        params, extra = self.shape(params, family, config)
        return self.sequence(request_id, prompt, params, **extra, **fields)

    def warmup_params(self) -> SamplingParams:
        """One tiny generation through the real path, so the first user request is not the slow one."""
        return replace(SamplingParams(gen_length=1, steps=1, block_length=1, seed=0), **dict(self.warmup))


# ------------------------------------------------------------------ loading


def _load_masked(folder: Path, config: EngineConfig) -> Any:
    """A mask model (canvas or block family), on this process or over tensor/expert-parallel workers."""
    if config.tensor_parallel_size != 1 or config.expert_parallel:
        from celeris.engine.parallel.launch import start  # worker processes, torch.distributed

        return start(folder, config)
    return load_model(folder, dtype=config.dtype, device=config.device)


def _load_revising(folder: Path, config: EngineConfig) -> Any:
    """A DiffusionGemma folder's text model (what is left out is logged), with the stop ids its
    generation_config.json adds. One process, on the CPU or one CUDA device: no parallel path yet."""
    if config.tensor_parallel_size != 1 or config.expert_parallel:
        raise ModelLoadError("DiffusionGemma is served on one process only (no tensor/expert parallel yet)")
    if torch.device(config.device).type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"DiffusionGemma: device {config.device!r} asked for, but torch sees no CUDA device here")
    model = load_gemma(folder, dtype=config.dtype, device=config.device)
    eos = tuple(dict.fromkeys(model.cfg.eos_token_ids + generation_eos(folder)))
    model.cfg = replace(model.cfg, eos_token_ids=eos)  # the tokenizer's stop ids
    return model


def _is_block_folder(folder: Path) -> bool:
    try:
        return ModelConfig.from_dir(folder).family == BLOCK
    except ModelLoadError:
        return False  # the canvas row's loader says what is wrong with it


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


# ------------------------------------------------------------------ the rows, in claiming order

ROWS: tuple[Row, ...] = (
    Row(REVISE, is_gemma_folder, _load_revising, ReviseRunner, RevisingSequence, _revise_shape,
        warmup=(("max_denoising_steps", 1),),  # one denoising step of one canvas
        documents=False,  # not yet: its canvases commit another way
        choice_probabilities=False),  # its canvases are re-sampled whole, not one slot front a step
    Row(BLOCK, _is_block_folder, _load_masked, BlockRunner, BlockSequence, _block_shape),
    Row(FULL, lambda folder: True, _load_masked, Runner, Sequence, _canvas_shape),  # the ordinary loader's
)
_BY_KIND = {r.kind: r for r in ROWS}


def claim(folder: Path) -> Row:
    """The row whose family a checkpoint folder holds."""
    return next(r for r in ROWS if r.claims(folder))


def row_of(family: Family) -> Row:
    """A loaded model's row."""
    return _BY_KIND[family.kind]


__all__ = ["ROWS", "Row", "claim", "row_of"]
