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
So while any row denoises, the prefill rows' chunks this step are sized from measured time
(`PrefillPacer`): what the step may add to a decode-only step is (TARGET - 1) x that step's time,
and a prompt token costs the time the pacer has seen prefill tokens cost; the chunk is what fits,
shared among the prefill rows (whole blocks, at least one a row). A fixed cap did not hold: a
chunk of as many tokens as the block rows' was 1.6-2.1x a decode step at the median but 3-6x at
worst over a 4,000-token prompt (issue 60 item 6), because a prompt token's attention reads every
key before it, so late chunks cost more a token than early ones, and the cost of a token in a
forward is not that of a block row's. The pacer follows that growth step by step. Until it has
measured both (the first steps beside a prefill), the chunk is the block rows' tokens, as before.
Alone (nothing denoising) a prompt prefills in full `prefill_chunk` chunks. Exact either way: a
prompt block's keys/values and a block's logits do not depend on the chunk or the rows beside them
(engine/models/prefix_cache.py), so chunking and fusing never change a token.
"""

from __future__ import annotations

from typing import Optional, Sequence as Seq

from celeris.engine.families.block.sequence import PREFILL, BlockSequence

TARGET = 1.5  # a step with a prefill chunk aims at this many decode-only steps' time (the bar is 2)
SMOOTHING = 0.3  # weight of the newest observation in the pacer's moving averages
# A chunk is at most GROWTH times the last one: a token's cost grows with the keys before it, so
# an estimate from a small chunk near the prompt's start is low for a large one further on.
GROWTH = 2
# The pacer's chunk is at least the block rows' tokens over FLOOR: a prompt always progresses,
# even where noise (a loaded machine) makes a few tokens look as costly as a step.
FLOOR = 8


class PrefillPacer:
    """Moving averages of a decode-only step's seconds and of a prefill token's seconds beside
    decoding, from the steps the block runner reports (`observe`); `chunk` is the prefill tokens
    the next step may take."""

    def __init__(self, target: float = TARGET, smoothing: float = SMOOTHING):
        self.target, self.smoothing = target, smoothing
        self.decode_s: Optional[float] = None  # a step of block rows alone
        # A prefill token's seconds as a ratio of averages (the extra seconds prefill steps took,
        # over their prompt tokens): a small chunk's noise weighs as little as its tokens do.
        self._extra: Optional[float] = None
        self._tokens: Optional[float] = None
        self._last = 0  # the last prefill step's tokens: a chunk grows at most GROWTH-fold a step
        self._latest = 0.0  # the last prefill step's seconds a token

    def _mix(self, old: Optional[float], new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    @property
    def token_s(self) -> Optional[float]:
        """One prefill token's share of a step beside block rows (None until seen): the average's
        or the last step's, the larger (a token costs more the further into its prompt it is)."""
        return None if self._tokens is None else max(self._extra / self._tokens, self._latest)

    def observe(self, seconds: float, prefill_tokens: int, decoding: bool) -> None:
        """A step took `seconds`, `prefill_tokens` of it prompt tokens, beside block rows or not.
        A prefill token's cost is what the step took beyond a decode-only step, a token (the whole
        step's with no block rows beside it: an upper bound, so chunks err small)."""
        if seconds <= 0:
            return
        if not prefill_tokens:
            if decoding:
                self.decode_s = self._mix(self.decode_s, seconds)
            return
        if decoding and self.decode_s is None:
            return  # nothing to subtract yet
        self._last = prefill_tokens
        extra = seconds - self.decode_s if decoding else seconds
        extra = max(extra, 0.05 * seconds)
        self._latest = extra / prefill_tokens
        self._extra = self._mix(self._extra, extra)
        self._tokens = self._mix(self._tokens, prefill_tokens)

    def chunk(self) -> Optional[int]:
        """Prefill tokens the next step beside block rows may take, or None until both averages
        are known."""
        if self.decode_s is None or self._tokens is None:
            return None
        return min(int((self.target - 1) * self.decode_s / self.token_s), GROWTH * self._last)


def prefill_tokens(seqs: Seq[BlockSequence]) -> int:
    """The prompt tokens this step's prefill rows compute (their chunks' whole blocks)."""
    return sum(hi - lo for lo, hi in (s.prefill_window for s in seqs if s.phase == PREFILL))


def cap_prefill_chunks(seqs: Seq[BlockSequence], enabled: bool = True, paced: Optional[int] = None) -> None:
    """Set each prefill row's `step_chunk` for this step (0: uncapped), before its forward; the
    row's window (and so what `apply` commits) reads it. Beside denoising rows the prefill rows
    share `paced` tokens (the pacer's chunk, at least the block rows' tokens over FLOOR) or, before
    the pacer knows, the block rows' tokens."""
    prefill = [s for s in seqs if s.phase == PREFILL]
    if not prefill:
        return
    decode = sum(s.window[1] - s.window[0] for s in seqs if s.phase != PREFILL) if enabled else 0
    budget = decode if paced is None else max(paced, decode // FLOOR)
    for s in prefill:  # BlockSequence rounds the cap down to whole blocks, at least one
        s.step_chunk = max(1, budget // len(prefill)) if decode else 0
