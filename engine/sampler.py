"""Pure decoding functions of the masked-diffusion reverse process.

Two paths over the same model:
- `reference_generate`: LLaDA's `generate()` written out in one screen. Readable and exact; the
  tests hold it to an independent implementation of the published algorithm.
- `select_tokens`: one vectorised selection step over a batch of requests with per-row settings,
  fixed shapes, no Python loop over rows and no host synchronisation, so it can be captured in a
  CUDA graph. The runner calls it; it commits the same tokens as the reference where
  confidences are not tied.

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
from typing import Callable, Optional, Sequence
from typing import Sequence as Seq

import torch
import torch.nn.functional as F

from engine.params import FACTOR_RULES, REMASKING, SamplingParams

NEG_INF = float("-inf")
REMASK_CODE = {name: i for i, name in enumerate(REMASKING)}
FACTOR_RULE_CODE = {name: i for i, name in enumerate(FACTOR_RULES)}
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
                dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Per-position confidence of the candidate x0 under each row's measure. (B, W, V) -> (B, W).

    dtype: float64 for LLaDA (its first published generate() and Fast-dLLM); Dream's published
    code keeps the logits' own dtype, so its family passes that.
    """
    p = F.softmax(logits.to(dtype), dim=-1)
    prob = torch.gather(p, -1, x0[..., None]).squeeze(-1)  # LLaDA low_confidence, Dream maskgit_plus
    top2 = torch.topk(p, 2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]  # Dream topk_margin
    neg_entropy = (p * torch.log(p + 1e-10)).sum(-1)  # Dream entropy, with its epsilon
    code = remask[:, None]
    conf = torch.where(code == REMASK_CODE["margin"], margin, prob)
    conf = torch.where(code == REMASK_CODE["entropy"], neg_entropy, conf)
    if u_random is not None:
        conf = torch.where(code == REMASK_CODE["random"], u_random.to(dtype), conf)
    return conf


# ---------------------------------------------------------------- batched selection

