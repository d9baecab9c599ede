"""LLaDA's and Fast-dLLM's published reverse processes at temperature 0 (remasking='low_confidence').

- fixed schedule, no cache: ML-GSAI/LLaDA generate.py `generate` (its first published version takes
  the softmax in float64; the current one in the logits dtype: `confidence_dtype=None`). CFG and an
  attention_mask follow the Oct 2025 batched version.
- threshold / factor, no cache: NVlabs/Fast-dLLM llada/generate.py `generate` (`get_transfer_index`,
  `get_transfer_index_dynamic`), which loops each block until it has no mask.
- cache='prefix' / 'dual': Fast-dLLM `generate_with_prefix_cache` / `generate_with_dual_cache`.

`model(x, ...)` is a reference model (`LLaDAReference`) returning `.logits` and, with use_cache=True,
`.past_key_values`. Canvas x (B, Lp + gen_length); blocks of block_length, steps // num_blocks steps
each. torch.topk chooses among tied confidences in its own (device-dependent) order, as published.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


def get_num_transfer_tokens(block_mask_index: torch.Tensor, steps: int) -> torch.Tensor:
    """(B, block) bool -> (B, steps) int64: n // steps each, one more in the first n % steps steps."""
    mask_num = block_mask_index.sum(dim=1, keepdim=True)
    base, remainder = mask_num // steps, mask_num % steps
    out = torch.zeros(mask_num.size(0), steps, device=block_mask_index.device, dtype=torch.int64) + base
    for i in range(mask_num.size(0)):
        out[i, : int(remainder[i])] += 1
    return out


def _x0_and_confidence(logits, mask_index, x, confidence_dtype):
    # temperature 0: add_gumbel_noise returns the logits unchanged; x0 = argmax of the (model-dtype) logits.
    x0 = torch.argmax(logits, dim=-1)  # (B, L)
    p = F.softmax(logits if confidence_dtype is None else logits.to(confidence_dtype), dim=-1)
    x0_p = torch.squeeze(torch.gather(p, dim=-1, index=torch.unsqueeze(x0, -1)), -1)
    x0 = torch.where(mask_index, x0, x)
    confidence = torch.where(mask_index, x0_p, NEG_INF)  # -inf: committed, or outside the block
    return x0, confidence


def get_transfer_index(logits, mask_index, x, num_transfer_tokens, threshold=None, confidence_dtype=torch.float64):
    """Fast-dLLM get_transfer_index: top-k by confidence; with a threshold k = every masked position,
    then ranks 1.. whose confidence is < threshold are dropped again (rank 0 always stays)."""
    x0, confidence = _x0_and_confidence(logits, mask_index, x, confidence_dtype)
    transfer_index = torch.zeros_like(x0, dtype=torch.bool)
    if threshold is not None:
        num_transfer_tokens = mask_index.sum(dim=1, keepdim=True)
    for j in range(confidence.shape[0]):
        k = int(num_transfer_tokens[j])
        _, select_index = torch.topk(confidence[j], k=k)
        transfer_index[j, select_index] = True
        if threshold is not None:
            for r in range(1, k):
                if confidence[j, select_index[r]] < threshold:
                    transfer_index[j, select_index[r]] = False
    return x0, transfer_index


def factor_count(sorted_conf: torch.Tensor, factor: float, rule: str = "fast_dllm") -> int:
    """How many of the n masked candidates (confidences sorted descending) the factor rule commits.

    fast_dllm (get_transfer_index_dynamic, as published): thresholds 1 - factor/(m+1) for m = 1..n with
    the first forced to -1; walk top_i = 0..n-1 and stop at the first sorted_conf[top_i] < thresh; then
    `if top_i == 0 or top_i == n - 1: top_i += 1`. So a failure at the LAST rank still commits all n
    (one more than the paper), and a walk without failure commits n.
    paper: the largest m with (m + 1) * (1 - c_m) < factor, at least 1.
    """
    n = len(sorted_conf)
    if rule == "paper":
        ok = [m for m in range(1, n + 1) if (m + 1) * (1 - float(sorted_conf[m - 1])) < factor]
        return max(ok or [1])
    threshs = [1 - factor / (m + 1) for m in range(1, n + 1)]  # Python floats (double)
    threshs[0] = -1
    top_i = 0
    for top_i in range(n):
        if sorted_conf[top_i] < threshs[top_i]:  # float64 tensor vs Python float
            break
    if top_i == 0 or top_i == n - 1:
        top_i += 1
    return top_i


