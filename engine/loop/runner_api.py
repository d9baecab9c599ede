"""The contract between the step loop and a runner, and the records that cross it.

A runner owns the device state of every slot (canvases, caches) and runs one batched step:
`StepLoop` hands it the rows that step and gets one `RowResult` per row back, plus the step's
`StepStats`. Each family folder's runner implements it (families/canvas, block, revise);
`sim_runner.SimRunner` fakes one for benchmarks. The two mask runners end a step with the same
selection (`select_step`), and `row_results` is the one place a step's device results become
host records.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Protocol, Sequence as Seq

import torch

from celeris.engine.errors import RowFailed
from celeris.engine.sampling.select import published_order, select_tokens, token_logprobs, with_edits
from celeris.engine.sampling.batch import SamplingBatch, Selection, SelectionRule, Window
from celeris.engine.sampling.params import SamplingParams
from celeris.engine.sampling.choice import option_probabilities
from celeris.engine.loop.sequence import Sequence
from celeris.engine.structured.masks import window_masks


@dataclass(frozen=True)
class RowResult:
    """What one request got from one step: block-relative positions, tokens, confidences, and
    (when asked) each token's log-probability with its top alternatives ((id, logprob), ...)."""

    positions: list[int]
    tokens: list[int]
    confidences: list[float]
    logprobs: tuple = ()  # per position: (logprob, ((id, logprob), ...))
    # With params.provisional: (position, token, confidence) of every candidate left masked.
    provisional: tuple = ()
    # Revising families (revise_runner.py): `positions` are output offsets written this step,
    # `final` how many output positions are now final, `done` whether the request ended.
    final: int = 0
    done: bool = False
    # This row's own part of the step failed (its structure, non-finite logits): it committed
    # nothing and its request ends with this error (step_loop.apply_row); the batch steps on.
    error: Optional[Exception] = None
    # Typed decisions: with a choice's probabilities asked for, the step that scored its options
    # carries one probability per option, in the choice's order (engine/sampling/choice.py).
    choices: tuple = ()


EMPTY = RowResult([], [], [])
NONFINITE = "the model's logits for this request were not finite (NaN or infinity); the other requests were not affected"


@dataclass(frozen=True)
class StepStats:
    batch: int  # requests served
    bucket_batch: int
    bucket_length: int
    window: int
    committed: int
    seconds: float
    cuda_graph: bool = False
    forwards: int = 1  # model calls this step (more than one when cache refresh groups differ)


class ConfigCosts:
    """The scheduler's two cost knobs, read from a runner's EngineConfig (`self.config`): what one
    more forward costs in tokens, and the most tokens one forward may compute."""

    config: Any

    @property
    def forward_overhead_tokens(self) -> int:
        return self.config.overhead_tokens

    @property
    def forward_token_budget(self) -> Optional[int]:
        return self.config.forward_token_budget


class StepRunner(Protocol):
    """What `StepLoop` needs of a runner."""

    slots: int  # rows of device state: at most this many requests run at once

    @property
    def forward_overhead_tokens(self) -> int:
        """What one more forward costs, in tokens of padding it would save (the grouping's price)."""

    # Optional: `forward_token_budget` (Optional[int]), the most tokens one forward may compute
    # (rows x padded length); a larger group steps part of its rows (StepLoop.next_batch).

    def row_tokens(self, seq: Sequence) -> int:
        """Columns this row's next forward computes: the scheduler's cost estimate."""

    def forward_kind(self, seq: Sequence) -> object:
        """Which of the step's forwards this row joins; rows of different kinds never share one."""

    def load(self, seq: Sequence) -> None:
        """Write a newly admitted request into its slot."""

    def step(self, seqs: Seq[Sequence]) -> tuple[list[RowResult], StepStats]:
        """One denoising step for every row: results in the same order. A runner whose
        `overlaps_host` is true also takes `during`, a callable it runs exactly once, after the
        step's device work is queued and before the host waits for its results (host work
        that overlaps the device's; `StepLoop.step_later`)."""

    # Optional: `release(slot)`, called on the step thread when a request leaves its slot
    # (finished, cancelled, failed), by a runner that holds per-request state outside
    # preallocated slot rows (revise_runner: each request's own cache).
    # Optional: `resumable(seq) -> bool`, whether `load(seq)` into any slot, where its canvas
    # stands, continues `seq` token for token; only such a runner preempts samples for another
    # client's share of the slots (engine/loop/fair_share.py). Without it, none is ever preempted.