def select_tokens(logits: torch.Tensor, tokens: torch.Tensor, candidate: torch.Tensor, k: torch.Tensor,
                  temperature: torch.Tensor, remask: torch.Tensor, threshold: torch.Tensor, factor: torch.Tensor,
                  seed: torch.Tensor, step: torch.Tensor, pos: torch.Tensor, sampling: bool, any_random: bool,
                  factor_rule: Optional[torch.Tensor] = None, conf_dtype: torch.dtype = torch.float64,
                  x0_from_probs: bool = False, block_threshold: bool = False, mask_id: Optional[int] = None,
                  top_k: Optional[torch.Tensor] = None, top_p: Optional[torch.Tensor] = None,
                  ban: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One denoising selection over a window of each row (usually its current block).

    logits (B, W, V); tokens (B, W) current ids; candidate (B, W) True where masked and inside
    the row's current block; k (B,) tokens to commit under the fixed schedule; threshold / factor
    (B,, float64) > 0 switch a row to the adaptive rules, factor_rule (B,) picks the factor rule's
    variant (FACTOR_RULE_CODE; default Fast-dLLM's); seed, step (B,) and pos (B, W) key the noise.
    `sampling` / `any_random` are host-known flags (any temperature > 0, any random remasking)
    that skip work, never change results. conf_dtype / x0_from_probs follow the model family's
    published sampler (Dream takes x0 as the first maximum of its softmax, in the logits dtype).
    block_threshold switches the threshold to SDAR's / LLaDA2's dynamic rule: every candidate
    strictly above it if that is at least the schedule's k, else the top k. mask_id is never a
    candidate token (a random or undertrained model may rank it first; published loops would
    commit it and keep the position masked, or loop forever under a threshold). top_k / top_p
    (B,) restrict each row's drawn token (`filter_logits`); None when no row asks (skips work).
    ban = (ids (B, S) padded with V, before (B,), canvas positions (B, W)): a row's ids are never
    drawn at canvas positions < before (min_tokens: no stop token early).
    Returns the candidate tokens x0 (B, W), committed mask (B, W), the confidences (B, W) and
    how many tokens each row commits (B,).
    """
    B, W, V = logits.shape
    # top-k / top-p narrow which token is drawn; its confidence is read from the whole
    # distribution (as SDAR's evaluation sampler does), so top_k=1 does not make every one 1.0.
    pick = logits if top_k is None or top_p is None else filter_logits(logits, top_k, top_p)
    if sampling:
        scores = gumbel_scores(pick, temperature, uniform_noise(seed, step, pos, V, stream=0))
    elif x0_from_probs:
        scores = F.softmax(pick, dim=-1)  # ties of the rounded probabilities: first wins
    else:
        scores = pick
    if mask_id is not None:  # committing the mask token would leave the position masked forever
        scores = scores.clone()  # (no host tensor here: this runs inside CUDA-graph capture)
        scores[..., mask_id] = NEG_INF
    if ban is not None:
        ids, before, canvas_pos = ban
        vocab = torch.zeros(B, V + 1, dtype=torch.bool, device=ids.device).scatter_(1, ids, True)[:, :V]  # (B, V)
        early = canvas_pos < before[:, None]  # (B, W)
        scores = scores.masked_fill(early[..., None] & vocab[:, None, :], NEG_INF)
    x0 = scores.argmax(-1)  # (B, W)
    u_random = uniform_noise(seed, step, pos, None, stream=1) if any_random else None
    conf = confidences(logits, x0, remask, u_random, conf_dtype)
    # A NaN confidence (overflowing guidance, a broken checkpoint) ranks below every real one but
    # above non-candidates, and every rule below commits at least one candidate per step, so a
    # request always ends.
    conf = torch.where(conf.isnan(), torch.full_like(conf, torch.finfo(conf.dtype).min), conf)
    conf = torch.where(candidate, conf, torch.full_like(conf, NEG_INF))

    # Rank candidates by confidence; a stable sort breaks ties towards lower positions.
    sorted_conf, order = torch.sort(conf, dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order).scatter_(1, order, torch.arange(W, device=order.device).expand(B, W))
    n_cand = candidate.sum(-1)  # (B,)
    # Threshold (Fast-dLLM): the top-1 plus every candidate at or above the threshold, compared
    # in the confidences' dtype as the published code compares its tensor with a Python float.
    thr = threshold.to(conf.dtype)[:, None]
    if block_threshold:
        n_thr = torch.maximum((sorted_conf > thr).sum(-1), k).clamp_min(1)
    else:
        n_thr = (sorted_conf >= thr).sum(-1).clamp_min(1)
    n_commit = torch.where(threshold > 0, n_thr, torch.where(factor > 0, _factor_count(sorted_conf, factor,
                                                                                        n_cand, factor_rule), k))
    n_commit = torch.minimum(n_commit, n_cand)
    commit = (ranks < n_commit[:, None]) & candidate
    return x0, commit, conf, n_commit


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


# ---------------------------------------------------------------- reference reverse process

Forward = Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


@torch.no_grad()
def reference_generate(model: Forward, prompt: torch.Tensor, params: SamplingParams, mask_id: int,
                       stop_ids: Sequence[int] = (), attention_mask: Optional[torch.Tensor] = None,
                       on_step: Optional[Callable[[int, int, torch.Tensor, torch.Tensor], None]] = None,
                       ) -> tuple[torch.Tensor, int]:
    """LLaDA's semi-autoregressive reverse process. prompt (B, Lp) left-padded -> (canvas, nfe).

    Fixed schedule by default; with params.threshold / params.factor each block runs until it
    has no masks (Fast-dLLM). Stops early, filling the canvas with EOS, once a finished block of
    every row holds a stop token (params.stop_at_eos). on_step(step, block, canvas, committed).
    """
    p = params
    B, Lp = prompt.shape
    x = torch.full((B, Lp + p.gen_length), mask_id, dtype=torch.long, device=prompt.device)
    x[:, :Lp] = prompt
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask.bool(), attention_mask.new_ones(B, p.gen_length).bool()], 1)
    prompt_index = x != mask_id
    seed = torch.full((B,), p.seed or 0, dtype=torch.long, device=x.device)
    pos = torch.arange(x.shape[1], device=x.device).expand(B, -1) - Lp  # noise keyed by generated position
    nfe = 0
    for block in range(p.num_blocks):
        start, end = Lp + block * p.block_length, Lp + (block + 1) * p.block_length
        n_masked = (x[:, start:end] == mask_id).sum(1).tolist()
        schedule = [transfer_schedule(n, p.steps_per_block) for n in n_masked]
        i = 0
        while (x[:, start:end] == mask_id).any() and (p.adaptive or i < p.steps_per_block):
            mask_index = x == mask_id
            if p.cfg_scale > 0:
                un_x = x.clone()
                un_x[prompt_index] = mask_id
                am = None if attention_mask is None else torch.cat([attention_mask, attention_mask])
                cond, un = model(torch.cat([x, un_x]), am).chunk(2)
                logits = un + (p.cfg_scale + 1) * (cond - un)
            else:
                logits = model(x, attention_mask)
            if p.frequency_penalty or p.presence_penalty:
                logits = _reference_penalty(logits, x, Lp, p, stop_ids, mask_id)
            step = torch.full((B,), nfe, dtype=torch.long, device=x.device)
            if p.temperature > 0:
                u = uniform_noise(seed, step, pos, logits.shape[-1], stream=0)
                x0 = gumbel_scores(logits, torch.full((B,), p.temperature, device=x.device), u).argmax(-1)
            else:
                x0 = logits.argmax(-1)
            u_rand = uniform_noise(seed, step, pos, None, stream=1) if p.remasking == "random" else None
            code = torch.full((B,), REMASK_CODE[p.remasking], device=x.device)
            x0_p = confidences(logits, x0, code, u_rand)
            x0_p[:, end:] = NEG_INF
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, torch.full_like(x0_p, NEG_INF))
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            for j in range(B):
                n_left = int(mask_index[j, start:end].sum())
                if p.adaptive:  # commit the top-1 and whatever the rule admits
                    k = _adaptive_count(confidence[j, start:end], p, n_left)
                elif p.schedule == "dream":
                    k = dream_transfer_count(n_left, i, p.steps_per_block, p.eps)
                else:
                    k = schedule[j][i]
                _, idx = torch.topk(confidence[j], k=k)
                transfer[j, idx] = True
            x[transfer] = x0[transfer]
            nfe += 1
            i += 1
            if on_step is not None:
                on_step(nfe - 1, block, x, transfer)
        if p.stop_at_eos and stop_ids and _all_rows_stopped(x[:, Lp:end], stop_ids):
            eos = next(iter(stop_ids))
            x[:, end:] = torch.where(x[:, end:] == mask_id, eos, x[:, end:])
            break
    return x, nfe


def _reference_penalty(logits, x, Lp, p: SamplingParams, stop_ids: Sequence[int], mask_id: int) -> torch.Tensor:
    """`penalize`, for one batch sharing one prompt width and one set of stop ids."""
    B, V = x.shape[0], logits.shape[-1]
    exclude = torch.tensor([sorted(stop_ids) or [V]] * B, device=x.device)
    full = lambda v: torch.full((B,), float(v), device=x.device)  # noqa: E731
    return penalize(logits, x, torch.full((B,), Lp, device=x.device), full(p.frequency_penalty),
                    full(p.presence_penalty), exclude, mask_id)


def _adaptive_count(conf: torch.Tensor, p: SamplingParams, n_left: int) -> int:
    c = sorted(conf[conf > NEG_INF].tolist(), reverse=True)
    if p.threshold is not None:
        n = 1 + sum(1 for v in c[1:] if v >= p.threshold)
    elif p.factor_rule == "paper":
        n = max([i for i in range(1, len(c) + 1) if (i + 1) * (1 - c[i - 1]) < p.factor] or [1])
    else:  # Fast-dLLM's code: the leading run clearing 1 - f/(n+1), all of them if only the last fails
        n = 1
        while n < len(c) and c[n] >= 1 - p.factor / (n + 2):
            n += 1
        n = len(c) if n == len(c) - 1 else n
    return min(n, n_left)


def _all_rows_stopped(generated: torch.Tensor, stop_ids: Sequence[int]) -> bool:
    stops = torch.tensor(list(stop_ids), device=generated.device)
    return bool(torch.isin(generated, stops).any(1).all())
