"""Dream's published reverse processes at temperature 0 (alg_temp None/0, no top_p/top_k).

- `dream_generate`: Dream-org generation_utils.py `diffusion_generate` -> `_sample`, algs maskgit_plus,
  topk_margin, entropy, over the whole canvas: timesteps = linspace(1, eps, steps + 1); at step i the
  number to commit is int(num_mask_token * (1 - s / t)) (the last step: every remaining mask).
- `dream_generate_cached`: NVlabs/Fast-dLLM dream/model/generation_utils_block.py `_sample` (block
  cache, prefix or dual), with `threshold` = its alg 'confidence_threshold'.

`model(x, attention_mask, tok_idx, ...)` is a `DreamReference`; its logits are unshifted, in the
model dtype, and every confidence below stays in that dtype as published (full_confidence is created
with dtype=logits.dtype).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

ALGS = ("maskgit_plus", "topk_margin", "entropy")


def sample_tokens(logits: torch.Tensor, margin_confidence: bool = False, neg_entropy: bool = False,
                  top_k: Optional[int] = None):
    """generation_utils.sample_tokens at temperature 0: with top_k, every logit below the k-th
    largest becomes -inf first (its ties kept); probs = softmax(logits) in the logits dtype;
    x0 = argmax of probs (probs.max), confidence = its probability; or top1 - top2 (margin); or
    sum(p * log(p + 1e-10)) (negative entropy)."""
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    confidence, x0 = probs.max(dim=-1)
    if margin_confidence:
        sorted_probs, _ = torch.sort(probs, dim=-1, descending=True)
        confidence = sorted_probs[:, 0] - sorted_probs[:, 1]
    if neg_entropy:
        log_probs = torch.log(probs + 1e-10)
        confidence = torch.sum(probs * log_probs, dim=-1)
    return confidence, x0


def _shift(logits: torch.Tensor) -> torch.Tensor:
    # Dream predicts position i from hidden state i-1; position 0 keeps its own logits.
    return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)


def dream_masks(prompt_ids: torch.Tensor, gen_length: int, attention_mask: Optional[torch.Tensor]):
    """_sample's padding handling -> (attention_mask "full" | bool (B, 1, N, N), tok_idx | None)."""
    if attention_mask is None or not torch.any(attention_mask == 0.0):
        return "full", None
    attention_mask = F.pad(attention_mask, (0, gen_length), value=1.0)  # [MASK] positions are kept
    tok_idx = attention_mask.long().cumsum(-1) - 1
    tok_idx.masked_fill_(attention_mask == 0, 1)
    mask = torch.logical_and(attention_mask.unsqueeze(1).unsqueeze(-2), attention_mask.unsqueeze(1).unsqueeze(-1))
    return mask, tok_idx


@torch.no_grad()
def dream_generate(model, prompt_ids: torch.Tensor, *, steps: int, gen_length: int, mask_id: int,
                   alg: str = "entropy", eps: float = 1e-3,
                   attention_mask: Optional[torch.Tensor] = None, top_k: Optional[int] = None) -> torch.Tensor:
    """Dream `_sample` -> canvas (B, Lp + gen_length). Exactly `steps` forwards. top_k as its
    generation config carries it: None when set so, 50 (transformers' default) when unset."""
    if alg not in ALGS:
        raise ValueError(f"alg must be one of {ALGS} (origin is random)")
    x = F.pad(prompt_ids, (0, gen_length), value=mask_id)
    mask, tok_idx = dream_masks(prompt_ids, gen_length, attention_mask)
    timesteps = torch.linspace(1, eps, steps + 1, device=x.device)  # float32
    for i in range(steps):
        mask_index = x == mask_id
        logits = _shift(model(x, mask, tok_idx).logits)
        mask_logits = logits[mask_index]  # (n_masked_total, V)
        t, s = timesteps[i], timesteps[i + 1]
        confidence, x0 = sample_tokens(mask_logits, margin_confidence=alg == "topk_margin",
                                       neg_entropy=alg == "entropy", top_k=top_k)
        # num_mask_token: the batch MEAN masked count, a float32 tensor; one count for every row.
        num_mask_token = mask_index.sum() / mask_index.shape[0]
        number_transfer_tokens = int(num_mask_token * (1 - s / t)) if i < steps - 1 else int(num_mask_token)
        full_confidence = torch.full_like(x, -torch.inf, device=x.device, dtype=logits.dtype)
        full_confidence[mask_index] = confidence
        if number_transfer_tokens > 0:
            _, transfer_index = torch.topk(full_confidence, number_transfer_tokens)  # (B, n), over the canvas
            x_ = torch.zeros_like(x, dtype=torch.long) + mask_id
            x_[mask_index] = x0.clone()
            row_indices = torch.arange(x.size(0), device=x.device).unsqueeze(1).expand_as(transfer_index)
            x[row_indices, transfer_index] = x_[row_indices, transfer_index]
    return x


