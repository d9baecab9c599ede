"""Pure decoding functions of the masked-diffusion reverse process.

`select_tokens` is one vectorised selection step over a batch of requests with per-row settings
(engine/sampling_batch.py): fixed shapes, no Python loop over rows and no host synchronisation,
so it runs straight after a CUDA graph's replay. Both runners call it; it commits the same
tokens as the readable reference loop (engine/reference.py) where confidences are not tied, and
`published_order` restores the published loops' own order among ties on the CPU.

Confidences are computed in float64 over the window, as LLaDA's first published generate() and
Fast-dLLM do: a trained model puts many positions at probability 1.0 in float32 (EOS tails),
and float64 keeps them apart. Tie-break rule (batched): among equal confidences the lower canvas
position is committed first (a stable descending sort).

Randomness is counter-based: the uniform number of (seed, step, position, vocab id) is a hash,
so a request draws the same noise alone or inside any batch, on any device.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import replace
from typing import Optional, Sequence as Seq

import torch
import torch.nn.functional as F

from celeris.engine.sampling_batch import FACTOR_RULE_CODE, REMASK_CODE, SamplingBatch, Selection, SelectionRule, Window

NEG_INF = float("-inf")
_M32 = 0xFFFFFFFF


def transfer_schedule(n_masked: int, steps: int) -> list[int]:
    """Tokens to commit at each of `steps` steps: n//S each, plus one in the first n%S steps."""
    base, rem = divmod(n_masked, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


def _f32(x: float) -> float:
    """Round a double to float32. One IEEE op on float32 inputs computed in double and rounded
    once gives exactly the float32 result, so this reproduces torch's float32 scalar maths."""
    return struct.unpack("f", struct.pack("f", x))[0]


@functools.lru_cache(maxsize=256)
def _dream_timesteps(steps: int, eps: float) -> tuple[float, ...]:
    return tuple(torch.linspace(1, eps, steps + 1, dtype=torch.float32).tolist())


def dream_transfer_count(n_masked: int, step: int, steps: int, eps: float) -> int:
    """Dream's `diffusion_generate` schedule: at step i of S, with t, s = timesteps[i], [i+1]
    of linspace(1, eps, S+1), commit int(n * (1 - s/t)) of the n still-masked positions, and
    every remaining one at the last step. float32 throughout, as Dream computes it."""
    if step >= steps - 1:
        return n_masked
    ts = _dream_timesteps(steps, eps)
    ratio = _f32(1.0 - _f32(ts[step + 1] / ts[step]))
    return int(_f32(float(n_masked) * ratio))


# ---------------------------------------------------------------- counter-based randomness

def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xorshift-multiply); int64 holds the uint32, constants < 2^31
    keep every product below 2^63 so nothing overflows."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _M32
    return x ^ (x >> 16)


def uniform_noise(seed: torch.Tensor, step: torch.Tensor, pos: torch.Tensor, vocab: Optional[int], stream: int) -> torch.Tensor:
    """U(0,1) in float64 with 48 random bits, a pure function of its integer coordinates.

    seed, step: (B,) int64; pos: (B, W) int64. Returns (B, W, vocab), or (B, W) if vocab is None.
    """
    s = _mix32((seed ^ (seed >> 32)) & _M32) ^ stream
    h = _mix32(_mix32(s[:, None] ^ (step & _M32)[:, None]) ^ (pos & _M32))  # (B, W)
    if vocab is not None:
        v = torch.arange(vocab, device=pos.device, dtype=torch.int64)
        h = _mix32(h[..., None] ^ v)  # (B, W, V)
    hi, lo = h >> 8, _mix32(h ^ 0x2545F491) >> 8  # two 24-bit halves
    return (hi.double() * 2.0**24 + lo.double() + 0.5) / 2.0**48


