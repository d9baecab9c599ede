"""The selection tail the two mask families end a step with (canvas/ and block/ runners).

After its forward a mask runner hands `select_step` the window's logits and one `SelectionInput`:
structured rows (one `ConstraintRow` each, `structure_row`) narrow the candidates to their slots'
fronts and chain several positions a step (`chained`); a row with non-finite logits loses its
candidates (`nonfinite_rows`, `isolate`); `select_tokens` picks under the family's rule; the
returned read (`row_results`) is the one place a step's device results become host records.

Why here, at the families' level: both mask runners share it and no family folder may import
another, while the loop neither selects tokens nor imports structured/ (tests/unit/test_imports.py);
a module beside family.py and registry.py is what every family folder may import. The revise
family reads `nonfinite_rows` and `row_logprobs` from here too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Optional, Sequence as Seq

import torch

from celeris.engine.errors import RowFailed
from celeris.engine.loop.runner_api import RowResult
from celeris.engine.sampling.batch import SamplingBatch, Selection, SelectionRule, Window
from celeris.engine.sampling.choice import decide, option_probabilities
from celeris.engine.sampling.params import SamplingParams
from celeris.engine.sampling.select import published_order, select_tokens, token_logprobs, with_edits
from celeris.engine.structured.masks import window_masks

if TYPE_CHECKING:
    from celeris.engine.structured.constraint import Constraint

NONFINITE = "the model's logits for this request were not finite (NaN or infinity); the other requests were not affected"


@dataclass(frozen=True)
class ConstraintRow:
    """A structured row's part in one step's selection (`structure_row`)."""

    constraint: Constraint
    columns: tuple[int, ...]  # the output position of each of the W window columns, -1 past the row's block
    rounds: int  # positions each slot may commit after its front this step (`chain_rounds`)


@dataclass(frozen=True)
class SelectionInput:
    """What a mask runner hands `select_step` beside one forward's window logits (B, W, V)."""

    batch: SamplingBatch
    window: Window  # `window.candidate` (B, W): where the family would decode
    rule: SelectionRule
    real: torch.Tensor  # (B, W) columns that are not padding (their logits are checked for NaN/inf)
    structure: Seq[Optional[ConstraintRow]]  # one a row: None when unconstrained
    spans: Seq[tuple[int, int]]  # the published loops' tie order on CPU, as `published_order` takes them
    editable: Optional[torch.Tensor] = None  # (B, W) LLaDA2.1: written tokens it may edit


@dataclass(frozen=True)
class Picked:
    """A step's selection on the device, until `row_results` reads it on the host."""

    sel: Selection
    new: torch.Tensor  # (B, W) the window's tokens after the step
    candidate: torch.Tensor  # (B, W) where it decoded (structured rows: their fronts, chained ones too)
    bad: torch.Tensor  # (B,) rows with non-finite logits
    failed: dict[int, Exception]  # rows whose own structure raised (host-known)
    choices: dict[int, torch.Tensor]  # row -> (K,) a typed choice's option probabilities


def structure_row(constraint: Optional[Constraint], first: int, width: int, W: int, params: SamplingParams
                  ) -> Optional[ConstraintRow]:
    """A row's entry in `SelectionInput.structure`: None when unconstrained, else its constraint
    with the output position of each of the W window columns (`first` on, `width` of them) and
    its `chain_rounds`."""
    if constraint is None:
        return None
    return ConstraintRow(constraint, tuple(first + j if j < width else -1 for j in range(W)), chain_rounds(params))


def constraint_work(constraint: Optional[Constraint], params: SamplingParams) -> int:
    """A row's host constraint work in its next step, in the loop's units (`StepRunner.
    row_constraint_work`): one a round of token masks, its front's and each chained one's
    (`chain_rounds`); 0 unconstrained."""
    return 0 if constraint is None else 1 + chain_rounds(params)