@torch.no_grad()
def dream_generate_cached(model, prompt_ids: torch.Tensor, *, steps: int, gen_length: int, block_length: int,
                          mask_id: int, eps: float = 1e-3, threshold: Optional[float] = None,
                          dual_cache: bool = False, return_nfe: bool = False):
    """Fast-dLLM's Dream block cache. Per block:
    step 0: a full forward (stores K/V); x0 = argmax of the shifted probs; ONLY the block's first
      position is committed, whatever its confidence. Prefix mode keeps K/V of [0, start); dual keeps all.
    later steps: forward the window (prefix: x[start:], dual: x[start:end]); the window's logits are
      shifted WITHIN the window (its column 0 keeps its own logits; it is already committed).
      threshold None: `if i == steps_per_block: break` (checked AFTER that forward), timesteps =
        linspace(1, eps, steps_per_block + 1) used at (t_i, t_{i+1}) for i = 1.., count =
        int(block_masks_mean * (1 - s/t)) (last i: all), confidence = NEGATIVE ENTROPY whatever alg.
      threshold set (alg 'confidence_threshold', batch 1): maskgit_plus confidence; top-1 always,
        ranks 1.. kept while >= threshold.
    then stop the block when it has no mask.
    """
    B, Lp = prompt_ids.shape
    if threshold is not None and B != 1:
        raise ValueError("Fast-dLLM's confidence_threshold path handles batch 1 only")
    x = F.pad(prompt_ids, (0, gen_length), value=mask_id)
    assert gen_length % block_length == 0
    num_blocks = gen_length // block_length
    assert steps % num_blocks == 0
    steps_per_block = steps // num_blocks
    timesteps = torch.linspace(1, eps, steps_per_block + 1, device=x.device)
    nfe = 0
    for num_block in range(num_blocks):
        start = Lp + num_block * block_length
        end = start + block_length
        output = model(x, "full", None, use_cache=True)
        nfe += 1
        _, x0 = sample_tokens(_shift(output.logits))
        x[:, start] = x0[:, start]
        if dual_cache:
            past_key_values = output.past_key_values
            replace_position = torch.zeros_like(x, dtype=torch.bool)
            replace_position[:, start:end] = True
        else:
            past_key_values = [(k[:, :start, :], v[:, :start, :]) for k, v in output.past_key_values]
            replace_position = None
        win_end = end if dual_cache else x.shape[1]
        i = 1
        while True:
            window = x[:, start:win_end]  # a view: writes land in x
            mask_index = window == mask_id
            logits = _shift(model(window, "full", None, past_key_values=past_key_values, use_cache=True,
                                  dual_cache=dual_cache, replace_position=replace_position).logits)
            nfe += 1
            if threshold is not None:
                _threshold_step(window, logits, mask_index, x[:, start:end] == mask_id, block_length, mask_id, threshold)
            else:
                if i == steps_per_block:
                    break
                t, s = timesteps[i], timesteps[i + 1]
                mask_index[:, block_length:] = False
                _entropy_step(window, logits, mask_index, t, s, i == steps_per_block - 1, block_length, mask_id)
                i += 1
            if (x[:, start:end] == mask_id).sum() == 0:
                break
    return (x, nfe) if return_nfe else x


def _entropy_step(window, logits, mask_index, t, s, last: bool, block_length: int, mask_id: int) -> None:
    confidence, x0 = sample_tokens(logits[mask_index], neg_entropy=True)
    num_mask_token = mask_index.sum() / mask_index.shape[0]
    number_transfer_tokens = int(num_mask_token * (1 - s / t)) if not last else int(num_mask_token)
    full_confidence = torch.full_like(window, -torch.inf, dtype=logits.dtype)
    full_confidence[mask_index] = confidence
    full_confidence[:, block_length:] = -torch.inf
    if number_transfer_tokens > 0:
        _, transfer_index = torch.topk(full_confidence, number_transfer_tokens)
        x_ = torch.zeros_like(window, dtype=torch.long) + mask_id
        x_[mask_index] = x0.clone()
        row_indices = torch.arange(window.size(0), device=window.device).unsqueeze(1).expand_as(transfer_index)
        window[row_indices, transfer_index] = x_[row_indices, transfer_index]


def _threshold_step(window, logits, mask_index, block_masks, block_length: int, mask_id: int, threshold: float) -> None:
    confidence, x0 = sample_tokens(logits[mask_index])  # maskgit_plus; mask_index spans the whole window
    x_ = torch.zeros_like(window, dtype=torch.long) + mask_id
    full_confidence = torch.full_like(window, -torch.inf, dtype=logits.dtype)
    x_[mask_index] = x0.clone()
    full_confidence[mask_index] = confidence
    full_confidence[:, block_length:] = -torch.inf
    current_transfer_tokens = int(block_masks.sum())
    selected_confidence, select_index = torch.topk(full_confidence, current_transfer_tokens)
    transfer_index = torch.zeros_like(x_, dtype=torch.bool)
    transfer_index[0, select_index[0]] = True
    for k in range(1, current_transfer_tokens):
        if selected_confidence[0, k] < threshold:
            transfer_index[0, select_index[0, k]] = False
    window[transfer_index] = x_[transfer_index]
