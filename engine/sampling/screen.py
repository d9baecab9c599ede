"""Which candidates can commit this step, decided before the float64 softmax (CPU).

LLaDA's published rule ranks a block's masked positions by p(x0) from a float64 softmax over the
vocabulary (`select.confidences`). At a 126k vocabulary that softmax was the largest part of a bf16
step on the CPU, and most of it decides nothing: a fixed schedule commits k of the candidates.

Here every candidate's p(x0) = e^l[x0] / sum_v e^l[v] is first estimated in float32 (`quick`):
the logits widened to float32 (exact), exp, the terms summed in float32 in runs of `_RUN` (every
(V // _RUN)-th term: the sum runs along an outer dimension, vectorised) and the runs in float64.
A row whose maximum lies outside [`_LOW`, `_HIGH`] (where e^l could overflow, or underflow enough
to matter) first has its maximum subtracted. The relative error,
bounded term by term with u = 2^-24 (`rel_quick`, per estimate: ~4e-6 for a row taken as it is,
up to ~1e-5 more for a shifted one at a 126k vocabulary; measured ~2e-8):
- each exp within 1 ulp (torch's vectorised float32 exp; glibc's for the tail), 2u relatively;
  terms lost to underflow (flushed to zero or not) weigh under V 2^-126 / e^_LOW of the sum;
- a run of `_RUN` non-negative terms summed in any order within (_RUN - 1) u; the float64 total
  of V / _RUN runs and the division add ~V 2^-53;
- a shifted row only: the subtraction (one rounding in float32) moves a term e^-m by at most m u
  relatively; over the sum that is at most u times the mean of m under the softmax, which is at
  most its entropy (the maximum's term is 1, so m = -log p - log sum <= -log p), so <= ln(V) u;
  the numerator's own m (0 where x0 is the maximum) moves it by m u.
A numerator below 2^-100 (a logit ~69 under the maximum, or under -69) is not screened.
The bound used is twice their sum. On an AVX-512 host (2 threads, 32 rows of 126,464 logits)
this takes 1.8 ms, the table below 4.1-4.5 and the float64 softmax 20. Then only the candidates
whose upper bound reaches the row's cut get the published float64 value (`select._measures`): the
cut is the k-th best lower bound (a threshold row: its top-1's, and the threshold itself). Every
other candidate keeps its estimate, below the cut and so below at least k published values: the
committed set is decided by published values alone, and every committed position reports its
published confidence. A greedy step takes its picks from the same float32 copy (`picked`): the
row maximum the estimate needs is the logit at the first argmax, and the window is read once
(bf16 `amax` took twice float32's time per element on the AVX-512 host), only at the candidates.

Where `quick` leaves more contenders than the rows take (candidates within ~1e-5 of one another:
a random model, or a trained one's EOS tail, where many positions sit near 1.0), 16-bit logits
get a second, tighter estimate at those contenders first (`estimates`): a table of e^v in float64
over the 65,536 values a 16-bit float can hold, a gather and a float64 sum per logit. It and the
published value are within ~3e-11 of the true quotient (each term's exp within 1 ulp, the
subtraction of the maximum exact or negligible, a sum of V positive terms in any order within
(V - 1) * 2^-53 ~ 1.4e-11 at V = 126k), so `REL` = 1e-9 bounds their difference with a 30x
margin.

Ties. Where published values tie at the cut, `torch.topk` (the published loops' order,
`select.published_order`) chooses among them by how it walked the whole array, other values
included; such a row (or one with a NaN) gets every candidate's published value, as before.
Exact float64 ties are rare.

Not screened (every candidate's published value, as before): rows asking for provisional picks
(they report every candidate's confidence), other REMASKING measures, the factor rule, the block
families' rule, confidences not in float64, logits in another dtype, a sum out of range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from celeris.engine.sampling.batch import REMASK_CODE, SamplingBatch, SelectionRule

REL = 1e-9  # the table's estimates: |estimate - published| / published is below ~3e-11 (module docstring)
_RUN = 32  # float32 terms summed before the float64 total (their rounding: (_RUN - 1) 2^-24)
_LOW, _HIGH = -30.0, 80.0  # a row whose maximum lies here is exponentiated as it is (`quick`)
TABLE_DTYPES = (torch.bfloat16, torch.float16)
SCREEN_DTYPES = (*TABLE_DTYPES, torch.float32)
_NUMERATOR_MIN = 2.0 ** -100  # a quick numerator below (its logit > ~69 under the maximum) is not screened
_FLOOR = 2.0 ** -850  # a row's sum below this (its maximum below e^-590) is not screened: underflow
_SMALLEST = 1e-290  # estimates below: a numerator or quotient near float64's subnormals, not screened
_CHUNK = 1 << 21  # logits gathered per pass of the table (16 MiB of float64 terms)
_RUN_COPY_MIN = 1 << 14  # logits a row from which `_widened` copies run by run (measured: 4k no, 126k yes)
_QUICK_CHUNK = 1 << 22  # logits per pass of `quick` and `picked` (16 MiB of float32: 33 rows of 126k)
_TABLES: dict[torch.dtype, torch.Tensor] = {}


@dataclass(frozen=True)
class Screen:
    """Per row: how many candidates its rule takes by rank this step (a threshold row: 1, its
    top-1), -1 where every candidate's published value is computed; and its threshold (> 0:
    every candidate at or above it commits too). Given as sequences, kept as tensors (made once
    a step). `estimated`: `quick`'s (estimates, bounds) of every candidate where the caller has
    them already (`picked`), in the order of the candidates' flat positions."""

    need: torch.Tensor  # (B,) long
    threshold: torch.Tensor  # (B,) float64
    estimated: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def __post_init__(self):
        object.__setattr__(self, "need", torch.as_tensor(self.need, dtype=torch.long))
        object.__setattr__(self, "threshold", torch.as_tensor(self.threshold, dtype=torch.float64))