def gumbel_scores(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """log of LLaDA's exp(logits) / (-log U)^T, in float64: the same argmax without overflow."""
    return logits.double() - temperature.double()[:, None, None] * torch.log(-torch.log(u))


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per-row top-k / top-p (nucleus) filtering, -inf outside, with Dream's tie and mass rules.

    logits (B, W, V); top_k (B,) int, 0 = off: keep logits >= the k-th largest (its ties too);
    top_p (B,) float, 1 = off: keep a token while the probability mass before it is <= top_p.
    """
    V = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
    kth = torch.gather(sorted_logits, -1, (k - 1)[:, None, None].expand(*logits.shape[:2], 1))  # (B, W, 1)
    probs = F.softmax(sorted_logits.float(), dim=-1)
    before = probs.cumsum(-1) - probs  # mass of the tokens ranked above each one
    keep_sorted = (before <= top_p.to(probs.dtype)[:, None, None]) | (top_p >= 1)[:, None, None]
    keep = torch.empty_like(keep_sorted).scatter_(-1, order, keep_sorted) & (logits >= kth)
    return logits.masked_fill(~keep, NEG_INF)


# ---------------------------------------------------------------- confidence measures

def confidences(logits: torch.Tensor, x0: torch.Tensor, remask: torch.Tensor, u_random: Optional[torch.Tensor],
                dtype: torch.dtype = torch.float64, measures: Optional[frozenset[str]] = None) -> torch.Tensor:
    """Per-position confidence of the candidate x0 under each row's measure. (B, W, V) -> (B, W).

    dtype: float64 for LLaDA (its first published generate() and Fast-dLLM); Dream's published
    code keeps the logits' own dtype, so its family passes that. measures: the REMASKING names
    some row uses (None: all); the others are not computed (a top-2 and an entropy over the
    vocabulary cost more than the softmax itself), which changes no row's value.
    """
    used = frozenset(REMASK_CODE) if measures is None else measures
    p = F.softmax(logits.to(dtype), dim=-1)
    conf = torch.gather(p, -1, x0[..., None]).squeeze(-1)  # LLaDA low_confidence, Dream maskgit_plus
    code = remask[:, None]
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
    top_k=1 does not make every confidence 1.0. `min_tokens` bans a row's stop ids at positions
    before it. The mask id is never a candidate token (a random or undertrained model may rank it
    first; published loops would commit it and keep the position masked, or loop forever under a
    threshold). Fixed shapes, no host synchronisation: this can run after a CUDA graph replay.
    """
    B, W, V = logits.shape
    if window.allowed is not None:  # structured outputs: before everything that reads the logits
        logits = constrain(logits, window.allowed.flat, window.allowed.tokens)
    if batch.frequency is not None:
        logits = penalize(logits, window.canvas, window.response_from, batch.frequency, batch.presence,
                          batch.stop_ids, rule.mask_id)
    pick = logits if batch.top_k is None else filter_logits(logits, batch.top_k, batch.top_p)
    if batch.sampling:
        scores = gumbel_scores(pick, batch.temperature, uniform_noise(batch.seed, batch.step, window.noise_pos, V, 0))
    elif rule.x0_from_probs:
        scores = F.softmax(pick, dim=-1)  # ties of the rounded probabilities: first wins
    else:
        scores = pick.clone()  # (no host tensor here: this may run on a graph's output)
    scores[..., rule.mask_id] = NEG_INF  # committing the mask token would leave the position masked forever
    if batch.min_tokens is not None:
        vocab = torch.zeros(B, V + 1, dtype=torch.bool, device=logits.device).scatter_(1, batch.stop_ids, True)[:, :V]
        early = window.canvas_pos < batch.min_tokens[:, None]  # (B, W)
        scores = scores.masked_fill(early[..., None] & vocab[:, None, :], NEG_INF)
    x0 = scores.argmax(-1)  # (B, W)
    u_random = uniform_noise(batch.seed, batch.step, window.noise_pos, None, 1) if batch.any_random else None
    conf = confidences(logits, x0, batch.remask, u_random, rule.conf_dtype or logits.dtype, batch.measures)
    # A NaN confidence (overflowing guidance, a broken checkpoint) ranks below every real one but
    # above non-candidates, and every rule commits at least one candidate per step, so a request
    # always ends.
    conf = torch.where(conf.isnan(), torch.full_like(conf, torch.finfo(conf.dtype).min), conf)
    conf = torch.where(window.candidate, conf, torch.full_like(conf, NEG_INF))
    commit, n_commit = _commit(conf, window.candidate, batch, rule.block_threshold)
    return Selection(x0, commit, conf, n_commit)


def constrain(logits: torch.Tensor, flat: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits (B, W, V) with -inf outside each constrained position's allowed tokens: flat (N,)
    indexes the B * W positions, allowed (N, V). Only those N rows of the vocabulary are touched."""
    B, W, V = logits.shape
    out = logits.reshape(B * W, V).clone()
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
    n_factor = _factor_count(sorted_conf, batch.factor, n_cand, batch.factor_rule)
    n_commit = torch.where(batch.threshold > 0, n_thr, torch.where(batch.factor > 0, n_factor, batch.k))
    n_commit = torch.minimum(n_commit, n_cand)
    return (ranks < n_commit[:, None]) & candidate, n_commit


def penalize(logits: torch.Tensor, canvas: torch.Tensor, response_from: torch.Tensor, frequency: torch.Tensor,
             presence: torch.Tensor, exclude: torch.Tensor, mask_id: int) -> torch.Tensor:
    """OpenAI's frequency and presence penalties on a diffusion canvas.

    logits (B, W, V) of the positions being decoded; canvas (B, L) each row's ids, its response
    starting at column response_from (B,); frequency, presence (B,); exclude (B, S) ids never
    counted, padded with V (the row's stop tokens: a finished block's EOS padding is not text).
    Every committed response token counts, in whatever order the reverse process committed it:
    logits[v] -= frequency * count(v) + presence * (count(v) > 0).
    """
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
