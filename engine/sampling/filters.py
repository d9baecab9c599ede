"""Top-k / top-p (nucleus) / min-p filtering of a batch's logits, with per-row settings.

The nucleus rule: rank a row's tokens by logit, highest first, ties by lower token id; give each
its probability (one float32 softmax over the row, so a token's probability does not depend on
the order it is ranked in); keep a token while the mass ranked before it, `cumsum - p`, is at
most top_p. The top token is always kept.

On a GPU that is one stable sort of every row (fixed shapes, no host synchronisation). On the
CPU a full sort of a 126k-152k vocabulary costs tens of milliseconds a row, and a nucleus is
usually a few dozen tokens: `_nucleus_prefix` ranks only a prefix (the top m by `topk`, grown
while some row's mass has not passed top_p), and falls back to the full sort for a row whose
nucleus is most of its vocabulary. Both keep exactly the same tokens: the prefix is the full
ranking's first ranks (ties at its last value cut off, never guessed), and a CPU cumsum is
sequential, so its prefix is the full cumsum's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")
PREFIX = 64  # first prefix ranked on the CPU, grown GROWTH-fold while a row's nucleus runs past it
GROWTH = 8
FULL_SORT_FRACTION = 4  # a prefix past V / this: rank the whole row
MARGIN = 1e-6  # a cumsum this far past top_p: no later rank can be kept (rounding is ~1.2e-7)


@dataclass(frozen=True)
class Filters:
    """Each row's filtering knobs, (B,) tensors."""

    top_k: torch.Tensor  # int, 0 = off: keep logits >= the k-th largest (its ties too)
    top_p: torch.Tensor  # float, 1 = off: the nucleus rule (module docstring)
    # float, 0 = off: keep a token whose probability at the row's temperature is at least min_p times
    # the top token's (vLLM's rule), i.e. logit >= top logit + temperature * log(min_p)
    min_p: torch.Tensor
    temperature: torch.Tensor

    def at(self, rows: torch.Tensor) -> Filters:
        """The knobs of `rows` (N,) row indices (one position a row)."""
        return Filters(self.top_k[rows], self.top_p[rows], self.min_p[rows], self.temperature[rows])


def filter_logits(logits: torch.Tensor, knobs: Filters, nucleus: bool = True,
                  top_k_max: Optional[int] = None) -> torch.Tensor:
    """Per-row top-k / top-p (nucleus) / min-p filtering of logits (B, W, V), -inf outside.

    nucleus / top_k_max (host facts of the batch): whether any row has top_p < 1; the largest top_k
    (None: read from top_k, a host synchronisation).
    """
    top_k, top_p, min_p, temperature = knobs.top_k, knobs.top_p, knobs.min_p, knobs.temperature
    V = logits.shape[-1]
    if top_k_max is None:
        top_k_max = int(top_k.max()) if top_k.numel() else 0
    # On the CPU a rule no row uses is skipped (each is a pass over a vocabulary-sized row);
    # elsewhere every rule runs, no host read.
    cpu = logits.device.type == "cpu"
    with_k, with_min_p = not cpu or top_k_max > 0, not cpu or bool((min_p > 0).any())
    keep = nucleus_keep(logits, top_p) if nucleus else None
    if with_k or with_min_p:
        top = torch.topk(logits, min(max(top_k_max, 1), V), dim=-1).values  # (B, W, k) descending
    if with_k:
        k = torch.where(top_k > 0, top_k.clamp(max=top.shape[-1]), torch.ones_like(top_k))
        kth = torch.gather(top, -1, (k - 1)[:, None, None].expand(*logits.shape[:2], 1))  # (B, W, 1)
        keep = _both(keep, (logits >= kth) | (top_k <= 0)[:, None, None])
    if with_min_p:
        floor = (temperature * torch.log(min_p)).to(logits.dtype)[:, None, None]  # -inf where min_p = 0
        keep = _both(keep, (logits - top[..., :1] >= floor) | (min_p <= 0)[:, None, None])
    return logits.clone() if keep is None else logits.masked_fill(~keep, NEG_INF)


def _both(keep, more: torch.Tensor) -> torch.Tensor:
    return more if keep is None else keep.logical_and_(more)


