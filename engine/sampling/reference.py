"""LLaDA's semi-autoregressive reverse process, written out in one screen.

The readable, exact reference that the batched path (`select.select_tokens` under the runners)
is held to: the tests compare it with an independent implementation of the published
`generate()` and the engine with it. It shares the sampler's pure functions (noise, confidences,
penalties) but none of the batching.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from celeris.engine.sampling.params import SamplingParams
from celeris.engine.sampling.batch import REMASK_CODE
from celeris.engine.sampling.schedule import dream_transfer_count, transfer_schedule
from celeris.engine.sampling.select import (NEG_INF, Measure, Penalties, confidences, gumbel_scores, penalize,
                                            uniform_noise)

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
            x0_p = confidences(logits, x0, Measure(code, u_rand))
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
    return penalize(logits, x, torch.full((B,), Lp, device=x.device),
                    Penalties(full(p.frequency_penalty), full(p.presence_penalty), exclude), mask_id)


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
