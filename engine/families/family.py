"""Model families, decided once when a model loads.

A family says how requests of a model decode: which runner steps them (a whole canvas, or block by
block over an exact cache), how its published sampler picks tokens (`SelectionRule`), which
defaults a request starts from, and which sampling options it refuses. Its kind is its registry
row's; its rule, defaults and token editing are its architecture card's (engine/families/card.py);
`registry.family_of` puts the two together. Everything else in the engine asks the `Family`, never
the config's architecture name.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Optional

from celeris.engine.errors import FieldViolation
from celeris.engine.sampling.batch import SelectionRule
from celeris.engine.sampling.knobs import KNOBS, Knob, only, read_by
from celeris.engine.sampling.params import MASK, REVISE as REVISING, SamplingParams

FULL, BLOCK, REVISE, CAUSAL = "full", "block", "revise", "causal"
# The knobs only a revising family reads, and the mask-model knobs it does not have: both from
# the knob table (SamplingParams' `only=` tags).
REVISE_KNOBS = only(REVISING)
_NOT_REVISING = only(MASK)


@dataclass(frozen=True)
class Family:
    arch: str  # its architecture card's name (reported, never compared)
    # FULL (LLaDA, Dream: a whole canvas, approximate caches), BLOCK (SDAR, LLaDA2: exact cache) or
    # REVISE (DiffusionGemma: uniform-noise canvases re-sampled until a rule stops each; what a
    # stream shows of the canvas being denoised may still change)
    kind: str
    rule: Optional[SelectionRule]
    block_length: int = 0  # the trained block size of a block family (a revising one's canvas length)
    edits: bool = False  # LLaDA2.1: written tokens of the current block may be replaced (token editing)
    defaults: tuple[tuple[str, Any], ...] = ()  # its card's published defaults, over the kind's
    routing_block: int = 0  # a block-routed MoE's block (LLaDA2.2): block lengths are multiples of it
    # CAUSAL (Nemotron-Labs-Diffusion): the decoding modes it serves (`SamplingParams.decoding`), the
    # default first; () for a family with one way to decode.
    modes: tuple[str, ...] = ()

    @property
    def block(self) -> bool:
        return self.kind == BLOCK

    @property
    def revising(self) -> bool:
        """Shown tokens may change until final (DiffusionGemma), not only masks get filled."""
        return self.kind == REVISE

    @property
    def decoder(self) -> str:
        """Which knobs it reads (the knob table's MASK or REVISE)."""
        return REVISING if self.revising else MASK

    @property
    def model_knobs(self) -> tuple[Knob, ...]:
        """The knobs a checkpoint's generation_config.json may set: a mask model's every knob it
        reads (celeris keys); a revising model's own only (its file is transformers' format, where
        a key of another knob's name, `temperature`, `top_k`, means something else)."""
        if self.kind == CAUSAL:  # transformers' file, whose temperature / top_k are its sampler's: none read
            return ()
        own = read_by(self.decoder) if self.decoder == MASK else tuple(k for k in KNOBS if k.only == REVISING)
        return tuple(k for k in own if not k.per_request)

    @property
    def simulable(self) -> bool:
        """Whether the simulated runner (engine/loop/sim_runner.py) can stand in for its runner:
        plain mask canvases (LLaDA, Dream), no block cache or revising canvases."""
        return self.kind == FULL

    def kv_cache(self, configured: str) -> str:
        """What a request decodes over when it asks for nothing: the engine's configured
        approximate cache for a full canvas, the exact cache of block and revising families."""
        return configured if self.kind == FULL else "exact"

    def base_params(self) -> SamplingParams:
        """Defaults before a checkpoint's own: the kind's, then the card's published ones. A block
        family decodes in its trained block size, one token per step (SDAR's and LLaDA2's published
        step counts equal the block length)."""
        base = SamplingParams()
        if self.revising:  # one canvas; steps and blocks mean nothing to it (its knobs are REVISE_KNOBS)
            base = replace(base, gen_length=self.block_length, block_length=self.block_length, steps=1)
        elif self.block or self.kind == CAUSAL:
            base = replace(base, block_length=self.block_length, steps=base.gen_length)
        return replace(base, **dict(self.defaults))

    def violations(self, p: SamplingParams) -> list[FieldViolation]:
        """Options this family's decoding does not have, by field."""
        if self.revising:
            return self._revise_violations(p)
        if self.kind == CAUSAL:
            return self._causal_violations(p)
        base = SamplingParams()
        bad = [FieldViolation(name, "only revising models (DiffusionGemma) have it")
               for name in REVISE_KNOBS if getattr(p, name) != getattr(base, name)]
        if p.decoding is not None:
            bad.append(FieldViolation("decoding", "only Nemotron-Labs-Diffusion has decoding modes"))
        if p.editing_threshold is not None and not self.edits:
            bad.append(FieldViolation("editing_threshold", "this model never replaces a token it wrote; token editing "
                                                           "is LLaDA2.1's"))
        if not self.block:
            return bad
        if self.routing_block and p.block_length % self.routing_block:
            bad.append(FieldViolation("block_length", f"must be a multiple of {self.routing_block}: this model's "
                                                      f"experts are chosen per {self.routing_block}-token block"))
        if p.kv_cache not in (None, "none"):
            bad.append(FieldViolation("kv_cache", "block-diffusion models always decode over their exact block "
                                                  "cache; prefix/dual are full-canvas approximations"))
        if p.schedule != "llada":
            bad.append(FieldViolation("schedule", "block-diffusion models use their published per-block schedule"))
        if p.cfg_scale > 0:
            bad.append(FieldViolation("cfg_scale", "classifier-free guidance is not supported for block-diffusion "
                                                   "models"))
        return bad

    def _causal_violations(self, p: SamplingParams) -> list[FieldViolation]:
        """Nemotron-Labs-Diffusion: its modes (self-speculation only with the draft adapter loaded),
        and the knobs its published loops have (block_length, threshold, temperature, seed, stops)."""
        bad = []
        if p.decoding is not None and p.decoding not in self.modes:
            why = ("needs the draft adapter (linear_spec_lora/ beside the checkpoint), which this server did not "
                   "load" if p.decoding == "linear_spec" else "not a mode of this model")
            bad.append(FieldViolation("decoding", f"{p.decoding}: {why}; served: {', '.join(self.modes)}"))
        base = {f.name: f.default for f in fields(SamplingParams)}
        unread = ("remasking", "factor", "editing_threshold", "factor_rule", "schedule", "top_k", "top_p", "min_p",
                  "frequency_penalty", "presence_penalty", "min_tokens", "logprobs", "cfg_scale", *REVISE_KNOBS)
        bad += [FieldViolation(name, "not a knob of Nemotron-Labs-Diffusion's published loops (its knobs: decoding, "
                                     "block_length, threshold, temperature, seed, stops)")
                for name in unread if getattr(p, name) != base[name]]
        if p.kv_cache not in (None, "none", "exact"):
            bad.append(FieldViolation("kv_cache", "Nemotron-Labs-Diffusion always decodes over its exact causal cache"))
        return bad

    @staticmethod
    def _revise_violations(p: SamplingParams) -> list[FieldViolation]:
        """DiffusionGemma samples by its own temperature schedule and entropy bound: the mask
        models' selection knobs are refused when set away from their defaults."""
        base = {f.name: f.default for f in fields(SamplingParams)}
        bad = [FieldViolation(name, "not a knob of revising models (DiffusionGemma): see max_denoising_steps, "
                                    "entropy_bound, t_min, t_max, stability_threshold, confidence_threshold")
               for name in _NOT_REVISING if getattr(p, name) != base[name]]
        if p.kv_cache not in (None, "none", "exact"):
            bad.append(FieldViolation("kv_cache", "revising models always decode over their exact cache"))
        return bad


# A folder's defaults read without its config (`llm.model_defaults(folder)`): a whole-canvas mask
# model's knobs, no card's defaults over them.
PLAIN = Family("", FULL, None)
