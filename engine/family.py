"""Model families, decided once when a model loads.

A family says how requests of a model decode: which runner steps them (a whole canvas, or block by
block over an exact cache), how its published sampler picks tokens (`SelectionRule`), which
defaults a request starts from, and which sampling options it refuses. Everything else in the
engine asks the `Family`, never the config's architecture name.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from celeris.engine.config import ModelConfig
from celeris.engine.errors import FieldViolation
from celeris.engine.params import SamplingParams
from celeris.engine.sampling_batch import SelectionRule

FULL, BLOCK = "full", "block"


@dataclass(frozen=True)
class Family:
    arch: str  # llada, dream, sdar, llada2
    kind: str  # FULL (LLaDA, Dream: a whole canvas, approximate caches) or BLOCK (SDAR, LLaDA2: exact cache)
    rule: SelectionRule
    block_length: int = 0  # the trained block size of a block family

    @property
    def block(self) -> bool:
        return self.kind == BLOCK

    @property
    def default_kv_cache(self) -> str:
        """What a request decodes over when it asks for nothing: block families' exact cache."""
        return "exact" if self.block else "none"

    def base_params(self) -> SamplingParams:
        """Defaults before a checkpoint's own: a block family decodes in its trained block size,
        one token per step (SDAR's and LLaDA2's published step counts equal the block length)."""
        base = SamplingParams()
        return replace(base, block_length=self.block_length, steps=base.gen_length) if self.block else base

    def violations(self, p: SamplingParams) -> list[FieldViolation]:
        """Options this family's decoding does not have, by field."""
        if not self.block:
            return []
        bad = []
        if p.kv_cache not in (None, "none"):
            bad.append(FieldViolation("kv_cache", "block-diffusion models always decode over their exact block "
                                                  "cache; prefix/dual are full-canvas approximations"))
        if p.schedule != "llada":
            bad.append(FieldViolation("schedule", "block-diffusion models use their published per-block schedule"))
        if p.cfg_scale > 0:
            bad.append(FieldViolation("cfg_scale", "classifier-free guidance is not supported for block-diffusion "
                                                   "models"))
        return bad


def family_of(cfg: ModelConfig) -> Family:
    """The family of a loaded model's config."""
    if cfg.family == BLOCK:
        # SDAR's and LLaDA2's samplers: x0 from the softmax, float32 confidences, dynamic threshold.
        rule = SelectionRule(cfg.mask_token_id, torch.float32, x0_from_probs=True, block_threshold=True)
        return Family(cfg.arch, BLOCK, rule, cfg.block_length)
    if cfg.arch == "dream":  # Dream's sampler: softmax argmax, confidences in the logits' dtype
        return Family(cfg.arch, FULL, SelectionRule(cfg.mask_token_id, None, x0_from_probs=True))
    # LLaDA's first published generate() and Fast-dLLM: float64 confidences over the raw logits.
    return Family(cfg.arch, FULL, SelectionRule(cfg.mask_token_id, torch.float64))
