"""Pure decoding functions of the masked-diffusion reverse process.

`select_tokens` is one vectorised selection step over a batch of requests with per-row settings
(engine/sampling/batch.py): fixed shapes, no Python loop over rows and no host synchronisation,
so it runs straight after a CUDA graph's replay. Both runners call it; it commits the same
tokens as the readable reference loop (engine/sampling/reference.py) where confidences are not tied, and
`published_order` restores the published loops' own order among ties on the CPU.

Confidences are computed in float64 over the window, as LLaDA's first published generate() and
Fast-dLLM do: a trained model puts many positions at probability 1.0 in float32 (EOS tails),
and float64 keeps them apart. On the CPU only the candidates that can commit get that softmax;
the others are bounded below them (a float32 estimate with a certified error, then for 16-bit
logits a table of exponentials where that cannot decide: engine/sampling/screen.py), which
changes no commit and no reported value. Tie-break rule (batched): among equal confidences the
lower canvas position is committed first (a stable descending sort).

Randomness is counter-based: the uniform number of (seed, step, position, vocab id) is a hash,
so a request draws the same noise alone or inside any batch, on any device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence as Seq

import torch
import torch.nn.functional as F

from celeris.engine.sampling.batch import FACTOR_RULE_CODE, REMASK_CODE, SamplingBatch, Selection, SelectionRule, Window
from celeris.engine.sampling.filters import Filters, filter_logits
from celeris.engine.sampling.noise import gumbel_scores, position_hash, row_scores, sampled_argmax, uniform_noise
from celeris.engine.sampling.screen import SCREEN_DTYPES, Screen, first_argmax, picked, rows_at, screened, screening

NEG_INF = float("-inf")
SPARSE_DRAW = 8  # a sampled step hashes only the live tokens when under 1 in this many are


# ---------------------------------------------------------------- confidence measures

@dataclass(frozen=True)
class Measure:
    """How each row measures a candidate's confidence (its REMASKING rule), at what precision."""

    remask: torch.Tensor  # (B,) each row's REMASK_CODE
    u_random: Optional[torch.Tensor] = None  # (B, W) the "random" rule's draws (None: no row uses it)
    # float64 for LLaDA (its first published generate() and Fast-dLLM); Dream's published code keeps
    # the logits' own dtype, so its family passes that.
    dtype: torch.dtype = torch.float64
    # The REMASKING names some row uses (None: all); the others are not computed (a top-2 and an
    # entropy over the vocabulary cost more than the softmax itself), which changes no row's value.
    names: Optional[frozenset[str]] = None

    @property
    def used(self) -> frozenset[str]:
        return frozenset(REMASK_CODE) if self.names is None else self.names


def confidences(logits: torch.Tensor, x0: torch.Tensor, measure: Measure, where: Optional[torch.Tensor] = None,
                screen: Optional[Screen] = None) -> torch.Tensor:
    """Per-position confidence of the candidate x0 under each row's `measure`. (B, W, V) -> (B, W).

    where (B, W): the positions whose confidence is read (the candidates). On the CPU only those
    are computed, the others are 0: a softmax is per position, so each value is bit for bit the
    one computed over the whole window, and a float64 softmax over the vocabulary (a third of a
    bf16 step at a 126k vocabulary) is paid only where it can change the result. Elsewhere
    (CUDA) every position is computed: fixed shapes, no host synchronisation. Not with the
    entropy measure: torch splits a lone row's sum across threads, which would change its bits.
    screen (with where, CPU, 16-bit or float32 logits; `screen.screening`): of a screened row's candidates
    only those that can commit get the published value, the others an estimate certified below
    every committed one (engine/sampling/screen.py): the same commits, the same reported values.
    """
    m = measure
    if where is not None and logits.device.type == "cpu" and "entropy" not in m.used:
        B, W, V = logits.shape
        flat = where.reshape(-1).nonzero().squeeze(-1)  # (N,) candidate positions (a host read: CPU only)
        if screen is not None and logits.dtype in SCREEN_DTYPES:
            return screened(logits, x0, flat, screen, m.dtype, lambda at: _measures_at(logits, x0, m, at))
        if flat.numel() < B * W:
            sub = _measures_at(logits, x0, m, flat)
            return sub.new_zeros(B * W).index_copy_(0, flat, sub).view(B, W)
    return _measures(logits, x0, m.remask[:, None], m.u_random, m.dtype, m.used)  # code (B, 1)