def screening(batch: SamplingBatch, rule: SelectionRule, logits_dtype: torch.dtype, conf_dtype: torch.dtype
              ) -> Optional[Screen]:
    """The rows' `Screen`, or None where no row is screened. Host reads of (B,) knobs: CPU only."""
    if conf_dtype != torch.float64 or rule.block_threshold or logits_dtype not in SCREEN_DTYPES:
        return None
    k, remask, factor = batch.k.tolist(), batch.remask.tolist(), batch.factor.tolist()
    B = len(k)
    need = []
    for r in range(B):
        if r >= batch.rows:  # padding: no candidates
            need.append(0)
        elif remask[r] != REMASK_CODE["low_confidence"] or factor[r] > 0 or batch.provisional[r]:
            need.append(-1)
        else:
            need.append(1 if batch.thresholds[r] > 0 else max(k[r], 0))
    if all(n < 0 for n in need):
        return None
    return Screen(need, tuple(batch.thresholds) + (0.0,) * (B - batch.rows))


def _table(dtype: torch.dtype) -> torch.Tensor:
    """e^v in float64 for each of the 65,536 bit patterns of a 16-bit float, indexed by the
    pattern read as unsigned (inf above ~709.8, 0 below ~-745, NaN for NaNs)."""
    table = _TABLES.get(dtype)
    if table is None:
        bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)  # 32768.. wrap to negative
        table = _TABLES[dtype] = bits.view(dtype).double().exp()
    return table


def rel_quick(V: int, shifted: torch.Tensor, gap: torch.Tensor) -> torch.Tensor:
    """A bound on |quick estimate - published| / published at a vocabulary of V, per estimate:
    whether its row was `shifted` by its maximum, and then how far (`gap` >= 0, float32) its
    numerator's logit lies under it (module docstring)."""
    u = 2.0 ** -24
    sub = shifted.double() * (gap.double() + math.log(max(V, 2)))
    return 2 * ((2 + 2 + _RUN - 1 + sub) * u + V * 2.0 ** -52)


