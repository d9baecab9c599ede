"""Chunked prefill for the block families: a long prompt never stalls the running streams.

A block model's step computes its prefill rows (the next chunk of their prompts' whole blocks)
and its block rows (denoise and store). On the per-row path (the CPU) they share one forward
where their blocks are as wide (`BlockRunner._groups`): a prefill chunk runs as one part per
prompt block beside the block rows, each part attending over its slot's keys up to its own end,
which is block-causal prefill made of the very call a block row makes (`BlockRunner._parts`). And
the step that prefills a prompt's last chunk runs the first block's first denoise step in the same
forward (`BlockSequence.joins_decode`), so a request whose prompt is mostly in the prefix cache
commits its first tokens in its first step, one forward. The static path (CUDA graphs) keeps the
two apart: the prefill rows' forward eager, then the block rows' at static shapes.

A prefill chunk of `EngineConfig.prefill_chunk` tokens (256) next to eight denoising rows of a
4-token block would make that step many times as long as the others, for every running stream.
So while any row denoises, each prefill row's chunk this step is capped to its share of the
tokens the block rows compute (at least one block): the step computes at most about twice a
decode step's tokens, in one forward, and the prompt goes on over the next steps, interleaved
with theirs. Alone (nothing denoising) a prompt prefills in full `prefill_chunk` chunks. Exact
either way: a prompt block's keys/values and a block's logits do not depend on the chunk or the
rows beside them (engine/models/prefix_cache.py), so chunking and fusing never change a token.
"""

from __future__ import annotations

from typing import Sequence as Seq

from celeris.engine.families.block.sequence import PREFILL, BlockSequence


def cap_prefill_chunks(seqs: Seq[BlockSequence], enabled: bool = True) -> None:
    """Set each prefill row's `step_chunk` for this step (0: uncapped), before its forward; the
    row's window (and so what `apply` commits) reads it."""
    prefill = [s for s in seqs if s.phase == PREFILL]
    if not prefill:
        return
    decode = sum(s.window[1] - s.window[0] for s in seqs if s.phase != PREFILL) if enabled else 0
    share = decode // len(prefill)
    for s in prefill:  # BlockSequence rounds the cap down to whole blocks, at least one
        s.step_chunk = share if decode else 0