def get_transfer_index_dynamic(logits, mask_index, x, factor, confidence_dtype=torch.float64, rule="fast_dllm"):
    x0, confidence = _x0_and_confidence(logits, mask_index, x, confidence_dtype)
    transfer_index = torch.zeros_like(x0, dtype=torch.bool)
    for j in range(confidence.shape[0]):
        if not mask_index[j].any():  # published: IndexError on threshs[0] (a finished row in a batch)
            continue
        sorted_conf = torch.sort(confidence[j][mask_index[j]], dim=-1, descending=True)[0]
        _, select_index = torch.topk(confidence[j], k=factor_count(sorted_conf, factor, rule))
        transfer_index[j, select_index] = True
    return x0, transfer_index


def _select(logits, mask_index, x, schedule, i, threshold, factor, confidence_dtype, factor_rule):
    """One step's choice; the fixed schedule's k = schedule[:, i] is read only without threshold/factor."""
    k = schedule[:, i] if threshold is None and factor is None else None
    if factor is None:
        return get_transfer_index(logits, mask_index, x, k if threshold is None else None, threshold, confidence_dtype)
    return get_transfer_index_dynamic(logits, mask_index, x, factor, confidence_dtype, factor_rule)


@torch.no_grad()
def llada_generate(model, prompt_ids: torch.Tensor, *, steps: int, gen_length: int, block_length: int,
                   mask_id: int, threshold: Optional[float] = None, factor: Optional[float] = None,
                   cache: Optional[str] = None, attention_mask: Optional[torch.Tensor] = None,
                   cfg_scale: float = 0.0, confidence_dtype: Optional[torch.dtype] = torch.float64,
                   factor_rule: str = "fast_dllm", return_nfe: bool = False):
    """-> canvas (B, Lp + gen_length) [, nfe]. cache None | 'prefix' | 'dual'."""
    assert gen_length % block_length == 0
    num_blocks = gen_length // block_length
    assert steps % num_blocks == 0
    steps_per_block = steps // num_blocks
    if cache is not None and (cfg_scale > 0 or (attention_mask is not None and 0 in attention_mask)):
        raise ValueError("Fast-dLLM's cached generators take neither CFG nor padding")
    B, Lp = prompt_ids.shape
    x = torch.full((B, Lp + gen_length), mask_id, dtype=torch.long, device=prompt_ids.device)
    x[:, :Lp] = prompt_ids.clone()
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask, torch.ones((B, gen_length), dtype=attention_mask.dtype,
                                                               device=attention_mask.device)], dim=-1)
    sel = dict(threshold=threshold, factor=factor, confidence_dtype=confidence_dtype, factor_rule=factor_rule)
    run = {None: _blocks_no_cache, "prefix": _blocks_prefix_cache, "dual": _blocks_dual_cache}[cache]
    nfe = run(model, x, Lp, num_blocks, block_length, steps_per_block, mask_id, attention_mask, cfg_scale, sel)
    return (x, nfe) if return_nfe else x


def _logits(model, x, attention_mask, prompt_index, mask_id, cfg_scale):
    if cfg_scale <= 0:
        return model(x, attention_mask=attention_mask).logits
    # ML-GSAI generate: unconditional copy = the prompt masked out; both halves in one forward.
    un_x = x.clone()
    un_x[prompt_index] = mask_id
    am = None if attention_mask is None else torch.cat([attention_mask, attention_mask], dim=0)
    logits, un_logits = torch.chunk(model(torch.cat([x, un_x], dim=0), attention_mask=am).logits, 2, dim=0)
    return un_logits + (cfg_scale + 1) * (logits - un_logits)


