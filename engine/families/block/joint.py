"""LLaDA2.2's joint decode in the block runner: which rows run it, and one step of theirs.

A row runs it when its checkpoint names edit tokens (ModelConfig.delete_token_id, split_token_id)
and it edits (an editing threshold, no structured output: a skeleton's tokens are never moved).
Each row's step is the sequential rule of block/levenshtein.py over its own block's logits, on
the host, as the reference runs it: a row's tokens depend on its own logits and its own seed only,
so they are the same alone and in any batch. The new block is written into the runner's token row
(the next forward reads it) and reported as the positions it changed.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch

from celeris.engine.families.block.levenshtein import EditIds, JointBlock, JointKnobs, joint_step
from celeris.engine.loop.runner_api import RowResult


def edit_ids(cfg: Any, seq: Any) -> Optional[EditIds]:
    """The edit ids a request decodes with, or None (its family's plain rule)."""
    if getattr(cfg, "delete_token_id", -1) < 0 or not seq.editing:
        return None
    return EditIds(cfg.mask_token_id, cfg.delete_token_id, cfg.split_token_id)


def knobs(p: Any) -> JointKnobs:
    """A request's SamplingParams as the joint decode reads them (no threshold: never)."""
    return JointKnobs(threshold=math.inf if p.threshold is None else p.threshold,
                      editing_threshold=p.editing_threshold, steps=p.steps_per_block,
                      max_post_steps=p.max_post_steps, temperature=p.temperature, top_k=p.top_k or None,
                      top_p=p.top_p, seed=p.seed or 0)


def joint_results(rows: Sequence[Any], logits: torch.Tensor, ids: torch.Tensor,
                  tokens: torch.Tensor) -> list[RowResult]:
    """One joint step per row: logits (R, W, V) and ids (R, W) of the rows' blocks (columns from
    the block's first); each row's new block is written into `tokens` (slots, max_len)."""
    out = []
    for r, s in enumerate(rows):
        a, e = s.block_window
        before = ids[r, :e - a].tolist()
        if s.joint is None or s.joint.index != s.block:
            s.joint = JointBlock.enter(s.block, before, s.joint_ids.mask, s.params.steps_per_block)
        step = joint_step(logits[r, :e - a], before, s.joint, knobs(s.params), s.joint_ids,
                          protected=max(0, len(s.prompt) - a))
        tokens[s.slot, a:e] = torch.tensor(step.tokens, dtype=tokens.dtype, device=tokens.device)
        changed = [i for i, (t, u) in enumerate(zip(before, step.tokens)) if t != u]
        out.append(RowResult(changed, [step.tokens[i] for i in changed], [step.confidence[i] for i in changed]))
    return out