def chain_rounds(p: SamplingParams) -> int:
    """Positions a slot commits this step past its front, left to right, each under its mask
    after the one before is taken (`chained`): a constrained request keeps the pace the request
    asked for. The fixed schedule's rate, ceil(block_length / steps_per_block) tokens a step
    (steps = gen_length: one, the front alone); a threshold row goes on while each next pick is
    at least as confident as its threshold (the block's length at most); a factor row as fixed."""
    if p.threshold is not None:
        return p.block_length - 1
    return -(-p.block_length // max(1, p.steps_per_block)) - 1


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


def _mask_rows(rows: Seq[Optional[ConstraintRow]]) -> list:
    """`window_masks`' rows: (constraint, columns) of each structured row, None for the others."""
    return [None if r is None else (r.constraint, r.columns) for r in rows]


def select_step(logits: torch.Tensor, step: SelectionInput) -> tuple[torch.Tensor, Callable[[], list[RowResult]]]:
    """The selection both mask runners end a step with, over the W window columns of B rows.

    Structured rows narrow the candidates to their slots' fronts, and a row with non-finite
    logits at a real column loses them (it commits nothing and ends alone). Then `select_tokens`
    under the family's rule, the published loops' tie order on CPU (CUDA keeps the graph-safe
    stable order), the structured rows' chained positions, and LLaDA2.1's edits where the step
    has `editable` columns. -> (the window's tokens after the step (B, W), the call that reads the
    rows' results: the host's wait for the device)."""
    batch, window, rule = step.batch, step.window, step.rule
    tokens = window.tokens
    scoring: dict[int, Exception] = {}  # the decision narrows this step's masks: scored first
    choices = choice_scores(logits, step.structure, scoring, batch)  # before anything writes the logits
    front, allowed, failed = window_masks(_mask_rows(step.structure), tokens.shape[1], tokens.device)
    failed.update(scoring)
    candidate = window.candidate if front is None else window.candidate & front  # none for a failed row
    bad = nonfinite_rows(logits, step.real)
    candidate = isolate(candidate, bad)
    sel = select_tokens(logits, batch, replace(window, candidate=candidate, allowed=allowed), rule)
    if tokens.device.type == "cpu":
        sel = published_order(sel, candidate, batch, rule, step.spans)
    if front is not None:
        sel, candidate = chained(sel, candidate, logits, step, failed, bad)
    if step.editable is not None:
        sel = with_edits(sel, tokens, step.editable, batch.editing)
    new = torch.where(sel.commit, sel.x0, tokens)
    return new, functools.partial(row_results, Picked(sel, new, candidate, bad, failed, choices), batch, logits)


def chained(sel: Selection, candidate: torch.Tensor, logits: torch.Tensor, step: SelectionInput,
            failed: dict[int, Exception], bad: torch.Tensor) -> tuple[Selection, torch.Tensor]:
    """Structured rows commit more than their fronts in one step: each round, the picks of the
    round before go to their constraints now (`Constraint.commit_early`), the slots' next fronts
    get their masks, and the same logits are selected again at those positions only, under the
    same rule, noise and knobs (a position's noise is keyed by its position, so a pick is the one
    it would get as a front of its own). A row goes on for its `ConstraintRow.rounds`; a threshold
    row keeps a round's pick only at or above its threshold and stops at a round that keeps none.
    Unconstrained rows take no part; a row whose structure raises fails alone (joins `failed`);
    a row in `bad` (B,) (non-finite logits) picks nothing. Each round reads the picks on the host
    (the constraint library runs there). -> (the selection with the chained commits, the
    candidates with the chained fronts)."""
    batch = step.batch
    left = {r: e.rounds for r, e in enumerate(step.structure) if e is not None and e.rounds > 0 and r not in failed}
    if not left:
        return sel, candidate
    before = set(failed)
    B, W = candidate.shape
    x0, commit, conf, n_commit = sel.x0, sel.commit, sel.conf, sel.n_commit
    last = commit
    gated = batch.threshold > 0  # (B,) threshold rows keep a chained pick only when it is confident
    while left:
        rows = _commit_round(torch.where(last, x0, -1).cpu(), left, step.structure, failed)
        if not left:
            break
        front, allowed, broken = window_masks(rows, W, candidate.device)
        failed.update(broken)
        for r in broken:
            left.pop(r, None)
        active = torch.zeros(B, dtype=torch.bool)
        active[list(left)] = True
        fronts = isolate(step.window.candidate & front & active.to(front.device)[:, None], bad)
        s = select_tokens(logits, batch, replace(step.window, candidate=fronts, allowed=allowed), step.rule)
        last = s.commit & (~gated[:, None] | (s.conf >= batch.threshold.to(s.conf.dtype)[:, None]))
        x0, conf = torch.where(last, s.x0, x0), torch.where(last, s.conf, conf)
        commit, n_commit = commit | last, n_commit + last.sum(-1)
        candidate = candidate | fronts
    if broke := sorted(set(failed) - before):  # like a row failing at its masks: it writes nothing back
        gone = torch.zeros(B, dtype=torch.bool)
        gone[broke] = True
        commit = commit & ~gone.to(commit.device)[:, None]
    return replace(sel, x0=x0, commit=commit, conf=conf, n_commit=n_commit), candidate


def _commit_round(picks: torch.Tensor, left: dict[int, int], structure: Seq[Optional[ConstraintRow]],
                  failed: dict[int, Exception]) -> list:
    """One round of `chained` on the host: each row still going commits its last round's picks
    (`picks` (B, W), -1 where none) to its constraint; a row out of rounds or picks stops, a row
    whose structure raises joins `failed`. -> `window_masks`' rows for the next fronts."""
    rows: list = [None] * len(picks)
    for r in list(left):
        taken = (picks[r] >= 0).nonzero().flatten().tolist()
        left[r] -= 1
        if left[r] < 0 or not taken:
            del left[r]
            continue
        c, cols = structure[r].constraint, structure[r].columns
        try:
            for j in taken:
                c.commit_early(cols[j], int(picks[r, j]))
        except Exception as e:  # this row's own structure: it fails alone
            failed[r] = e
            del left[r]
            continue
        rows[r] = (c, cols)
    return rows


def choice_scores(logits: torch.Tensor, structure: Seq[Optional[ConstraintRow]], failed: dict[int, Exception],
                  batch: SamplingBatch) -> dict[int, torch.Tensor]:
    """{row: (K,) option probabilities} of the rows whose choice is scored at this step
    (`Constraint.choice_columns`), from their own window logits (B, W, V), raw as the model wrote
    them; each such row's constraint then writes the option they decide (`choice.decide`: the
    argmax at temperature 0, a seeded draw when sampling). A Python walk over the step's rows, and
    work only for rows that asked: every other row costs one attribute read. A row whose scoring
    raises joins `failed` (it ends alone)."""
    out: dict[int, torch.Tensor] = {}
    for r, entry in enumerate(structure):
        if entry is None or r in failed or not getattr(entry.constraint, "score_choices", False):
            continue
        try:
            cols = entry.constraint.choice_columns(entry.columns)
            if cols is not None:
                index = torch.tensor(cols, device=logits.device)
                out[r] = option_probabilities(logits[r].index_select(0, index), entry.constraint.choice_ids())
                entry.constraint.decide(decide(out[r], float(batch.temperature[r]), int(batch.seed[r])))
        except Exception as e:  # this row's own structure: it fails alone
            failed[r] = e
    return out


def row_results(picked: Picked, batch: SamplingBatch, logits: torch.Tensor) -> list[RowResult]:
    """The host records of a step's real rows: one device->host copy of the commits, tokens and
    confidences (the step's synchronisation), plus log-probabilities (of the raw logits), the
    provisional picks and a choice's option probabilities where rows ask for them. A row in
    `picked.failed` (host-known, e.g. its structure raised) or flagged in `picked.bad` (non-finite
    logits) gets its error instead."""
    out = _rows(picked, batch, logits)
    for r, probs in picked.choices.items():
        if r < len(out):
            out[r] = replace(out[r], choices=tuple(probs.cpu().tolist()))
    errors = dict(picked.failed)
    errors.update((r, RowFailed(NONFINITE)) for r in picked.bad[:len(out)].cpu().nonzero().flatten().tolist()
                  if r not in errors)
    for r, e in errors.items():
        out[r] = RowResult([], [], [], error=e)
    return out


def _rows(picked: Picked, batch: SamplingBatch, logits: torch.Tensor) -> list[RowResult]:
    n, sel = batch.rows, picked.sel
    commit, tokens, conf = sel.commit[:n].cpu(), picked.new[:n].cpu(), sel.conf[:n].float().cpu()
    top = batch.top_logprobs
    lps = None if top < 0 else tuple(None if t is None else t[:n].cpu()
                                     for t in token_logprobs(logits, picked.new, top))
    guess = torch.where(picked.candidate & ~sel.commit, sel.x0, -1)[:n].cpu() if any(batch.provisional) else None
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
