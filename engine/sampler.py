"""Pure decoding functions of the masked-diffusion reverse process.

Two paths over the same model:
- `reference_generate`: LLaDA's `generate()` written out in one screen. Readable and exact; the
  tests hold it to an independent implementation of the published algorithm.
- `select_tokens`: one vectorised selection step over a batch of requests with per-row settings,
  fixed shapes, no Python loop over rows and no host synchronisation, so it can be captured in a
  CUDA graph. The runner calls it; it commits the same tokens as the reference where
  confidences are not tied.

Tie-break rule (batched): among equal confidences the lower canvas position is committed first
(a stable descending sort).

Randomness is counter-based: the uniform number of (seed, step, position, vocab id) is a hash,
so a request draws the same noise alone or inside any batch, on any device.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from engine.params import REMASKING, SamplingParams

NEG_INF = float("-inf")
REMASK_CODE = {name: i for i, name in enumerate(REMASKING)}
_M32 = 0xFFFFFFFF


def transfer_schedule(n_masked: int, steps: int) -> list[int]:
    """Tokens to commit at each of `steps` steps: n//S each, plus one in the first n%S steps."""
    base, rem = divmod(n_masked, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


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


# ---------------------------------------------------------------- confidence measures

def confidences(logits: torch.Tensor, x0: torch.Tensor, remask: torch.Tensor, u_random: Optional[torch.Tensor]) -> torch.Tensor:
    """Per-position confidence of the candidate x0 under each row's measure. (B, W, V) -> (B, W)."""
    p = F.softmax(logits.float(), dim=-1)
    prob = torch.gather(p, -1, x0[..., None]).squeeze(-1)  # LLaDA low_confidence
    top2 = torch.topk(p, 2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]  # Dream topk_margin
    neg_entropy = (p * torch.log(p.clamp_min(1e-30))).sum(-1)  # Dream entropy
    code = remask[:, None]
    conf = torch.where(code == REMASK_CODE["margin"], margin, prob)
    conf = torch.where(code == REMASK_CODE["entropy"], neg_entropy, conf)
    if u_random is not None:
        conf = torch.where(code == REMASK_CODE["random"], u_random.float(), conf)
    return conf


# ---------------------------------------------------------------- batched selection

def select_tokens(logits: torch.Tensor, tokens: torch.Tensor, candidate: torch.Tensor, k: torch.Tensor,
                  temperature: torch.Tensor, remask: torch.Tensor, threshold: torch.Tensor, factor: torch.Tensor,
                  seed: torch.Tensor, step: torch.Tensor, pos: torch.Tensor, sampling: bool, any_random: bool,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One denoising selection over a window of each row (usually its current block).

    logits (B, W, V); tokens (B, W) current ids; candidate (B, W) True where masked and inside
    the row's current block; k (B,) tokens to commit under the fixed schedule; threshold / factor
    (B,) > 0 switch a row to the adaptive rules; seed, step (B,) and pos (B, W) key the noise.
    `sampling` / `any_random` are host-known flags (any temperature > 0, any random remasking)
    that skip work, never change results. Returns new tokens (B, W), committed mask (B, W) and
    the confidences (B, W).
    """
    B, W, V = logits.shape
    if sampling:
        scores = gumbel_scores(logits, temperature, uniform_noise(seed, step, pos, V, stream=0))
        x0 = scores.argmax(-1)
    else:
        x0 = logits.argmax(-1)  # (B, W)
    u_random = uniform_noise(seed, step, pos, None, stream=1) if any_random else None
    conf = confidences(logits, x0, remask, u_random)
    conf = torch.where(candidate, conf, torch.full_like(conf, NEG_INF))

    # Rank candidates by confidence; a stable sort breaks ties towards lower positions.
    sorted_conf, order = torch.sort(conf, dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order).scatter_(1, order, torch.arange(W, device=order.device).expand(B, W))
    n_cand = candidate.sum(-1)  # (B,)
    # Threshold (Fast-dLLM): the top-1 plus every candidate at or above the threshold.
    n_thr = (sorted_conf >= threshold[:, None]).sum(-1).clamp_min(1)
    # Factor rule (Fast-dLLM): the largest n with (n + 1) * (1 - c_(n)) < f, at least one.
    n_idx = torch.arange(1, W + 1, device=logits.device, dtype=torch.float32)
    ok = ((n_idx + 1) * (1 - sorted_conf.float()) < factor[:, None]) & (sorted_conf > NEG_INF)
    n_fac = torch.where(ok, n_idx, torch.zeros_like(n_idx)).amax(-1).long().clamp_min(1)
    n_commit = torch.where(threshold > 0, n_thr, torch.where(factor > 0, n_fac, k))
    n_commit = torch.minimum(n_commit, n_cand)
    commit = (ranks < n_commit[:, None]) & candidate
    return torch.where(commit, x0, tokens), commit, conf


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


def _adaptive_count(conf: torch.Tensor, p: SamplingParams, n_left: int) -> int:
    c = sorted(conf[conf > NEG_INF].tolist(), reverse=True)
    if p.threshold is not None:
        n = 1 + sum(1 for v in c[1:] if v >= p.threshold)
    else:
        n = max([i for i in range(1, len(c) + 1) if (i + 1) * (1 - c[i - 1]) < p.factor] or [1])
    return min(n, n_left)


def _all_rows_stopped(generated: torch.Tensor, stop_ids: Sequence[int]) -> bool:
    stops = torch.tensor(list(stop_ids), device=generated.device)
    return bool(torch.isin(generated, stops).any(1).all())
