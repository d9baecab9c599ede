"""Which candidates can commit this step, decided before the float64 softmax (CPU).

LLaDA's published rule ranks a block's masked positions by p(x0) from a float64 softmax over the
vocabulary (`select.confidences`). At a 126k vocabulary that softmax was the largest part of a bf16
step on the CPU, and most of it decides nothing: a fixed schedule commits k of the candidates.

Here every candidate's p(x0) = e^l[x0] / sum_v e^l[v] is first bounded from a table of e^v in
float64 over the 65,536 values a 16-bit float can hold: a gather and a sum per logit, no
exponential. Both it and the published value are within ~3e-11 of the true quotient (each term's
exp within 1 ulp, the subtraction of the maximum exact or negligible, a sum of V positive terms in
any order within (V - 1) * 2^-53 ~ 1.4e-11 at V = 126k), so `REL` = 1e-9 bounds their difference
with a 30x margin. Then only the candidates whose upper bound reaches the row's cut get the
published float64 value (`select._measures`): the cut is the k-th best lower bound (a threshold
row: its top-1's, and the threshold itself). Every other candidate keeps its estimate, below the
cut and so below at least k published values: the committed set is decided by published values
alone, and every committed position reports its published confidence.

float32 logits have no table. Their estimate is torch's softmax taken in float32 (the row's
maximum subtracted, exp, a sum, a division): the subtraction's rounding moves a term by at most
|l - max| * 2^-24 relative (over the row at most V / e times 2^-24 of the sum, which is >= 1),
a sum of V terms in any order is within (V - 1) * 2^-24, each exp within a few ulps. `rel`
bounds the total, ~1.37 V * 2^-24 plus the numerator's own error (its logit within 70 of the
maximum, else not screened), with a margin of more than 2x, which also covers an exp hundreds of
ulps off: 4 (V + 64) * 2^-24, 1e-3 at a 4k vocabulary (measured: under 2e-6; 2.4e-5 at 126k).
That is coarse next to 16-bit's 1e-9, but a step's candidates are usually farther apart than
that, and where they are not, more of them get the published value: never a different commit.

Ties. Where published values tie at the cut, `torch.topk` (the published loops' order,
`select.published_order`) chooses among them by how it walked the whole array, other values
included; such a row (or one with a NaN) gets every candidate's published value, as before.
Exact float64 ties are rare.

Not screened (every candidate's published value, as before): rows asking for provisional picks
(they report every candidate's confidence), other REMASKING measures, the factor rule, the block
families' rule, confidences not in float64, logits in another dtype, a sum out of range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from celeris.engine.sampling.batch import REMASK_CODE, SamplingBatch, SelectionRule

REL = 1e-9  # 16-bit logits: |estimate - published| / published is below ~3e-11 (module docstring)
TABLE_DTYPES = (torch.bfloat16, torch.float16)
SCREEN_DTYPES = (*TABLE_DTYPES, torch.float32)
_TOP32 = 2.0 ** -100  # float32: an estimate below (its logit > ~69 under the maximum) is not screened
_FLOOR = 2.0 ** -850  # a row's sum below this (its maximum below e^-590) is not screened: underflow
_SMALLEST = 1e-290  # estimates below: a numerator or quotient near float64's subnormals, not screened
_CHUNK = 1 << 21  # logits gathered per pass (16 MiB of float64 terms)
_TABLES: dict[torch.dtype, torch.Tensor] = {}


@dataclass(frozen=True)
class Screen:
    """Per row: how many candidates its rule takes by rank this step (a threshold row: 1, its
    top-1), -1 where every candidate's published value is computed; and its threshold (> 0:
    every candidate at or above it commits too). Given as sequences, kept as tensors (made once
    a step)."""

    need: torch.Tensor  # (B,) long
    threshold: torch.Tensor  # (B,) float64

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


def rel(dtype: torch.dtype, V: int) -> float:
    """A bound on |estimate - published| / published for logits of this dtype and vocabulary."""
    return REL if dtype in TABLE_DTYPES else 4 * (V + 64) * 2.0 ** -24


def estimates(rows: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """p(x0) of each logit row (N, V), x0 (N,), within `rel` of the published float64 softmax;
    NaN where it cannot be bounded (a non-finite or out-of-range row)."""
    if rows.dtype == torch.float32:
        return _estimates32(rows, x0)
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


def _estimates32(rows: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """`estimates` of float32 rows: torch's float32 softmax at x0 (NaN throughout a row with a NaN
    or +inf), in passes of few rows. An estimate below _TOP32 is not screened: at or above it the
    numerator e^(l - max) is too (the sum is >= 1), so l is within ~69 of the row's maximum."""
    N, V = rows.shape
    est = torch.empty(N, dtype=torch.float64)
    step = max(1, _CHUNK // max(V, 1))
    for i in range(0, N, step):
        est[i:i + step] = torch.softmax(rows[i:i + step], -1).gather(1, x0[i:i + step, None]).squeeze(1)
    ok = est.isfinite() & (est >= _TOP32)
    return torch.where(ok, est, torch.full_like(est, float("nan")))


def contenders(estimate: torch.Tensor, flat: torch.Tensor, B: int, W: int, screen: Screen,
               bound: float) -> torch.Tensor:
    """(N,) bool over the candidates `flat` (N,) (b * W + w): those that need their published
    value: every candidate of an unscreened row, an estimate that is NaN, and those whose upper
    bound (`bound`: `rel`) reaches the row's cut (the need-th best lower bound, or the threshold
    if lower)."""
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
    commit, its row is not screened or ties at its cut; the estimate elsewhere."""
    B, W, V = logits.shape
    conf = torch.zeros(B * W, dtype=dtype)
    if flat.numel() == 0:
        return conf.view(B, W)
    screened_at = screen.need[flat // W] >= 0
    est = torch.full((flat.numel(),), float("nan"), dtype=torch.float64)
    if bool(screened_at.any()):
        at = flat[screened_at]
        est[screened_at] = estimates(rows_at(logits, at), x0.reshape(-1)[at])
    exact = contenders(est, flat, B, W, screen, rel(logits.dtype, V))
    conf.index_copy_(0, flat, est.to(dtype))
    conf.index_copy_(0, flat[exact], published(flat[exact]))
    known = torch.zeros(B * W, dtype=torch.bool).index_fill_(0, flat[exact], True).view(B, W)
    redo = tied(conf.view(B, W), known, screen)[flat // W] & ~exact
    if bool(redo.any()):
        conf.index_copy_(0, flat[redo], published(flat[redo]))
    return conf.view(B, W)


def rows_at(logits: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """The vocabulary rows (N, V) of (B, W, V) logits at flat (N,) positions b * W + w, copied
    once (index_select copies whole rows; advanced indexing goes element by element)."""
    B, W, V = logits.shape
    try:
        return logits.view(B * W, V).index_select(0, flat)
    except RuntimeError:  # a window sliced out of longer logits (B > 1)
        return logits[flat // W, flat % W]
