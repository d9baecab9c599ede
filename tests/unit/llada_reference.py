"""An independent implementation of LLaDA's published `generate()` (temperature 0 paths).

Written from the algorithm's description (ML-GSAI/LLaDA generate.py, batched version of Oct
2025), not from the engine: canvas = prompt + gen_length masks; gen_length/block_length blocks
decoded left to right; steps split evenly over blocks; at each step the number of tokens to
commit is n//S, plus one in the first n%S steps, where n is the block's masked count at the
block's start; x0 = argmax of the (guided) logits; confidence = softmax probability of x0
(low_confidence), -inf outside the current block and at committed positions; commit the top-k.
"""

from __future__ import annotations

import torch


def num_transfer_tokens(block_mask: torch.Tensor, steps: int) -> torch.Tensor:
    n = block_mask.sum(dim=1, keepdim=True)  # (B, 1)
    out = (n // steps).repeat(1, steps)
    rem = n % steps
    for b in range(n.shape[0]):
        out[b, : int(rem[b])] += 1
    return out  # (B, steps)


@torch.no_grad()
def llada_generate(logits_fn, prompt: torch.Tensor, steps: int, gen_length: int, block_length: int,
                   mask_id: int, cfg_scale: float = 0.0, attention_mask=None) -> torch.Tensor:
    B, Lp = prompt.shape
    x = torch.cat([prompt, torch.full((B, gen_length), mask_id, dtype=torch.long)], dim=1)
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask, torch.ones(B, gen_length, dtype=attention_mask.dtype)], dim=1)
    is_prompt = x != mask_id
    n_blocks = gen_length // block_length
    per_block = steps // n_blocks
    for blk in range(n_blocks):
        lo, hi = Lp + blk * block_length, Lp + (blk + 1) * block_length
        k_sched = num_transfer_tokens(x[:, lo:hi] == mask_id, per_block)
        for i in range(per_block):
            masked = x == mask_id
            if cfg_scale > 0:
                uncond = x.clone()
                uncond[is_prompt] = mask_id
                am = None if attention_mask is None else torch.cat([attention_mask, attention_mask])
                both = logits_fn(torch.cat([x, uncond]), am)
                cond, un = both[:B], both[B:]
                logits = un + (cfg_scale + 1) * (cond - un)
            else:
                logits = logits_fn(x, attention_mask)
            pred = logits.argmax(-1)
            prob = torch.softmax(logits, dim=-1).gather(-1, pred[..., None]).squeeze(-1)
            prob[:, hi:] = float("-inf")
            pred = torch.where(masked, pred, x)
            conf = torch.where(masked, prob, torch.tensor(float("-inf")))
            for b in range(B):
                chosen = torch.topk(conf[b], int(k_sched[b, i])).indices
                x[b, chosen] = pred[b, chosen]
    return x
