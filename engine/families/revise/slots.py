"""One DiffusionGemma request: canvases written one after another, each refined until its rule stops it.

Per canvas: uniform noise, then up to `max_denoising_steps` denoising steps (engine/families/revise/sampler.py);
the canvas commits the last step's argmax, which the encoder then appends to the request's cache.
Until a canvas commits, every position it shows is provisional; committed canvases are final. The
request ends after the canvas holding an end-of-sequence token (what follows it becomes padding) or
after `ceil(max_new_tokens / canvas_length)` canvases.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from celeris.engine.errors import RowFailed, row_error
from celeris.engine.families.revise.model import DiffusionGemma, KVCache
from celeris.engine.families.revise.sampler import ReviseParams, RowNoise, StepResult, StopRule, denoise_row
from celeris.engine.loop.runner_api import NONFINITE, nonfinite_rows
from celeris.engine.structured.constraint import Constraint, unpack


@dataclass
class SlotState:
    """One slot's DiffusionGemma state in the runner: its model, prompt, cache, canvases and stop rule
    (the request's engine-facing state is `RevisingSequence`, families/revise/sequence.py)."""

    model: DiffusionGemma
    prompt: list[int]
    params: ReviseParams
    seed: int
    max_new_tokens: int
    eos_ids: tuple[int, ...]
    pad_id: int
    final: list[int] = field(default_factory=list)  # committed canvases (after the EOS cut)
    draft: list[int] = field(default_factory=list)  # the current canvas's argmax: provisional
    steps: int = 0  # denoising forwards so far, all canvases
    finished: bool = False
    stop_reason: str = ""  # per canvas: "rule" or "steps"
    constraint: Optional[Constraint] = None  # a structured output (engine/structured)
    min_tokens: int = 0  # no end-of-sequence id drawn or committed before this output position

    def __post_init__(self) -> None:
        cfg = self.model.cfg
        self.noise = RowNoise(self.seed, cfg.vocab_size, cfg.canvas_length)
        self.cache = KVCache(cfg)
        self.canvases_left = math.ceil(self.max_new_tokens / cfg.canvas_length)
        self.model.encode(torch.tensor([self.prompt]), self.cache)
        self._new_canvas()

    def _new_canvas(self) -> None:
        self.fixed = self._fixed_here()
        self.canvas = self._pinned(self.noise.uniform_canvas())
        self.draft = self.canvas.tolist()
        self.sc_logits: Optional[torch.Tensor] = None
        self.stop = StopRule(self.params)
        self.steps_left = self.params.max_denoising_steps

    def denoise_input(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The canvas and self-conditioning logits the next forward needs.  (1, L), (1, L, V) or None"""
        sc = None if self.sc_logits is None else self.sc_logits[None]
        return self.canvas[None], sc

    def advance(self, logits: torch.Tensor) -> StepResult:
        """Apply one forward's logits (L, V): sample, accept, re-noise; commit the canvas when it stops."""
        r = denoise_row(self._banned(logits), self.canvas, self.steps_left, self.params, self.noise)
        r.raw = logits  # log-probabilities are the model's own, whatever min_tokens banned
        self.steps += 1
        self.canvas, self.sc_logits, self.draft = self._pinned(r.canvas), r.logits, self._pinned(r.argmax).tolist()
        stopped = self.stop(r.argmax, r.logits)
        self.steps_left -= 1
        if stopped or self.steps_left == 0:
            self.stop_reason = "rule" if stopped else "steps"
            self._commit(r.argmax if self.constraint is None else self._constrained(r.logits))
        return r

    def _banned(self, logits: torch.Tensor) -> torch.Tensor:
        """min_tokens: the end-of-sequence ids at -inf on this canvas's positions before it (the
        draws, the argmax and the entropies all read it; a request without it is untouched)."""
        early = self.min_tokens - len(self.final)
        if early <= 0 or not self.eos_ids:
            return logits
        out = logits.clone()
        out[:early, list(self.eos_ids)] = float("-inf")
        return out

    # A structured output: the structure's fixed tokens (skeleton, the stop id after it) are pinned
    # on every canvas that holds them, in the input and the shown draft, and a canvas commits left to
    # right, each slot position taking the most likely token its slot's matcher allows there.
    # Unconstrained requests draw and commit exactly as transformers does.

    def _fixed_here(self) -> tuple[list[int], list[int]]:
        """(canvas offsets, tokens) of the structure's fixed tokens on the canvas about to start."""
        if self.constraint is None:
            return [], []
        lo = len(self.final)
        pairs = self.constraint.fixed(lo, lo + self.model.cfg.canvas_length)
        return [p - lo for p, _ in pairs], [t for _, t in pairs]

    def _pinned(self, canvas: torch.Tensor) -> torch.Tensor:
        offsets, tokens = self.fixed
        if offsets:
            canvas = canvas.clone()
            canvas[offsets] = torch.tensor(tokens, dtype=canvas.dtype)
        return canvas

    def _constrained(self, logits: torch.Tensor) -> torch.Tensor:
        """The canvas to commit under the structure.  logits: (L, V) tempered (same argmax as raw)"""
        c, lo = self.constraint, len(self.final)
        fixed = dict(zip(*self.fixed))
        out = []
        for j in range(logits.shape[0]):
            if j in fixed:
                out.append(fixed[j])
                continue
            allowed = self._allowed(lo + j)  # a slot position: its slot's front, slots filling left to right
            tok = int(logits[j].masked_fill(~allowed, float("-inf")).argmax())
            c.commit(lo + j, tok)
            out.append(tok)
        return torch.tensor(out)

    def _allowed(self, pos: int) -> torch.Tensor:
        """(V,) bool: what the slot whose front is `pos` may commit there, through the mask families'
        per-row check (`Constraint.window`): InvalidRequest naming this request's own field if its
        structure raises or allows nothing there."""
        c = self.constraint
        cols, words = c.window([pos])
        if not cols:  # an invariant: a canvas commits its slots left to right, each at its front
            raise c.failure(f"output position {pos} is no slot's front")
        return unpack(words, c.V, torch.device("cpu"))[0]

    def _commit(self, argmax: torch.Tensor) -> None:
        block = argmax.tolist()
        self.canvases_left -= 1
        ends = [i for i, t in enumerate(block) if t in self.eos_ids]
        if ends:
            block = block[: ends[0] + 1] + [self.pad_id] * (len(block) - ends[0] - 1)
        self.final += block
        self.draft = []
        if ends or self.canvases_left == 0:
            self.finished = True
            return
        self.model.encode(argmax[None], self.cache)
        self._new_canvas()


RowStep = Union[StepResult, Exception, None]


def step_rows(model: DiffusionGemma, seqs: list[SlotState]) -> list[RowStep]:
    """One forward for every unfinished request, whatever its canvas and step: each row's step
    result, in order (None for a row that had already finished). Only the forward may fail the
    batch: a row whose own part fails (non-finite logits, its structure's masks or commits, its
    advance) gets its request's error instead (`_advance`), and every other row steps on exactly as
    without it (each row's forward, random stream, cache and constraint are its own)."""
    rows = [s for s in seqs if not s.finished]
    if not rows:
        return [None] * len(seqs)
    canvas = torch.stack([s.canvas for s in rows])
    logits = model.denoise_rows(canvas, [s.cache for s in rows], [s.sc_logits for s in rows])  # (B, L, V)
    bad = nonfinite_rows(logits, torch.ones(logits.shape[:2], dtype=torch.bool)).tolist()  # (B,)
    out = {id(s): _advance(s, lg, nonfinite) for s, lg, nonfinite in zip(rows, logits, bad)}
    return [out.get(id(s)) for s in seqs]


def _advance(seq: SlotState, logits: torch.Tensor, nonfinite: bool) -> Union[StepResult, Exception]:
    """One row's step, or the typed error its request alone ends with (errors.row_error: an
    InvalidRequest naming its structured-output field as it is, else RowFailed naming only the
    exception's type). A row with non-finite logits draws nothing (NaN would make its draw raise,
    or write garbage); a failed row is finished here, its state dropped when its slot is released."""
    try:
        if nonfinite:
            raise RowFailed(NONFINITE)
        return seq.advance(logits)
    except Exception as exc:
        seq.finished = True
        return row_error(exc)


def generate(model: DiffusionGemma, prompt: list[int], params: ReviseParams, seed: int, max_new_tokens: int,
             eos_ids: tuple[int, ...] = (), pad_id: int = 0) -> list[int]:
    """The reference loop for one request: what the runner must reproduce step for step."""
    seq = SlotState(model, prompt, params, seed, max_new_tokens, eos_ids, pad_id)
    while not seq.finished:
        canvas, sc = seq.denoise_input()
        seq.advance(model.denoise(canvas, seq.cache, sc)[0])
    return seq.final
