"""One DiffusionGemma request: canvases written one after another, each refined until its rule stops it.

Per canvas: uniform noise, then up to `max_denoising_steps` denoising steps (engine/families/revise/sampler.py);
the canvas commits the last step's argmax, which the encoder then appends to the request's cache.
Until a canvas commits, every position it shows is provisional; committed canvases are final. The
request ends after the canvas holding an end-of-sequence token (what follows it becomes padding) or
after `ceil(max_new_tokens / canvas_length)` canvases.

Devices: every tensor of a row (ids, cache, canvas, self-conditioning input, random stream) lives on
the model's device. A step runs in two phases: on the device, each row's forward and then its draws
in that forward's own buffer (`SlotState.draw`: one (L, V) float32 buffer live per row, which stays as
its self-conditioning input); then one transfer for the whole step (`_host_values`: each row's argmax,
confidences, mean entropy, stop test and finiteness) and, on the host, the stop rules and commits
(`SlotState.settle`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, Optional, Union

import torch

from celeris.engine.errors import RowFailed, row_error
from celeris.engine.families.revise.model import DiffusionGemma, KVCache
from celeris.engine.families.revise.sampler import (ReviseParams, RowDraw, RowNoise, StopRule, conditioning_input,
                                                    denoise_row_)
from celeris.engine.families.selection import NONFINITE, nonfinite_rows
from celeris.engine.sampling.choice import decide, option_probabilities
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
    keep_raw: bool = False  # logprobs asked: each step keeps its raw logits (L, V) for its result
    choices: tuple = ()  # a choice's option probabilities, once scored, until the runner reports them
    # Context (the prompt, a committed canvas) waits for `step_rows` to encode every row's in one
    # forward; False: encoded at once, alone (the reference loop, `generate`).
    batched_encoding: bool = False

    def __post_init__(self) -> None:
        cfg = self.model.cfg
        self.device = self.model.device
        self.noise = RowNoise(self.seed, cfg.vocab_size, cfg.canvas_length, self.device)
        self.cache = KVCache(cfg)
        self.canvases_left = math.ceil(self.max_new_tokens / cfg.canvas_length)
        self._context(torch.tensor(self.prompt, device=self.device))
        self._new_canvas()

    def _context(self, ids: torch.Tensor) -> None:
        """New context for the cache.  (T,)"""
        self.unencoded: Optional[torch.Tensor] = ids
        if not self.batched_encoding:
            encode_pending(self.model, [self])

    def _new_canvas(self) -> None:
        self.fixed = self._fixed_here()
        offsets, tokens = self.fixed
        self._fixed_t = (torch.tensor(offsets, device=self.device), torch.tensor(tokens, device=self.device))
        self.canvas = self._pinned(self.noise.uniform_canvas())
        self.draft: list[int] = []  # no argmax yet: its first step writes it (nothing reads the noise)
        self.sc_probs: Optional[torch.Tensor] = None  # (L, V) the last step's probabilities, weights' dtype
        self.stop = StopRule(self.params)
        self.steps_left = self.params.max_denoising_steps

    def denoise_input(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The canvas and self-conditioning input the next forward needs.  (1, L), (1, L, V) or None"""
        sc = None if self.sc_probs is None else self.sc_probs[None]
        return self.canvas[None], sc

    def advance(self, logits: torch.Tensor) -> Stepped:
        """Apply one forward's logits (L, V), left unchanged: sample, accept, re-noise; commit the
        canvas when it stops (`step_rows` does the same for a batch, without the copy)."""
        pending = self.draw(logits.clone())
        return self.settle(pending, next(_host_values([pending])))

    def draw(self, logits: torch.Tensor) -> Pending:
        """The step's device part, in the forward's buffer `logits` (L, V), which it consumes: the
        draws, the next canvas, and the self-conditioning input the buffer becomes. On the CPU a row
        with non-finite logits fails here (its draw would raise); on a device the test rides in the
        step's one transfer and `settle` fails it."""
        bad = nonfinite_rows(logits[None], torch.ones(1, logits.shape[0], dtype=torch.bool, device=logits.device))
        if logits.device.type == "cpu" and bool(bad):
            raise RowFailed(NONFINITE)
        raw = logits.clone() if self.keep_raw else None  # log-probabilities are the model's own
        d = denoise_row_(self._banned(logits), self.steps_left, self.params, self.noise,
                         keep_tempered=self.constraint is not None)
        self.canvas = self._pinned(d.canvas)
        self.sc_probs = conditioning_input(d.probs, self.model.embed.weight.dtype)
        d.probs = None  # in bf16 the float32 buffer is freed now, not after every row has stepped
        return Pending(d, raw, bad[0])

    def settle(self, pending: Pending, values: list[float]) -> Stepped:
        """The step's host part, from this row's values of the step's one transfer: the stop rule,
        and the commit when the canvas stops."""
        L = pending.draw.argmax.shape[0]
        argmax, conf = [int(v) for v in values[:L]], values[L:2 * L]
        mean_entropy, confident, nonfinite = values[2 * L:]
        if nonfinite:
            raise RowFailed(NONFINITE)
        self.steps += 1
        self.draft = self._pinned_list(argmax)
        stopped = self.stop.decide(argmax, bool(confident))
        self.steps_left -= 1
        if stopped or self.steps_left == 0:
            self.stop_reason = "rule" if stopped else "steps"
            if self.constraint is None:
                self._commit(argmax, pending.draw.argmax)
            else:
                if self.constraint.score_choices and pending.raw is not None:
                    self._score_choices(pending.raw)  # before the commit moves the slot's front
                block = self._constrained(pending.draw.tempered)
                self._commit(block, torch.tensor(block, device=self.device))
        return Stepped(conf, mean_entropy, pending.raw)

    def _banned(self, logits: torch.Tensor) -> torch.Tensor:
        """min_tokens: the end-of-sequence ids at -inf on this canvas's positions before it, in place
        (the draws, the argmax and the entropies all read it; a request without it is untouched)."""
        early = self.min_tokens - len(self.final)
        if early > 0 and self.eos_ids:
            logits[:early, list(self.eos_ids)] = float("-inf")
        return logits

    # A structured output: the structure's fixed tokens (skeleton, the stop id after it) are pinned
    # on every canvas that holds them, in the input and the shown draft, and a canvas commits left to
    # right, each slot position taking the most likely token its slot's matcher allows there (a whole
    # document's forced tokens and closing come from the same `Constraint.window`). The grammar acts
    # only there: guiding every step cost 6x its time and bought nothing measurable
    # (scripts/bench_gemma_documents.py, docs/structured-outputs.md).
    # Unconstrained requests draw and commit exactly as transformers does.

    def _fixed_here(self) -> tuple[list[int], list[int]]:
        """(canvas offsets, tokens) of the structure's fixed tokens on the canvas about to start."""
        if self.constraint is None:
            return [], []
        lo = len(self.final)
        pairs = self.constraint.fixed(lo, lo + self.model.cfg.canvas_length)
        return [p - lo for p, _ in pairs], [t for _, t in pairs]

    def _pinned(self, canvas: torch.Tensor) -> torch.Tensor:
        offsets, tokens = self._fixed_t
        if len(offsets):
            canvas = canvas.clone()
            canvas[offsets] = tokens.to(canvas.dtype)
        return canvas

    def _pinned_list(self, tokens: list[int]) -> list[int]:
        for j, t in zip(*self.fixed):
            tokens[j] = t
        return tokens

    def _constrained(self, logits: torch.Tensor) -> list[int]:
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
        return out

    def _score_choices(self, raw: torch.Tensor) -> None:
        """A choice asked with logprobs: its options' probabilities (engine/sampling/choice.py) over
        the model's own logits (L, V) of the forward that commits the slot's first token, as the
        mask families score theirs: here the last step of the first canvas, whose logits the commit
        reads. `Constraint.choice_columns` says where (once, at the slot's first position). The
        option written is the one these numbers decide (`choice.decide`: the most probable at t_min
        0, else a draw seeded by the request's seed), so text and probabilities never disagree."""
        c, lo = self.constraint, len(self.final)
        cols = c.choice_columns([lo + j for j in range(raw.shape[0])])
        if cols is not None:
            probs = option_probabilities(raw[cols], c.choice_ids())
            self.choices = tuple(probs.tolist())
            c.decide(decide(probs, self.params.t_min, self.seed))

    def _allowed(self, pos: int) -> torch.Tensor:
        """(V,) bool: what the slot whose front is `pos` may commit there, through the mask families'
        per-row check (`Constraint.window`): InvalidRequest naming this request's own field if its
        structure raises or allows nothing there."""
        c = self.constraint
        cols, words = c.window([pos])
        if not cols:  # an invariant: a canvas commits its slots left to right, each at its front
            raise c.failure(f"output position {pos} is no slot's front")
        return unpack(words, c.V, self.device)[0]

    def _commit(self, block: list[int], ids: torch.Tensor) -> None:
        """Commit the canvas `block` (host ids; `ids` the same on the device, (L,), for the encoder)."""
        self.canvases_left -= 1
        ends = [i for i, t in enumerate(block) if t in self.eos_ids]
        if ends:
            block = block[: ends[0] + 1] + [self.pad_id] * (len(block) - ends[0] - 1)
        self.final += block
        self.draft = []
        if ends or self.canvases_left == 0:
            self.finished, self.sc_probs = True, None  # its buffer freed now, not at release
            return
        self._context(ids)
        self._new_canvas()