def _blocks_no_cache(model, x, Lp, num_blocks, block_length, steps_per_block, mask_id, attention_mask, cfg_scale, sel):
    """ML-GSAI generate (fixed schedule: exactly steps_per_block forwards a block) and Fast-dLLM
    generate (threshold/factor: forwards until the block has no mask)."""
    adaptive = sel["threshold"] is not None or sel["factor"] is not None
    prompt_index = x != mask_id
    nfe = 0
    for num_block in range(num_blocks):
        start, end = Lp + num_block * block_length, Lp + (num_block + 1) * block_length
        num_transfer_tokens = get_num_transfer_tokens(x[:, start:end] == mask_id, steps_per_block)
        i = 0
        while (x[:, start:end] == mask_id).any() if adaptive else i < steps_per_block:
            mask_index = x == mask_id
            logits = _logits(model, x, attention_mask, prompt_index, mask_id, cfg_scale)
            nfe += 1
            mask_index[:, end:] = False  # == ML-GSAI's x0_p[:, end:] = -inf
            x0, transfer_index = _select(logits, mask_index, x, num_transfer_tokens, i, **sel)
            x[transfer_index] = x0[transfer_index]
            i += 1
    return nfe


def _blocks_prefix_cache(model, x, Lp, num_blocks, block_length, steps_per_block, mask_id, attention_mask, cfg_scale, sel):
    """generate_with_prefix_cache: each block's first step is a full forward whose K/V of [0, start)
    are kept; the block's later steps run x[:, start:] (the block AND everything after it) against them."""
    nfe = 0
    for num_block in range(num_blocks):
        start = Lp + num_block * block_length
        end = start + block_length
        num_transfer_tokens = get_num_transfer_tokens(x[:, start:end] == mask_id, steps_per_block)
        output = model(x, use_cache=True)
        mask_index = x == mask_id
        mask_index[:, end:] = False
        x0, transfer_index = _select(output.logits, mask_index, x, num_transfer_tokens, 0, **sel)
        x[transfer_index] = x0[transfer_index]
        past_key_values = [(k[:, :, :start], v[:, :, :start]) for k, v in output.past_key_values]
        nfe += 1
        i = 1
        while (x[:, start:end] == mask_id).any():  # checked BEFORE each cached forward
            nfe += 1
            mask_index = x[:, start:] == mask_id
            mask_index[:, block_length:] = False
            logits = model(x[:, start:], past_key_values=past_key_values, use_cache=True).logits
            x0, transfer_index = _select(logits, mask_index, x[:, start:], num_transfer_tokens, i, **sel)
            x[:, start:][transfer_index] = x0[transfer_index]
            i += 1
    return nfe


def _blocks_dual_cache(model, x, Lp, num_blocks, block_length, steps_per_block, mask_id, attention_mask, cfg_scale, sel):
    """generate_with_dual_cache: each block's first step is a full forward whose K/V of the whole canvas
    are kept; later steps run only x[:, start:end], overwriting the block's K/V in the cache
    (replace_position) and attending over prefix + block + suffix."""
    nfe = 0
    for num_block in range(num_blocks):
        start = Lp + num_block * block_length
        end = start + block_length
        num_transfer_tokens = get_num_transfer_tokens(x[:, start:end] == mask_id, steps_per_block)
        output = model(x, use_cache=True)
        past_key_values = output.past_key_values
        mask_index = x == mask_id
        mask_index[:, end:] = False
        x0, transfer_index = _select(output.logits, mask_index, x, num_transfer_tokens, 0, **sel)
        x[transfer_index] = x0[transfer_index]
        nfe += 1
        i = 1
        replace_position = torch.zeros_like(x, dtype=torch.bool)
        replace_position[:, start:end] = True
        while (x[:, start:end] == mask_id).any():
            nfe += 1
            mask_index = x[:, start:end] == mask_id
            logits = model(x[:, start:end], past_key_values=past_key_values, use_cache=True,
                           replace_position=replace_position).logits
            x0, transfer_index = _select(logits, mask_index, x[:, start:end], num_transfer_tokens, i, **sel)
            x[:, start:end][transfer_index] = x0[transfer_index]
            i += 1
    return nfe