def _measures_at(logits: torch.Tensor, x0: torch.Tensor, m: Measure, flat: torch.Tensor) -> torch.Tensor:
    """`_measures` at the positions flat (N,) (b * W + w) of (B, W, V) logits -> (N,)."""
    W = logits.shape[1]
    u = None if m.u_random is None else m.u_random.reshape(-1)[flat][None]
    return _measures(rows_at(logits, flat)[None], x0.reshape(-1)[flat][None], m.remask[flat // W][None], u,
                     m.dtype, m.used)[0]


def _measures(logits: torch.Tensor, x0: torch.Tensor, code: torch.Tensor, u_random: Optional[torch.Tensor],
              dtype: torch.dtype, used: frozenset[str]) -> torch.Tensor:
    """`confidences` over (B, W, V) logits; code: each position's REMASK_CODE, broadcast to (B, W)."""
    p = F.softmax(logits.to(dtype), dim=-1)
    conf = torch.gather(p, -1, x0[..., None]).squeeze(-1)  # LLaDA low_confidence, Dream maskgit_plus
    if "margin" in used:  # Dream topk_margin
        top2 = torch.topk(p, 2, dim=-1).values
        conf = torch.where(code == REMASK_CODE["margin"], top2[..., 0] - top2[..., 1], conf)
    if "entropy" in used:  # Dream entropy, with its epsilon
        conf = torch.where(code == REMASK_CODE["entropy"], (p * torch.log(p + 1e-10)).sum(-1), conf)
    if u_random is not None:
        conf = torch.where(code == REMASK_CODE["random"], u_random.to(dtype), conf)
    return conf


# ---------------------------------------------------------------- batched selection

def select_tokens(logits: torch.Tensor, batch: SamplingBatch, window: Window, rule: SelectionRule) -> Selection:
    """One denoising selection over a window of each row (usually its current block).

    logits (B, W, V) of the window's positions. Penalties (`penalize`) shift the logits that pick
    the token and rank it; top-k / top-p (`filter_logits`) narrow only which token is drawn, its
    confidence is read from the whole distribution (as SDAR's evaluation sampler does), so
    top_k=1 does not make every confidence 1.0; a rule with `conf_after_filter` (Dream's
    sample_tokens) reads it from the filtered one. `min_tokens` bans a row's stop ids at positions
    before it. The mask id is never a candidate token (a random or undertrained model may rank it
    first; published loops would commit it and keep the position masked, or loop forever under a
    threshold). Fixed shapes, no host synchronisation: this can run after a CUDA graph replay.
    """
    B, W, V = logits.shape
    if window.allowed is not None:  # structured outputs: before everything that reads the logits
        # in place (only N rows written) unless a row's logprobs will read the model's own logits
        logits = constrain(logits, window.allowed.flat, window.allowed.tokens, inplace=batch.top_logprobs < 0)
    if batch.frequency is not None:
        logits = penalize(logits, window.canvas, window.response_from,
                          Penalties(batch.frequency, batch.presence, batch.stop_ids), rule.mask_id)
    pick = logits if batch.top_k is None else _filtered(logits, batch, window)
    if batch.sampling and logits.device.type == "cpu" and batch.editing is None and batch.min_tokens is None:
        scores = None  # drawn at the candidates only, from the tokens each can draw (sampled_argmax)
        x0 = _drawn(pick, batch, window, rule.mask_id)
    elif batch.sampling:
        scores = gumbel_scores(pick, batch.temperature, uniform_noise(batch.seed, batch.step, window.noise_pos, V, 0))
    elif rule.x0_from_probs:
        scores = F.softmax(pick, dim=-1)  # ties of the rounded probabilities: first wins
    elif logits.device.type == "cpu":
        scores = pick  # read only: `_argmax_but` copies the rows it must change
    else:
        scores = pick.clone()  # (no host tensor here: this may run on a graph's output)
    if batch.min_tokens is not None:
        vocab = torch.zeros(B, V + 1, dtype=torch.bool, device=logits.device).scatter_(1, batch.stop_ids, True)[:, :V]
        early = window.canvas_pos < batch.min_tokens[:, None]  # (B, W)
        scores = scores.masked_fill(early[..., None] & vocab[:, None, :], NEG_INF)
    # Edits read the confidence of written positions too, so only a row set without editing limits
    # the float64 softmax to the candidates (and screens them: engine/sampling/screen.py).
    conf_logits, dtype = pick if rule.conf_after_filter else logits, rule.conf_dtype or logits.dtype
    where = window.candidate if batch.editing is None else None
    screen = screening(batch, rule, conf_logits.dtype, dtype) if where is not None and logits.device.type == "cpu" \
        else None
    # LLaDA2.1's edits take the model's pick as it is: an edit to the mask token re-opens a position.
    free = first_argmax(scores) if batch.editing is not None else None
    if screen is not None and scores is logits and pick is logits and conf_logits is logits:
        # a greedy screened step: the candidates' picks and estimates from one copy of their rows;
        # other positions keep their token (never read: only candidates commit or are provisional)
        flat = where.reshape(-1).nonzero().squeeze(-1)  # (N,) b * W + w
        picks, est, bound = picked(logits, flat, rule.mask_id)
        x0 = window.tokens.reshape(-1).index_copy(0, flat, picks).view(B, W)
        screen = replace(screen, estimated=(est, bound))
    elif scores is not None:  # committing the mask token would leave the position masked forever
        x0 = _argmax_but(scores, rule.mask_id, free, in_place=scores is not pick)  # (B, W)
    u_random = uniform_noise(batch.seed, batch.step, window.noise_pos, None, 1) if batch.any_random else None
    conf = confidences(conf_logits, x0, Measure(batch.remask, u_random, dtype, batch.measures), where, screen)
    # A NaN confidence (overflowing guidance, a broken checkpoint) ranks below every real one but
    # above non-candidates, and every rule commits at least one candidate per step, so a request
    # always ends.
    conf = torch.where(conf.isnan(), torch.full_like(conf, torch.finfo(conf.dtype).min), conf)
    edit_conf = None
    if free is not None:  # the free pick's confidence: a second softmax only where it is the mask token
        dtype = rule.conf_dtype or logits.dtype
        p_free = torch.gather(F.softmax(logits.to(dtype), dim=-1), -1, free[..., None]).squeeze(-1)
        edit_conf = torch.where(free == x0, conf, p_free)
    conf = torch.where(window.candidate, conf, torch.full_like(conf, NEG_INF))
    commit, n_commit = _commit(conf, window.candidate, batch, rule.block_threshold)
    return Selection(x0, commit, conf, n_commit, free, edit_conf)


def _drawn(pick: torch.Tensor, batch: SamplingBatch, window: Window, mask_id: int) -> torch.Tensor:
    """x0 (B, W) of a sampling step on the CPU: each candidate's Gumbel-max draw, the mask id
    excluded, hashing noise only for the tokens it can draw; other positions keep their token
    (never read: only candidates commit or are shown as provisional)."""
    B, W, V = pick.shape
    flat = window.candidate.reshape(-1).nonzero().squeeze(1)  # (N,) b * W + w
    h = position_hash(batch.seed, batch.step, window.noise_pos, 0).reshape(-1)[flat]
    rows, temperature = pick.reshape(B * W, V)[flat], batch.temperature[flat // W]  # (N, V), (N,)
    live = rows != NEG_INF  # NaN is live: it wins, as it does in the dense argmax
    live[:, mask_id] = False
    if int(live.sum()) * SPARSE_DRAW < live.numel():  # filtered rows: the few tokens left
        drawn = sampled_argmax(rows, h, temperature, live)
    else:  # most tokens can win: the candidates' whole rows
        scores = row_scores(rows, h, temperature)
        scores[:, mask_id] = NEG_INF
        drawn = first_argmax(scores)
    return window.tokens.reshape(-1).index_copy(0, flat, drawn).view(B, W)


def _filtered(logits: torch.Tensor, batch: SamplingBatch, window: Window) -> torch.Tensor:
    """`filter_logits` of the window; on the CPU, of its candidate positions only (a nucleus or a
    top-k sorts a vocabulary-sized row): the pick at any other position is never read, unless the
    row set edits (LLaDA2.1 reads every position's pick). Elsewhere the others keep their logits."""
    knobs = Filters(batch.top_k, batch.top_p, batch.min_p, batch.temperature)
    if logits.device.type != "cpu" or batch.editing is not None:
        return filter_logits(logits, knobs, batch.nucleus, batch.top_k_max)
    B, W, V = logits.shape
    flat = window.candidate.reshape(-1).nonzero().squeeze(1)  # (N,) b * W + w
    rows = filter_logits(logits.reshape(B * W, 1, V)[flat], knobs.at(flat // W), batch.nucleus,
                         batch.top_k_max)  # (N, 1, V): one position a row, its request's knobs
    return logits.reshape(B * W, V).index_copy(0, flat, rows.view(-1, V)).view(B, W, V)


def _argmax_but(scores: torch.Tensor, banned: int, first: Optional[torch.Tensor], in_place: bool) -> torch.Tensor:
    """`first_argmax` of scores (B, W, V) with id `banned` at -inf; first: its argmax if known.

    in_place (scores is selection's own tensor): the column is written, fixed shapes, no host
    read. Otherwise (CPU, scores are the caller's logits) nothing is written: the argmax of the
    scores as they are is the answer wherever it is not `banned` (the first maximum, or first
    NaN, does not move when another id drops to -inf), and only the positions where it is are
    recomputed, from a copy of their rows."""
    if in_place:
        scores[..., banned] = NEG_INF
        return first_argmax(scores)
    x0 = first_argmax(scores) if first is None else first.clone()
    hit = (x0 == banned).reshape(-1).nonzero().squeeze(-1)  # (n,) a host read: CPU only
    if hit.numel():
        rows = rows_at(scores, hit)
        rows[:, banned] = NEG_INF
        x0.view(-1).index_copy_(0, hit, first_argmax(rows))
    return x0


def with_edits(sel: Selection, tokens: torch.Tensor, editable: torch.Tensor, editing: torch.Tensor) -> Selection:
    """LLaDA2.1's token editing on top of a step's selection, from the same forward: every
    editable position (written earlier, not the prompt; (B, W)) whose pick differs from its token
    and whose confidence is strictly above the row's editing threshold (B,) (compared in the
    confidences' dtype, as the published code compares its tensor with a Python float) takes the
    pick. The pick is the model's own (`Selection.edit_x0`): as published, an edit may write the
    mask token back, and the position is filled again like any mask."""
    thr = editing.to(sel.edit_conf.dtype)[:, None]
    edit = editable & (sel.edit_conf > thr) & (sel.edit_x0 != tokens)
    return replace(sel, x0=torch.where(edit, sel.edit_x0, sel.x0), commit=sel.commit | edit,
                   conf=torch.where(edit, sel.edit_conf, sel.conf))


def constrain(logits: torch.Tensor, flat: torch.Tensor, allowed: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """logits (B, W, V) with -inf outside each constrained position's allowed tokens: flat (N,)
    indexes the B * W positions, allowed (N, V). Only those N rows of the vocabulary are touched;
    `inplace` writes them into `logits` itself (a copy of the whole (B, W, V) costs more than the
    masks at a large vocabulary), else into a copy."""
    B, W, V = logits.shape
    out = logits.view(B * W, V) if inplace and logits.is_contiguous() else logits.reshape(B * W, V).clone()
    out[flat] = out[flat].masked_fill(~allowed, NEG_INF)
    return out.view(B, W, V)


def _commit(conf: torch.Tensor, candidate: torch.Tensor, batch: SamplingBatch, block_threshold: bool
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Which candidates each row commits under its rule -> (commit (B, W), count (B,)); conf
    (B, W) is -inf outside the candidates.

    Fixed schedule: the top k. Threshold (Fast-dLLM): the top-1 plus every candidate at or
    above it, compared in the confidences' dtype as the published code compares its tensor with
    a Python float; the block families' rule instead (see SelectionRule). Factor: `_factor_count`.
    """
    B, W = conf.shape
    # Rank candidates by confidence; a stable sort breaks ties towards lower positions.
    sorted_conf, order = torch.sort(conf, dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order).scatter_(1, order, torch.arange(W, device=order.device).expand(B, W))
    n_cand = candidate.sum(-1)  # (B,)
    thr = batch.threshold.to(conf.dtype)[:, None]
    if block_threshold:
        n_thr = torch.maximum((sorted_conf > thr).sum(-1), batch.k).clamp_min(1)
    else:
        n_thr = (sorted_conf >= thr).sum(-1).clamp_min(1)
    n_commit = batch.k
    if batch.any_factor:
        n_factor = _factor_count(sorted_conf, batch.factor, n_cand, batch.factor_rule)
        n_commit = torch.where(batch.factor > 0, n_factor, n_commit)
    n_commit = torch.where(batch.threshold > 0, n_thr, n_commit)
    n_commit = torch.minimum(n_commit, n_cand)
    return (ranks < n_commit[:, None]) & candidate, n_commit


@dataclass(frozen=True)
class Penalties:
    """Each row's OpenAI penalties, and the ids they never count."""

    frequency: torch.Tensor  # (B,)
    presence: torch.Tensor  # (B,)
    exclude: torch.Tensor  # (B, S) padded with V: the row's stop tokens (a finished block's EOS padding is not text)


def penalize(logits: torch.Tensor, canvas: torch.Tensor, response_from: torch.Tensor, penalties: Penalties,
             mask_id: int) -> torch.Tensor:
    """OpenAI's frequency and presence penalties on a diffusion canvas.

    logits (B, W, V) of the positions being decoded; canvas (B, L) each row's ids, its response
    starting at column response_from (B,). Every committed response token counts, in whatever order
    the reverse process committed it: logits[v] -= frequency * count(v) + presence * (count(v) > 0).
    """
    frequency, presence, exclude = penalties.frequency, penalties.presence, penalties.exclude
    B, L = canvas.shape
    V = logits.shape[-1]
    counted = (torch.arange(L, device=canvas.device)[None, :] >= response_from[:, None]) & (canvas != mask_id)
    ids = torch.where(counted, canvas.clamp(0, V), torch.full_like(canvas, V))
    counts = torch.zeros(B, V + 1, dtype=torch.float32, device=canvas.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    counts.scatter_(1, exclude, 0.0)
    counts = counts[:, :V]
    penalty = frequency[:, None].float() * counts + presence[:, None].float() * (counts > 0)
    return logits - penalty[:, None, :].to(logits.dtype)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int
                   ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """log p(token) under the model's distribution at this step (raw logits: no temperature or
    filtering), float32, and the `top` most likely alternatives. (B, W, V), (B, W) ->
    (B, W), (B, W, top) values and ids (None when top == 0)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    chosen = torch.gather(logp, -1, tokens[..., None]).squeeze(-1)
    if top <= 0:
        return chosen, None, None
    values, ids = logp.topk(top, dim=-1)
    return chosen, values, ids


def topk_commit(conf: torch.Tensor, candidate: torch.Tensor, n_commit: Seq[int], threshold: Seq[float],
                spans: Seq[tuple[int, int]], stable: torch.Tensor) -> torch.Tensor:
    """The committed positions as the published loops choose them: `torch.topk` over the very
    array they rank (-inf but for the candidates), whose order among tied confidences is its own.

    conf, candidate (B, W) over each row's window; n_commit (B,) from `select_tokens` (counts do
    not depend on ties); threshold (B,) > 0 for threshold rows, whose published top-1 is the
    first of topk over every candidate; spans (B,) of (array length, window offset in it).
    A row whose candidates are all -inf (NaN confidences) keeps `stable`, the sort's choice, so
    that it still commits. Host-side, one small topk per row: the eager path; CUDA graphs keep
    the stable order.
    """
    B, W = conf.shape
    commit = torch.zeros_like(candidate)
    n_cand = candidate.sum(-1).tolist()
    for r in range(B):
        length, off = spans[r]
        if n_commit[r] <= 0 or length <= 0:
            continue
        width = min(W, length - off)
        arr = conf.new_full((length,), NEG_INF)
        arr[off:off + width] = conf[r, :width]
        if threshold[r] > 0:
            picked = torch.topk(arr, int(n_cand[r])).indices[:1] - off
            row = candidate[r] & (conf[r] >= torch.tensor(threshold[r], dtype=conf.dtype))
        else:
            picked = torch.topk(arr, int(n_commit[r])).indices - off
            row = torch.zeros(W, dtype=torch.bool, device=conf.device)
        row[picked[(picked >= 0) & (picked < width)]] = True  # -inf ties may fall outside the window
        row &= candidate[r]
        commit[r] = row if int(row.sum()) >= min(n_commit[r], int(n_cand[r])) else stable[r]
    return commit


def published_order(sel: Selection, candidate: torch.Tensor, batch: SamplingBatch, rule: SelectionRule,
                    spans: Seq[tuple[int, int]]) -> Selection:
    """`sel` with the commits the published loops make among tied confidences (`topk_commit`);
    spans (B,) of (length of the array they rank, the window's offset in it)."""
    B = candidate.shape[0]
    thresholds = (0.0,) * B if rule.block_threshold else batch.thresholds + (0.0,) * (B - batch.rows)
    commit = topk_commit(sel.conf, candidate, sel.n_commit.tolist(), thresholds, spans, sel.commit)
    return replace(sel, commit=commit)


def _factor_count(sorted_conf: torch.Tensor, factor: torch.Tensor, n_cand: torch.Tensor,
                  rule: Optional[torch.Tensor]) -> torch.Tensor:
    """How many of the descending confidences (B, W) the factor rule commits, per row.

    Fast-dLLM's published `get_transfer_index_dynamic` keeps the leading run of c_n >=
    1 - f/(n+1) (n >= 2; the top-1 always) in float64, and when only the last candidate fails
    it commits that one too; its accuracy figures come from that code, so it is the default.
    The paper's rule is the largest n with (n+1)(1 - c_n) < f, at least one.
    """
    f = factor.double()[:, None]
    n = torch.arange(1, sorted_conf.shape[1] + 1, device=sorted_conf.device, dtype=torch.float64)
    real = sorted_conf > NEG_INF
    passes = ((sorted_conf >= 1 - f / (n + 1)) | (n == 1)) & real  # c decreasing, bound rising: a prefix
    n_pass = passes.sum(-1)
    fast_dllm = torch.where(n_pass == n_cand - 1, n_cand, n_pass).clamp_min(1)
    ok = ((n + 1) * (1 - sorted_conf) < f) & real
    paper = torch.where(ok, n, torch.zeros_like(n)).amax(-1).long().clamp_min(1)
    if rule is None:
        return fast_dllm
    return torch.where(rule == FACTOR_RULE_CODE["paper"], paper, fast_dllm)