@dataclass
class Pending:
    """A row's step between its device part and its host part."""

    draw: RowDraw
    raw: Optional[torch.Tensor]  # (L, V) the model's own logits, kept only for logprobs
    nonfinite: torch.Tensor  # () bool


@dataclass
class Stepped:
    """A row's step as the runner reads it: host values from the step's one transfer."""

    confidences: list[float]  # (L,) the max probability (tempered) at each position of the canvas it denoised
    mean_entropy: float
    raw: Optional[torch.Tensor]  # (L, V) the model's own logits this step, when logprobs were asked


def _host_values(rows: list[Pending]) -> Iterator[list[float]]:
    """Every row's argmax, confidences, mean entropy, stop test and finiteness in one transfer (float64
    holds the ids and the float32 values exactly): one device sync a step, not one per row per tensor."""
    if not rows:
        return iter(())
    packed = torch.stack([torch.cat([p.draw.argmax.double(), p.draw.confidence.double(),
                                     torch.stack([p.draw.mean_entropy.double(), p.draw.confident.double(),
                                                  p.nonfinite.double()])]) for p in rows])  # (B, 2L + 3)
    return iter(packed.tolist())


RowStep = Union[Stepped, Exception, None]


def encode_pending(model: DiffusionGemma, rows: list[SlotState]) -> None:
    """Encode every row's waiting context into its cache, in one encoder forward (model.encode_rows)."""
    todo = [s for s in rows if s.unencoded is not None]
    if todo:
        model.encode_rows([s.unencoded for s in todo], [s.cache for s in todo])
    for s in todo:
        s.unencoded = None