def read_queued(reads: list[tuple[Seq[int], Callable[[], list[RowResult]]]], n: int,
                during: Optional[Callable[[], None]]) -> tuple[list[RowResult], int]:
    """A step's results once every group's device work is queued: `during` first (host work
    beside the device's), then each group's read (`row_results`, the host's wait) into the rows
    it holds, of n. -> (results by row, tokens committed)."""
    if during is not None:
        during()
    results, committed = [EMPTY] * n, 0
    for rows, read in reads:
        for i, r in zip(rows, read()):
            results[i] = r
            committed += len(r.positions)
    return results, committed


def nonfinite_rows(logits: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """(B,) bool: rows whose logits (B, W, V) hold a NaN or +inf at a `real` (B, W) column (not
    padding, whose queries may see no key), read before selection masks anything to -inf. One
    reduction: a column's sum is NaN or +inf exactly then (-inf alone, which a model may write
    for ids it never emits, sums to -inf). Summed in float32 (torch accumulates bfloat16 in it
    too) and returned in the logits' dtype where that has float32's range: asking for a float32
    result from bfloat16 logits took 1.1 ms at 32 x 126,464 against 0.17 (AVX-512, 2 threads).
    float16 sums are returned in float32: a row of ordinary logits can sum past 65,504."""
    total = logits.sum(dim=-1, dtype=torch.float32 if logits.dtype == torch.float16 else None)  # (B, W)
    return ((total.isnan() | (total == float("inf"))) & real).any(dim=1)


def isolate(candidate: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """`candidate` (B, W) with the failed rows' `bad` (B,) columns off: such a row commits
    nothing and writes nothing back; every other row's selection is its own, unchanged."""
    return candidate & ~bad[:, None]


def structure_row(constraint: Optional[object], first: int, width: int, W: int, params: SamplingParams
                  ) -> Optional[tuple[object, list[int], int]]:
    """A row's entry in `select_step`'s `constraints`: None when unconstrained, else its
    constraint, the output position of each of the W window columns (`first` on, `width` of
    them; -1 past them), and how many more positions each slot may commit after its front this
    step (`chain_rounds` of the row's `params`)."""
    if constraint is None:
        return None
    return constraint, [first + j if j < width else -1 for j in range(W)], chain_rounds(params)


def chain_rounds(p: SamplingParams) -> int:
    """Positions a slot commits this step past its front, left to right, each under its mask
    after the one before is taken (`chained`): a constrained request keeps the pace the request
    asked for. The fixed schedule's rate, ceil(block_length / steps_per_block) tokens a step
    (steps = gen_length: one, the front alone); a threshold row goes on while each next pick is
    at least as confident as its threshold (the block's length at most); a factor row as fixed."""
    if p.threshold is not None:
        return p.block_length - 1
    return -(-p.block_length // max(1, p.steps_per_block)) - 1


def select_step(logits: torch.Tensor, batch: SamplingBatch, window: Window, rule: SelectionRule, real: torch.Tensor,
                constraints: Seq, spans: Seq[tuple[int, int]], editable: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, Callable[[], list[RowResult]]]:
    """The selection both mask runners end a step with, over W window columns of B rows.

    `window.candidate` (B, W) is where the family would decode; structured rows (`constraints`,
    one `structure_row` a row) narrow it to their slots' fronts, and a row with non-finite logits
    at a `real` (B, W) column loses it (it commits nothing and ends alone). Then `select_tokens`
    under the family's rule, the published loops' tie order on CPU (`spans`, as `published_order`
    takes them; CUDA keeps the graph-safe stable order), and LLaDA2.1's edits where `editable`
    (B, W) is given. -> (the window's tokens after the step (B, W), the call that reads the rows'
    results: the host's wait for the device)."""
    tokens = window.tokens
    front, allowed, failed = window_masks(constraints, tokens.shape[1], tokens.device)
    choices = choice_scores(logits, constraints, failed)  # before anything writes the logits
    candidate = window.candidate if front is None else window.candidate & front  # none for a failed row
    bad = nonfinite_rows(logits, real)
    candidate = isolate(candidate, bad)
    sel = select_tokens(logits, batch, replace(window, candidate=candidate, allowed=allowed), rule)
    if tokens.device.type == "cpu":
        sel = published_order(sel, candidate, batch, rule, spans)
    if front is not None:
        sel, candidate = chained(sel, candidate, logits, batch, window, rule, constraints, failed, bad)
    if editable is not None:
        sel = with_edits(sel, tokens, editable, batch.editing)
    new = torch.where(sel.commit, sel.x0, tokens)
    return new, functools.partial(row_results, sel, new, candidate, batch, logits, bad, failed, choices)


def chained(sel: Selection, candidate: torch.Tensor, logits: torch.Tensor, batch: SamplingBatch, window: Window,
            rule: SelectionRule, constraints: Seq, failed: dict[int, Exception], bad: torch.Tensor
            ) -> tuple[Selection, torch.Tensor]:
    """Structured rows commit more than their fronts in one step: each round, the picks of the
    round before go to their constraints now (`Constraint.commit_early`), the slots' next fronts
    get their masks, and the same logits are selected again at those positions only, under the
    same rule, noise and knobs (a position's noise is keyed by its position, so a pick is the one
    it would get as a front of its own). A row goes on for its `chain_rounds`; a threshold row
    keeps a round's pick only at or above its threshold and stops at a round that keeps none.
    Unconstrained rows take no part; a row whose structure raises fails alone (`failed`). Each
    round reads the picks on the host (the constraint library runs there). -> (the selection with
    the chained commits, the candidates with the chained fronts)."""
    left = {r: e[2] for r, e in enumerate(constraints) if e is not None and e[2] > 0 and r not in failed}
    if not left:
        return sel, candidate
    before = set(failed)
    B, W = candidate.shape
    x0, commit, conf, n_commit = sel.x0, sel.commit, sel.conf, sel.n_commit
    last = commit
    gated = batch.threshold > 0  # (B,) threshold rows keep a chained pick only when it is confident
    while left:
        picks = torch.where(last, x0, -1).cpu()
        rows: list[Optional[tuple[object, list[int]]]] = [None] * B
        for r in list(left):
            taken = (picks[r] >= 0).nonzero().flatten().tolist()
            left[r] -= 1
            if left[r] < 0 or not taken:
                del left[r]
                continue
            c, cols = constraints[r][0], constraints[r][1]
            try:
                for j in taken:
                    c.commit_early(cols[j], int(picks[r, j]))
            except Exception as e:  # this row's own structure: it fails alone
                failed[r] = e
                del left[r]
                continue
            rows[r] = (c, cols)
        if not left:
            break
        front, allowed, broken = window_masks(rows, W, candidate.device)
        failed.update(broken)
        for r in broken:
            left.pop(r, None)
        active = torch.zeros(B, dtype=torch.bool)
        active[list(left)] = True
        fronts = isolate(window.candidate & front & active.to(front.device)[:, None], bad)
        s = select_tokens(logits, batch, replace(window, candidate=fronts, allowed=allowed), rule)
        last = s.commit & (~gated[:, None] | (s.conf >= batch.threshold.to(s.conf.dtype)[:, None]))
        x0, conf = torch.where(last, s.x0, x0), torch.where(last, s.conf, conf)
        commit, n_commit = commit | last, n_commit + last.sum(-1)
        candidate = candidate | fronts
    if broke := sorted(set(failed) - before):  # like a row failing at its masks: it writes nothing back
        gone = torch.zeros(B, dtype=torch.bool)
        gone[broke] = True
        commit = commit & ~gone.to(commit.device)[:, None]
    return replace(sel, x0=x0, commit=commit, conf=conf, n_commit=n_commit), candidate


def choice_scores(logits: torch.Tensor, constraints: Seq, failed: dict[int, Exception]) -> dict[int, torch.Tensor]:
    """{row: (K,) option probabilities} of the rows whose choice is scored at this step
    (`Constraint.choice_columns`), from their own window logits (B, W, V), raw as the model wrote
    them. A Python walk over the step's rows, and work only for rows that asked: every other row
    costs one attribute read. A row whose scoring raises joins `failed` (it ends alone)."""
    out: dict[int, torch.Tensor] = {}
    for r, entry in enumerate(constraints):
        if entry is None or r in failed or not getattr(entry[0], "score_choices", False):
            continue
        try:
            cols = entry[0].choice_columns(entry[1])
            if cols is not None:
                index = torch.tensor(cols, device=logits.device)
                out[r] = option_probabilities(logits[r].index_select(0, index), entry[0].choice_ids())
        except Exception as e:  # this row's own structure: it fails alone
            failed[r] = e
    return out


def row_results(sel: Selection, new: torch.Tensor, candidate: torch.Tensor, batch: SamplingBatch,
                logits: torch.Tensor, bad: Optional[torch.Tensor] = None,
                failed: Optional[dict[int, Exception]] = None,
                choices: Optional[dict[int, torch.Tensor]] = None) -> list[RowResult]:
    """The host records of a step's real rows: one device->host copy of the commits, tokens and
    confidences (the step's synchronisation), plus log-probabilities (of the raw logits), the
    provisional picks and a choice's option probabilities where rows ask for them. A row in
    `failed` (host-known, e.g. its structure raised) or flagged in `bad` (B,) (non-finite logits)
    gets its error instead."""
    out = _rows(sel, new, candidate, batch, logits)
    for r, probs in (choices or {}).items():
        if r < len(out):
            out[r] = replace(out[r], choices=tuple(probs.cpu().tolist()))
    errors = dict(failed or {})
    if bad is not None:
        errors.update((r, RowFailed(NONFINITE)) for r in bad[:len(out)].cpu().nonzero().flatten().tolist()
                      if r not in errors)
    for r, e in errors.items():
        out[r] = RowResult([], [], [], error=e)
    return out


def _rows(sel: Selection, new: torch.Tensor, candidate: torch.Tensor, batch: SamplingBatch,
          logits: torch.Tensor) -> list[RowResult]:
    n = batch.rows
    commit, tokens, conf = sel.commit[:n].cpu(), new[:n].cpu(), sel.conf[:n].float().cpu()
    top = batch.top_logprobs
    lps = None if top < 0 else tuple(None if t is None else t[:n].cpu() for t in token_logprobs(logits, new, top))
    guess = torch.where(candidate & ~sel.commit, sel.x0, -1)[:n].cpu() if any(batch.provisional) else None
    out = []
    for r in range(n):
        pos = commit[r].nonzero().flatten()
        lp = row_logprobs(lps, r, pos) if batch.logprobs[r] is not None else ()
        prov = _row_provisional(guess, conf, r) if batch.provisional[r] else ()
        out.append(RowResult(pos.tolist(), tokens[r, pos].tolist(), conf[r, pos].tolist(), lp, prov))
    return out


def row_logprobs(extra: Optional[tuple], r: int, pos: torch.Tensor) -> tuple:
    """RowResult.logprobs of row r's committed positions from host `token_logprobs` outputs."""
    chosen, values, ids = extra
    lp = chosen[r, pos].tolist()
    if values is None:
        return tuple((x, ()) for x in lp)
    v, i = values[r, pos].tolist(), ids[r, pos].tolist()
    return tuple((x, tuple(zip(ii, vv))) for x, ii, vv in zip(lp, i, v))


def _row_provisional(guess: torch.Tensor, conf: torch.Tensor, r: int) -> tuple:
    """RowResult.provisional of row r: `guess` holds the sampler's pick at each candidate it left
    masked and -1 elsewhere; `conf` the confidences it ranked by."""
    pos = (guess[r] >= 0).nonzero().flatten()
    return tuple(zip(pos.tolist(), guess[r, pos].tolist(), conf[r, pos].tolist()))
