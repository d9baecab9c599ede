"""Runs one batched step of revising-model requests (DiffusionGemma) over `revise_sequence.step_rows`.

Each slot holds one `SlotState`, on the model's device: its exact KV cache (prompt and committed
canvases), its canvas, self-conditioning input and its own random stream, seeded from the
request's seed (on the CPU as `torch.manual_seed(seed)` seeds the global one), so a request decodes
the same text alone or batched, and on the CPU the text transformers' generate() gives that prompt
and seed. A step runs one encoder forward for the context that waits (new prompts, canvases that
stopped last step), then one denoiser forward over every row, whatever canvas and step each is at
(each row's bits those it gets alone: rows.py), then each row's logits and draws, with one
device-to-host transfer for the whole step (slots.py). `StepStats.forwards` counts the step's
denoiser forwards (1 on the CPU; one a row on CUDA unless the shared forward is asked for). A row whose own part of the step
fails (non-finite logits, its structure, its draws or commit) comes back as `RowResult.error` and
ends alone (`step_loop.apply_row`); only the forward fails the batch. The contract is `runner_api.StepRunner`.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence as Seq

import torch

from celeris.engine.config import EngineConfig
from celeris.engine.errors import row_error
from celeris.engine.families.family import Family
from celeris.engine.families.revise.model import DiffusionGemma
from celeris.engine.sampling.params import SamplingParams
from celeris.engine.families.revise.sequence import RevisingSequence
from celeris.engine.families.revise.sampler import ReviseParams
from celeris.engine.families.revise.slots import SlotState, RowStep, Stepped, step_rows
from celeris.engine.sampling.select import token_logprobs
from celeris.engine.families.selection import row_logprobs
from celeris.engine.loop.runner_api import ConfigCosts, RowResult, StepStats

DENOISE = "denoise"


def revise_params(p: SamplingParams) -> ReviseParams:
    """A request's diffusion settings, from its sampling parameters."""
    return ReviseParams.of(p)


class ReviseRunner(ConfigCosts):
    def __init__(self, model: DiffusionGemma, config: EngineConfig, family: Family):
        self.model, self.config, self.family = model, config, family
        if not config.batch_invariant:  # rows share one forward on any device (rows.py)
            model.shared_forward = True
        self.slots = config.max_batch
        self.canvas_length = model.cfg.canvas_length
        self.pad_id = model.cfg.pad_token_id
        self.rows: dict[int, SlotState] = {}  # slot -> the model side of its request

    def row_tokens(self, s: RevisingSequence) -> int:
        """The tokens a row's forward computes: its canvas. Rows share the forward unpadded (each
        attends over its own cache), so rows whose caches differ in length cost no more together
        than apart, and the batcher keeps every running row in one forward."""
        return self.canvas_length

    def _keys(self, s: RevisingSequence) -> int:
        """The keys a row's canvas reads: prompt, committed canvases, the canvas."""
        return self.canvas_length + len(s.prompt) + s.final_length

    @staticmethod
    def forward_kind(s: RevisingSequence) -> str:
        return DENOISE  # every row shares the one denoiser forward

    def load(self, seq: RevisingSequence) -> None:
        """Encode the prompt into a fresh cache and draw the first canvas (the request's first
        random draw)."""
        p = seq.params
        self.rows[seq.slot] = SlotState(self.model, list(seq.prompt), revise_params(p), int(p.seed or 0),
                                             p.gen_length, tuple(sorted(seq.stop_ids)), self.pad_id,
                                             constraint=seq.constraint, min_tokens=p.min_tokens,
                                             keep_raw=p.logprobs is not None, batched_encoding=True)

    def release(self, slot: int) -> None:
        """The slot's request left (finished, a stop string, cancelled): drop its cache now."""
        self.rows.pop(slot, None)

    def step(self, seqs: Seq[RevisingSequence]) -> tuple[list[RowResult], StepStats]:
        t0, forwards = time.perf_counter(), self.model.calls.denoise
        rows = [self.rows[s.slot] for s in seqs]
        settled = [len(r.final) for r in rows]
        steps = step_rows(self.model, rows)
        results = [self._row(s, r, res, before) for s, r, res, before in zip(seqs, rows, steps, settled)]
        keys = max(self._keys(s) for s in seqs)
        committed = sum(len(x.positions) for x in results)
        return results, StepStats(len(seqs), len(seqs), keys, self.canvas_length, committed,
                                  time.perf_counter() - t0, forwards=self.model.calls.denoise - forwards)

    def _row(self, seq: RevisingSequence, row: SlotState, res: RowStep, before: int) -> RowResult:
        """This row's record, or its own error (`step_rows`; or reading its result raised): the step
        loop ends that request alone (`step_loop.apply_row`, which releases its slot and so its
        cache here) and the other rows' records are as without it."""
        if isinstance(res, Exception):
            return RowResult([], [], [], error=res)
        try:
            return self._result(seq, row, res, before)
        except Exception as exc:
            return RowResult([], [], [], error=row_error(exc))

    def _result(self, seq: RevisingSequence, row: SlotState, res: Optional[Stepped],
                before: int) -> RowResult:
        """What this step wrote: every position of the canvas it denoised (from offset `before`) whose
        shown token changed, and, when that canvas stopped, all of it (its positions became final)."""
        view = row.final + row.draft
        end = min(len(view), before + self.canvas_length)
        stopped = len(row.final) > before
        shown = seq.canvas
        positions = [i for i in range(before, end) if stopped or view[i] != shown[i]]
        conf = [] if res is None else res.confidences  # read in the step's one transfer
        tokens = [view[i] for i in positions]
        lps = ()
        if stopped and res is not None and seq.params.logprobs is not None:
            lps = _canvas_logprobs(res.raw, tokens, seq.params.logprobs)
        choices, row.choices = row.choices, ()  # a choice's probabilities, reported once
        return RowResult(positions, tokens, [conf[i - before] if conf else 0.0 for i in positions], lps,
                         final=len(row.final), done=row.finished, choices=choices)


def _canvas_logprobs(raw: torch.Tensor, tokens: list[int], top: int) -> tuple:
    """RowResult.logprobs of a committed canvas: each token's log-probability under the model's own
    logits at the step that committed it (no temperature), with the `top` most likely alternatives."""
    n = len(tokens)
    ids = torch.tensor([tokens], device=raw.device)
    return row_logprobs(token_logprobs(raw[None, :n], ids, top), 0, torch.arange(n, device=raw.device))