def step_rows(model: DiffusionGemma, seqs: list[SlotState]) -> list[RowStep]:
    """One denoiser forward for every unfinished request, whatever its canvas and step (after one
    encoder forward for the context waiting since the last step): each row's step result, in order
    (None for a row that had already finished). Only the forwards may fail the batch: a row whose own
    part fails (non-finite logits, its structure's masks or commits, its advance) gets its request's
    error instead (`_guarded`), and every other row steps on exactly as without it (each row's bits in
    the forward, random stream, cache and constraint are its own: model.py, rows.py)."""
    rows = [s for s in seqs if not s.finished]
    if not rows:
        return [None] * len(seqs)
    encode_pending(model, rows)
    hidden = model.denoise_hidden(torch.stack([s.canvas for s in rows]), [s.cache for s in rows],
                                  [s.sc_probs for s in rows])  # (B, L, D)
    drawn: list[Union[Pending, Exception]] = []
    for r, s in enumerate(rows):  # its logits, then its draws in their buffer: one fresh (L, V) at a time
        drawn.append(_guarded(s, s.draw, model.head(hidden[r:r + 1])[0]))  # logits (L, V)
    values = _host_values([d for d in drawn if isinstance(d, Pending)])  # the step's one transfer
    out = {id(s): d if isinstance(d, Exception) else _guarded(s, s.settle, d, next(values))
           for s, d in zip(rows, drawn)}
    return [out.get(id(s)) for s in seqs]


def _guarded(seq: SlotState, part, *args):
    """One row's part of the step, or the typed error its request alone ends with (errors.row_error:
    an InvalidRequest naming its structured-output field as it is, else RowFailed naming only the
    exception's type). A failed row is finished here, its state dropped when its slot is released."""
    try:
        return part(*args)
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