def nucleus_keep(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """(B, W, V) bool: the tokens each row's nucleus keeps (all of them where top_p >= 1)."""
    B, W, V = logits.shape
    flat = logits.reshape(B * W, V)
    p = top_p.to(torch.float32).repeat_interleave(W)  # (B * W,)
    if logits.device.type == "cpu":
        return _nucleus_prefix(flat, p).view(B, W, V)
    order = torch.sort(flat, dim=-1, descending=True, stable=True).indices
    return _keep_ranked(flat, order, p).view(B, W, V)


def _keep_ranked(
    rows: torch.Tensor, order: torch.Tensor, p: torch.Tensor, every: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows (N, V) whose ranking starts `order` (N, m): keep each ranked token while the mass
    before it is <= p (N,); unranked tokens are not kept (callers rank far enough). `every`: the
    rows' softmax where the caller already has it."""
    if every is None:
        every = F.softmax(rows.float(), dim=-1)
    probs = every.gather(-1, order)  # (N, m) in rank order
    before = probs.cumsum(-1) - probs
    keep = (before <= p[:, None]) | (p >= 1)[:, None]
    return torch.zeros(rows.shape, dtype=torch.bool, device=rows.device).scatter_(-1, order, keep)


def _ranked_prefix(rows: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ranks of each row (N, V), exactly as a stable descending sort gives them, padded:
    (order (N, m) token ids, n (N,) how many of them are certain). topk's m-th value may be tied
    with tokens it left out, so ranks at that value are not certain and are dropped."""
    vals, idx = torch.topk(rows, m, dim=-1)  # descending; tie order unspecified
    by_id = idx.sort(-1).indices  # ties by lower token id: order by id, then stably by value
    idx, vals = idx.gather(-1, by_id), vals.gather(-1, by_id)
    rank = vals.sort(dim=-1, descending=True, stable=True).indices
    order, vals = idx.gather(-1, rank), vals.gather(-1, rank)
    return order, (vals > vals[:, -1:]).sum(-1)  # certain: strictly above the m-th value


def _nucleus_prefix(rows: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`_keep_ranked` over the full ranking, computed from ranked prefixes (module docstring).
    rows (N, V), p (N,) -> (N, V) bool"""
    V = rows.shape[-1]
    keep = torch.ones(rows.shape, dtype=torch.bool)
    todo = (p < 1).nonzero().squeeze(1)  # rows still undecided
    every = F.softmax(rows[todo].float(), dim=-1)  # (T, V) each token's probability, as _keep_ranked's
    m = PREFIX
    while todo.numel():
        flat = torch.full_like(todo, m * FULL_SORT_FRACTION >= V, dtype=torch.bool)
        if not bool(flat.all()):
            order, n = _ranked_prefix(rows[todo], m)
            probs = every.gather(-1, order)  # (T, m) in rank order
            mass = probs.cumsum(-1)
            last = mass.gather(-1, (n - 1).clamp_min(0)[:, None]).squeeze(1)  # mass through the certain ranks
            q = p[todo]
            done = (n > 0) & (last > q + MARGIN)  # every later rank has more than q before it
            if bool(done.any()):
                certain = torch.arange(m)[None, :] < n[done][:, None]
                kept = (mass[done] - probs[done] <= q[done][:, None]) & certain
                keep[todo[done]] = torch.zeros(int(done.sum()), V, dtype=torch.bool).scatter_(-1, order[done], kept)
            # the prefix a row seems to need, were its tail as heavy as its head: past V / 4, sort it whole
            guess = 2 * m * q / last.clamp_min(1e-30)
            flat = ~done & (guess * FULL_SORT_FRACTION >= V)
            m = max(m * GROWTH, int(guess[~done & ~flat].max()) if bool((~done & ~flat).any()) else 0)
            todo, every, flat = todo[~done], every[~done], flat[~done]
        if bool(flat.any()):  # most of the row: one stable sort
            whole = todo[flat]
            order = torch.sort(rows[whole], dim=-1, descending=True, stable=True).indices
            keep[whole] = _keep_ranked(rows[whole], order, p[whole], every[flat])
            todo, every = todo[~flat], every[~flat]
    return keep
