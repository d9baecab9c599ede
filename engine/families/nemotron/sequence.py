"""Per-request state of a Nemotron-Labs-Diffusion request, in one of its three modes (plain Python).

Output position i is absolute position P + i (P prompt tokens): every mode writes right after the
prompt, and the KV cache always holds causal keys/values of committed tokens. Every request starts
with a causal prefill of its prompt (in chunks); its last logit gives the first token. Then, one
forward a step (what the runner computes is `window`, `causal`, `lora`):

- `ar` (the published `ar_generate`): a causal forward of the last token gives the next.
- `diffusion` (`generate`): blocks of b output positions, the first holding the seed (the token the
  causal forward before it predicted), the rest masks. DENOISE steps run the block bidirectionally
  over the cache and commit by confidence: one mask a step (the published schedule spreads the
  block's b - 1 masks over b steps), or with a threshold the best mask and every other at least
  that confident. A block ends once no mask is left, or a stop token has no mask before it (the
  request ends there). A STORE step then runs the block causally: its keys/values are the cache's,
  its last logit the next block's seed.
- `linear_spec` (`linear_spec_generate`): DRAFT the block [last token, b - 1 masks] bidirectionally
  with the LoRA adapter on (one pass fills every mask; with a threshold, passes commit the masks at
  least that confident, at least the best one, until none is left), then VERIFY it causally without
  the adapter: its picks are the autoregressive ones; the draft's longest prefix they agree with,
  plus the pick after it, is accepted (at least one token a pass, so output equals `ar` at
  temperature 0). The cache keeps the accepted prefix: the next block starts after it and
  overwrites the rest.

The runner returns, per step, its pick and confidence at the positions the phase reads (all of
the window for DENOISE, DRAFT and VERIFY, the last for the rest); everything else is decided here.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable

from celeris.engine.families.sequence import DecodeSequence
from celeris.engine.events import FinishReason, StepEvent

AR, DIFFUSION, LINEAR_SPEC = "ar", "diffusion", "linear_spec"
MODES = (AR, DIFFUSION, LINEAR_SPEC)
PREFILL, DECODE, DENOISE, STORE, DRAFT, VERIFY = "prefill", "decode", "denoise", "store", "draft", "verify"
NEXT = {AR: DECODE, DIFFUSION: DENOISE, LINEAR_SPEC: DRAFT}  # the phase after a prefill


@dataclass
class NemotronSequence(DecodeSequence):
    mode: str = DIFFUSION
    prefill_chunk: int = 256  # most prompt tokens one prefill step takes

    def __post_init__(self) -> None:
        b, G = self.params.block_length, self.params.gen_length
        self.length_out = -(-G // b) * b if self.mode == DIFFUSION else G  # diffusion: whole blocks
        self.canvas = [self.mask_id] * self.length_out
        self.n = 0  # output positions committed, left to right (ar, linear_spec) or by block start
        self.phase = PREFILL
        self.prefilled = 0
        self.draft: list[int] = []  # linear_spec: the block being drafted, then verified
        self.verify_passes = 0
        self.accepted_tokens = 0
        self._conf: dict[int, float] = {}  # ar, linear_spec: confidence of each committed position

    # ------------------------------------------------------------------ what the runner reads

    @property
    def window(self) -> tuple[int, int]:
        """Absolute [start, end) of this step's fresh positions."""
        P, b = len(self.prompt), self.params.block_length
        if self.phase == PREFILL:
            return self.prefilled, min(P, self.prefilled + max(1, self.prefill_chunk))
        if self.phase == DECODE:
            return P + self.n - 1, P + self.n
        if self.phase in (DENOISE, STORE):
            return P + self.block * b, P + (self.block + 1) * b
        return P + self.n - 1, P + self.n - 1 + b  # DRAFT, VERIFY: from the last committed token

    @property
    def ids(self) -> list[int]:
        """Token ids of the window."""
        start, end = self.window
        P = len(self.prompt)
        if self.phase == PREFILL:
            return self.prompt[start:end]
        if self.phase in (DRAFT, VERIFY):
            return self.draft
        return self.canvas[start - P:end - P]

    @property
    def causal(self) -> bool:
        return self.phase in (PREFILL, DECODE, STORE, VERIFY)

    @property
    def lora(self) -> bool:
        return self.phase == DRAFT

    @property
    def reads_all(self) -> bool:
        """Whether the runner picks at every window position (else at the last only, or none)."""
        return self.phase in (DENOISE, DRAFT, VERIFY)

    @property
    def reads_last(self) -> bool:
        return self.phase in (DECODE, STORE) or (self.phase == PREFILL and self.window[1] == len(self.prompt))

    @property
    def total_steps(self) -> int:
        """The worst case: prefill chunks, then one step a token (ar), b + 1 a block (diffusion),
        two a token (linear_spec: a draft and a verify accepting one)."""
        b, G = self.params.block_length, self.params.gen_length
        prefill = -(-len(self.prompt) // max(1, self.prefill_chunk))
        per_mode = {AR: G - 1, DIFFUSION: self.length_out // b * (b + 1) - 1, LINEAR_SPEC: 2 * (G - 1)}
        return prefill + per_mode[self.mode]

    @property
    def kv_cache(self) -> str:
        return "exact"

    @property
    def output(self) -> list[int]:
        return self.canvas[:self.params.gen_length]

    # ------------------------------------------------------------------ progress

    def apply_row_later(self, r: Any) -> Callable[[], StepEvent]:
        """Commit one step's picks (`RowResult.tokens` / `confidences` at the positions the phase
        reads) and advance; the call that builds the step's event."""
        self.nfe += 1
        before = self.n
        committed, confs, provisional, complete = (), (), (), False
        picks, conf = list(r.tokens), list(r.confidences)
        phase, seeded = self.phase, None
        if phase == PREFILL:
            self.prefilled = self.window[1]
            if self.prefilled >= len(self.prompt):
                self._first(picks[-1], conf[-1])
                seeded = conf[-1]
        elif phase == DECODE:
            self._commit_next([picks[-1]], conf[-1:])
        elif phase == DENOISE:
            committed, confs, complete = self._denoise(picks, conf)
        elif phase == STORE:
            self._seed(picks[-1], conf[-1])
            seeded = conf[-1]
        elif phase == DRAFT:
            self._draft(picks, conf)
            # the draft as guesses at output positions n.. (a rejected draft is a revision of them)
            guess = [picks[j] if t == self.mask_id else t for j, t in enumerate(self.draft)]
            provisional = tuple((self.n + j - 1, guess[j], conf[j]) for j in range(1, len(guess))
                                if self.n + j - 1 < len(self.canvas))
        else:
            complete = self._verify(picks, conf)
        if self.mode == DIFFUSION and seeded is not None:  # the seed of the block
            start = self.block * self.params.block_length
            committed, confs = ((start,), (seeded,)) if start < self.params.gen_length else ((), ())
        elif phase != DENOISE:
            committed = tuple(range(before, min(self.n, self.params.gen_length)))
            confs = tuple(self._conf.get(i, 1.0) for i in committed)
        block = self.block if self.mode == DIFFUSION else self.verify_passes
        return functools.partial(self.event, committed, confs, block, complete or phase == DECODE,
                                 provisional if self.params.provisional else ())

    def _first(self, token: int, confidence: float) -> None:
        """The prompt's last logit: the first output token (and, diffusion, block 0's seed)."""
        if self.mode == DIFFUSION:
            self._seed(token, confidence)
            return
        self._commit_next([token], [confidence])
        self.phase = NEXT[self.mode]
        if self.mode == LINEAR_SPEC and not self.finished:
            self.new_draft()

    def _commit_next(self, tokens: list[int], confidences: list[float]) -> None:
        """Append tokens to the output (ar, linear_spec); finish at a stop token or the length."""
        G = self.params.gen_length
        for t, c in zip(tokens, confidences):
            if self.n >= G:
                break
            self.canvas[self.n] = t
            self._conf[self.n] = c
            self.n += 1
            if t in self.stop_ids and self.params.stop_at_eos:
                self.finish_reason = FinishReason.STOP
                return
        if self.n >= G:
            self.finish_reason = FinishReason.LENGTH

    # ------------------------------------------------------------------ diffusion

    def _seed(self, token: int, confidence: float) -> None:
        """A causal forward's last pick seeds the next block (`block` was just stored)."""
        b = self.params.block_length
        if self.phase == STORE:
            self.block += 1
        start = self.block * b
        self.canvas[start] = token
        self.n, self.phase, self.step_in_block = start, DENOISE, 0
        if b == 1 or self.mask_id not in self.canvas[start:start + b]:
            self._block_done()  # nothing to denoise (a one-token block)

    def _denoise(self, picks: list[int], conf: list[float]) -> tuple[tuple, tuple, bool]:
        """Commit masks of the block: the most confident one, and with a threshold every other
        mask at least that confident (ties: the earlier position)."""
        b, start = self.params.block_length, self.block * self.params.block_length
        masked = [j for j in range(b) if self.canvas[start + j] == self.mask_id]
        order = sorted(masked, key=lambda j: (-conf[j], j))
        th = self.params.threshold
        chosen = order[:1] + ([j for j in order[1:] if conf[j] >= th] if th is not None else [])
        for j in chosen:
            self.canvas[start + j] = picks[j]
        self.step_in_block += 1
        done = self._block_done()
        keep = sorted(j for j in chosen if start + j < self.params.gen_length)
        return tuple(start + j for j in keep), tuple(conf[j] for j in keep), done

    def _block_done(self) -> bool:
        """After a denoise step: finish on a stop token with no mask before it, end the block once
        no mask is left (store it, or end at the last block)."""
        b, G = self.params.block_length, self.params.gen_length
        end = (self.block + 1) * b
        if self.stops_within(min(end, G)):
            return True
        if self.mask_id in self.canvas[self.block * b:end]:
            return False
        self.phase = STORE
        if end >= G:
            self.finish_reason = FinishReason.LENGTH
        return True

    # ------------------------------------------------------------------ linear self-speculation

    def _draft(self, picks: list[int], conf: list[float]) -> None:
        """Fill the draft's masks. Its first token is the last committed one, kept even when it is
        the mask id (an untrained model may write it; the published loop would re-draft it, and its
        verify pass would then run on a token the output does not hold)."""
        masked = [j for j in range(1, len(self.draft)) if self.draft[j] == self.mask_id]
        th = self.params.threshold
        if not masked or th is None:
            chosen = masked
        else:
            chosen = [j for j in masked if conf[j] >= th] or [max(masked, key=lambda j: (conf[j], -j))]
        for j in chosen:
            self.draft[j] = picks[j]
        if self.mask_id not in self.draft[1:]:
            self.phase = VERIFY

    def _verify(self, picks: list[int], conf: list[float]) -> bool:
        """Accept the verify picks while the draft agrees with them, then the one after."""
        accepted = 1
        while accepted < len(self.draft) and picks[accepted - 1] == self.draft[accepted]:
            accepted += 1
        before = self.n
        self._commit_next(picks[:accepted], conf[:accepted])
        self.verify_passes += 1
        self.accepted_tokens += self.n - before
        if not self.finished:
            self.new_draft()
        return True

    def new_draft(self) -> None:
        """The next block to draft: the last committed token, then masks."""
        self.draft = [self.canvas[self.n - 1]] + [self.mask_id] * (self.params.block_length - 1)
        self.phase = DRAFT if len(self.draft) > 1 else VERIFY  # a one-token block has nothing to draft

    # ------------------------------------------------------------------ events

    def _view(self, block: int, block_complete: bool) -> tuple[tuple[int, ...], int, int]:
        G, b = self.params.gen_length, self.params.block_length
        if self.finished:
            settled = G
        elif self.mode == DIFFUSION:
            settled = min(G, self.block * b)
        else:
            settled = min(G, self.n)
        blocks = self.length_out // b if self.mode == DIFFUSION else G
        return tuple(self.output), blocks, settled

    def event(self, *args: Any, **kw: Any) -> StepEvent:
        """The shared event, with self-speculation's counts."""
        ev = super().event(*args, **kw)
        if not self.verify_passes:
            return ev
        return dataclasses.replace(ev, verify_passes=self.verify_passes, accepted_tokens=self.accepted_tokens)

    def cancel(self) -> StepEvent:
        self.finish_reason = FinishReason.CANCELLED
        return self.event()


__all__ = ["AR", "DIFFUSION", "LINEAR_SPEC", "MODES", "NemotronSequence"]