def quick(rows: torch.Tensor, x0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """p(x0) of each logit row (N, V) (`SCREEN_DTYPES`), x0 (N,), and its relative error bound
    (`rel_quick`) against the published float64 softmax; NaN where it cannot be bounded (a row
    with a NaN or +inf, no finite logit, or a numerator below 2^-100)."""
    return quick_at(rows[None], torch.arange(rows.shape[0]), x0)


def quick_at(logits: torch.Tensor, flat: torch.Tensor, x0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quick` of the rows at flat (N,) (ascending b * W + w) of (B, W, V) logits, x0 (N,), each
    row copied once, straight to float32 (`_widened`; the caller's logits are never written)."""
    parts = [_estimate(e, x0[i:i + e.shape[0]], e.amax(-1)) for i, e in _passes(logits, flat)]
    return _joined(parts, flat.numel(), logits.shape[-1])


def picked(logits: torch.Tensor, flat: torch.Tensor, banned: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A greedy step's picks and their `quick` estimates from one float32 copy of each row.

    logits (B, W, V) (`SCREEN_DTYPES`), flat (N,) positions b * W + w -> x0 (N,), the first
    argmax of each row with id `banned` excluded (`select._argmax_but`'s token), and p(x0)'s
    estimate and bound as `quick(rows, x0)` gives them. The row maximum that `quick` needs is the
    logit at the first argmax, so a row is read by one vectorised max instead of two (the window
    argmax in bf16 took twice float32's time per element here), and only the candidates' rows."""
    N, V = flat.numel(), logits.shape[-1]
    x0 = torch.empty(N, dtype=torch.long)
    parts = []
    for i, e in _passes(logits, flat):
        at = first_argmax(e)  # (n,) the first maximum, or the first NaN
        top = e.gather(1, at[:, None]).squeeze(1)  # (n,) the row maximum (NaN for a NaN row)
        hit = (at == banned).nonzero().squeeze(1)  # (h,) rows whose maximum is the banned id
        if hit.numel():
            again = e.index_select(0, hit)
            again[:, banned] = float("-inf")
            at.index_copy_(0, hit, first_argmax(again))
        x0[i:i + at.numel()] = at
        parts.append(_estimate(e, at, top))
    est, bound = _joined(parts, N, V)
    return x0, est, bound


def _passes(logits: torch.Tensor, flat: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """(offset into flat, float32 copy (n, V) of those rows: `_widened`) of the rows at flat (N,)
    of (B, W, V) logits, `_QUICK_CHUNK` logits a pass at most: few passes, since each op of a pass
    is a parallel region (`quick_at`, `picked`)."""
    step = max(1, _QUICK_CHUNK // max(logits.shape[-1], 1))
    for i in range(0, flat.numel(), step):
        yield i, _widened(logits, flat[i:i + step])


def _widened(logits: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """A float32 copy (n, V) of the rows at flat (n,) (ascending) of (B, W, V) logits. 16-bit rows
    of a large vocabulary are written straight from each run of consecutive positions (a
    candidate set is a few runs of a window): one pass, where `rows_at` and a conversion are two;
    float32 rows, and short ones (where a copy per run costs more than the second pass), are
    gathered by `rows_at`."""
    B, W, V = logits.shape
    if logits.dtype == torch.float32 or V < _RUN_COPY_MIN:
        return rows_at(logits, flat).to(torch.float32)
    try:
        src = logits.view(B * W, V)
    except RuntimeError:  # a window sliced out of longer logits (B > 1)
        return rows_at(logits, flat).to(torch.float32)
    out = torch.empty(flat.numel(), V, dtype=torch.float32)
    at = flat.tolist()  # a host read: CPU only
    j = 0
    while j < len(at):
        k = j + 1
        while k < len(at) and at[k] == at[k - 1] + 1:
            k += 1
        out[j:k].copy_(src[at[j]:at[j] + k - j])
        j = k
    return out


def _estimate(e: torch.Tensor, at: torch.Tensor, top: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quick` on a float32 copy e (n, V) of the rows (overwritten), at (n,) the numerators' ids
    and top (n,) each row's maximum -> (estimate (n,) float64, NaN where unbounded; shifted (n,);
    gap (n,), the numerator's distance under a shifted row's maximum)."""
    n, V = e.shape
    whole = V - V % _RUN
    shift = ~((top >= _LOW) & (top <= _HIGH))  # NaN too: its estimate is NaN either way
    gap = torch.zeros(n)
    if bool(shift.any()):
        e.sub_(torch.where(shift, top, 0.0)[:, None])
        gap = torch.where(shift, -e.gather(1, at[:, None]).squeeze(1), 0.0)
    e = e.exp_()
    # runs of _RUN terms (strided: the reduction runs along an outer dimension, vectorised across
    # the inner one), each summed in float32 in some order, then the runs in float64
    total = e[:, :whole].view(n, _RUN, whole // _RUN).sum(1).double().sum(-1)  # (n,)
    if whole < V:
        total += e[:, whole:].double().sum(-1)
    num = e.gather(1, at[:, None]).squeeze(1)  # (n,) float32: the numerator
    est = torch.where(num >= _NUMERATOR_MIN, num.double() / total, float("nan"))
    return est, shift, gap


def _joined(parts: list, N: int, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_estimate`'s per-pass results -> (estimates (N,), NaN where unbounded; bounds (N,))."""
    if not parts:
        return torch.empty(0, dtype=torch.float64), torch.empty(0, dtype=torch.float64)
    est, shifted, gap = (torch.cat(x) for x in zip(*parts))
    ok = est.isfinite()
    return (torch.where(ok, est, torch.full_like(est, float("nan"))),
            rel_quick(V, shifted, torch.where(ok, gap, 0.0)))


def estimates(rows: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """p(x0) of each 16-bit logit row (N, V), x0 (N,), from the table: within `REL` of the
    published float64 softmax; NaN where it cannot be bounded (a non-finite or out-of-range row)."""
    N, V = rows.shape
    table = _table(rows.dtype)
    bits = rows.view(torch.uint16)  # the pattern read as unsigned: the table's index
    total = torch.empty(N, dtype=torch.float64)
    step = max(1, _CHUNK // max(V, 1))
    for i in range(0, N, step):  # a row's terms are summed within one pass; few passes (each a
        idx = bits[i:i + step].to(torch.int32)  # parallel region, which waits on a busy machine)
        total[i:i + step] = table.index_select(0, idx.view(-1)).view(idx.shape).sum(-1)
    top = table.index_select(0, rows.gather(1, x0[:, None]).squeeze(1).view(torch.uint16).to(torch.int32))
    est = top / total
    ok = total.isfinite() & (total >= _FLOOR) & top.isfinite() & (top >= _SMALLEST) & (est >= _SMALLEST)
    return torch.where(ok, est, torch.full_like(est, float("nan")))


def contenders(estimate: torch.Tensor, flat: torch.Tensor, B: int, W: int, screen: Screen,
               bound: torch.Tensor) -> torch.Tensor:
    """(N,) bool over the candidates `flat` (N,) (b * W + w): those that need their published
    value: every candidate of an unscreened row, an estimate that is NaN, and those whose upper
    bound (`bound` (N,): each estimate's relative error bound) reaches the row's cut (the need-th
    best lower bound, or the threshold if lower)."""
    valid = estimate.isfinite()
    lo = torch.where(valid, estimate * (1 - bound), torch.full_like(estimate, float("-inf")))
    hi = torch.where(valid, estimate * (1 + bound), torch.full_like(estimate, float("inf")))
    need = screen.need
    rows = flat // W
    n = need.clamp_min(0).minimum(torch.zeros(B, dtype=torch.long).index_add_(0, rows, torch.ones_like(rows)))
    lo_bw = torch.full((B * W,), float("-inf"), dtype=torch.float64).index_copy_(0, flat, lo).view(B, W)
    kth = lo_bw.sort(-1, descending=True).values.gather(1, (n - 1).clamp_min(0)[:, None]).squeeze(1)
    cut = torch.where(n > 0, kth, torch.full_like(kth, float("inf")))
    thr = screen.threshold
    cut = torch.where(thr > 0, torch.minimum(cut, thr), cut)
    return (need[rows] < 0) | (hi >= cut[rows])


def tied(conf: torch.Tensor, exact: torch.Tensor, screen: Screen) -> torch.Tensor:
    """(B,) bool: screened rows whose published values (conf (B, W) where `exact` (B, W)) tie at
    the cut, or hold a NaN: these need every candidate's published value."""
    B, W = conf.shape
    need = screen.need
    vals = torch.where(exact, conf, torch.full_like(conf, float("-inf")))
    ranked = vals.sort(-1, descending=True).values
    n = need.clamp(0, W - 1)
    at = ranked.gather(1, (n - 1).clamp_min(0)[:, None]).squeeze(1)
    below = ranked.gather(1, n[:, None]).squeeze(1)
    tie = (need >= 1) & (exact.sum(-1) > need) & (at == below)
    return (tie | (vals.isnan() & exact).any(-1)) & (need >= 0)


def screened(logits: torch.Tensor, x0: torch.Tensor, flat: torch.Tensor, screen: Screen, dtype: torch.dtype,
             published: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Confidences (B, W) of logits (B, W, V) (`SCREEN_DTYPES`) at the candidates flat (N,) (b * W + w), 0
    elsewhere: `published(at)` (the float64 measure at positions at (n,)) where a candidate can
    commit, its row is not screened or ties at its cut; an estimate elsewhere (`quick`, or for
    16-bit logits the table's where `quick` cannot decide)."""
    B, W, V = logits.shape
    conf = torch.zeros(B * W, dtype=dtype)
    if flat.numel() == 0:
        return conf.view(B, W)
    screened_at = screen.need[flat // W] >= 0
    est = torch.full((flat.numel(),), float("nan"), dtype=torch.float64)
    bound = torch.full_like(est, float("inf"))
    if screen.estimated is not None:
        est, bound = (torch.where(screened_at, x, y) for x, y in zip(screen.estimated, (est, bound)))
    elif bool(screened_at.any()):
        at = flat[screened_at]
        est[screened_at], bound[screened_at] = quick_at(logits, at, x0.reshape(-1)[at])
    exact = contenders(est, flat, B, W, screen, bound)
    if logits.dtype in TABLE_DTYPES:  # more contenders than the rows take: the table decides closer
        close = exact & screened_at & est.isfinite()
        per_row = torch.zeros(B, dtype=torch.long).index_add_(0, flat[close] // W, torch.ones_like(flat[close]))
        if bool((per_row > screen.need.clamp_min(0)).any()):
            at = flat[close]
            est[close], bound[close] = estimates(rows_at(logits, at), x0.reshape(-1)[at]), REL
            exact = contenders(est, flat, B, W, screen, bound)
    conf.index_copy_(0, flat, est.to(dtype))
    conf.index_copy_(0, flat[exact], published(flat[exact]))
    known = torch.zeros(B * W, dtype=torch.bool).index_fill_(0, flat[exact], True).view(B, W)
    redo = tied(conf.view(B, W), known, screen)[flat // W] & ~exact
    if bool(redo.any()):
        conf.index_copy_(0, flat[redo], published(flat[redo]))
    return conf.view(B, W)


def first_argmax(x: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """`x.argmax(-1)`, the same index (the first maximum; the first NaN if any), computed as a
    vectorised max over chunks of the last dimension, then an argmax inside the winning chunk.

    torch's argmax over a long last dimension runs element by element on the CPU (at a 126k
    vocabulary it cost more than the head's matmul in bf16); amax is vectorised. The first chunk
    holding the maximum (or a NaN: amax and argmax both propagate it) holds its first index.
    """
    *lead, V = x.shape
    flat = x.reshape(-1, V)
    if x.device.type != "cpu" or V < 2 * chunk or flat.shape[0] == 0:
        return x.argmax(-1)
    whole = V - V % chunk
    body = flat[:, :whole].view(flat.shape[0], whole // chunk, chunk)  # (R, C, K)
    c = body.amax(-1).argmax(-1)  # (R,) the first chunk holding the row's maximum
    inside = torch.gather(body, 1, c[:, None, None].expand(-1, 1, chunk)).squeeze(1).argmax(-1)
    idx = c * chunk + inside
    if whole < V:  # the tail wins only if strictly greater, or NaN where the body has none
        tail = flat[:, whole:]
        best, top = flat.gather(1, idx[:, None]).squeeze(1), tail.amax(-1)
        take = (top > best) | (top.isnan() & ~best.isnan())
        idx = torch.where(take, whole + tail.argmax(-1), idx)
    return idx.view(lead)


def rows_at(logits: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """The vocabulary rows (N, V) of (B, W, V) logits at flat (N,) positions b * W + w, copied
    once (index_select copies whole rows; advanced indexing goes element by element)."""
    B, W, V = logits.shape
    try:
        return logits.view(B * W, V).index_select(0, flat)
    except RuntimeError:  # a window sliced out of longer logits (B > 1)
        return logits[flat // W, flat % W]
