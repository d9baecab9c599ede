"""The published block-diffusion reverse loops, at temperature 0, over `modeling.BlockModel`.

SDAR (JetAstra/SDAR `generate.py::block_diffusion_generate`, and the evaluation copy
`evaluation/opencompass/opencompass/models/huggingface_bd3.py`):
  canvas = ceil((P + G) / b) * b positions (so up to b-1 more than G are generated); the prompt's
  whole blocks (P // b of them) are prefilled block-causally and cached; decoding starts at block
  P // b, whose first P % b positions are prompt tokens (never masked, so never chosen). Per block,
  up to steps+1 iterations: if the block has no mask left, one more forward of the final block
  over the cache stores its keys/values and the block ends; otherwise one forward of the block
  (bidirectional inside, all of the cache visible), x0 = argmax, p = softmax prob of x0,
  confidence = p at masked positions, -inf elsewhere, and k = schedule[step] with
  schedule = [b // S + (1 if s < b % S else 0) for s in range(S)]:
    low_confidence_static: commit the top-k confidences;
    low_confidence_dynamic: commit every position with confidence > threshold (strict) if there
      are at least k of them, else the top-k;
    sequential: commit positions [first mask, first mask + k).
  After a block, stop if any stop id appears anywhere in x[P:].
LLaDA2 (inclusionAI `modeling_llada2_moe.py::LLaDA2MoeModelLM.generate`): the same canvas and
  alignment, the dynamic rule with k clipped to the masked count, no extra store step (the
  published loop recomputes the whole window each step; here `use_cache` runs the mathematically
  identical cached form), EOS = one id, output trimmed to G and cut after the first EOS.

Temperature 0: LLaDA2's published sampler takes x0 = argmax and p = softmax(logits)[x0]. SDAR's
published samplers have no temperature-0 path (generate.py divides by the temperature, the
evaluation copy asserts it is > 0); the same greedy rule is used here for both.
Checked once, outside the suite, in float32 on these tiny checkpoints: both loops returned the
published code's tokens exactly (SDAR generate.py with its sampler swapped for the greedy rule;
LLaDA2 generate() with its bfloat16 mask cast changed to float32, which SDPA needs in float32).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from tests.unit.block_references.modeling import KV, BlockModel, block_causal_mask


class BlockGenResult(NamedTuple):
    ids: list[int]  # the published return region (see each function)
    forwards: int  # every model forward, prefill and KV-store passes included
    denoise_forwards: int  # forwards whose logits chose tokens
    blocks: int  # blocks decoded (committed) after the prompt's whole blocks


def transfer_schedule(block_length: int, steps: int) -> list[int]:
    """Tokens to commit at each step of a block: block_length split evenly, remainder first."""
    if steps <= 0:
        return []
    base, rem = divmod(block_length, steps)
    return [base + (1 if s < rem else 0) for s in range(steps)]


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature 0: x0 = argmax, p = its softmax probability (float32). (L, V) -> (L,), (L,)."""
    probs = torch.softmax(logits.float(), dim=-1)
    p, x0 = probs.max(dim=-1)
    return x0, p


def _cat(cache: Optional[KV], fresh: KV) -> KV:
    if cache is None:
        return fresh
    return [(torch.cat([k0, k1], dim=2), torch.cat([v0, v1], dim=2)) for (k0, v0), (k1, v1) in zip(cache, fresh)]


def _topk(conf: torch.Tensor, k: int) -> torch.Tensor:
    sel = torch.zeros_like(conf, dtype=torch.bool)
    if k > 0:
        sel[torch.topk(conf, k).indices] = True
    return sel


def _prefill(model: BlockModel, x: torch.Tensor, n: int, block_length: int) -> Optional[KV]:
    if n == 0:
        return None
    _, kv = model.forward(x[None, :n], torch.arange(n), None, block_causal_mask(0, n, n, block_length))
    return kv


@torch.no_grad()
def sdar_generate(model: BlockModel, prompt_ids: Sequence[int], gen_length: int, block_length: int,
                  denoising_steps: int, remasking: str = "low_confidence_dynamic", threshold: Optional[float] = 0.85,
                  mask_id: int = 3, stop_ids: Optional[Sequence[int]] = None,
                  overwrite_unmasked: bool = False) -> BlockGenResult:
    """SDAR's block_diffusion_generate at temperature 0 (batch 1).

    Returns ids = x[P:] of the whole canvas as published (total - P positions: blocks after a stop
    stay mask_id, tokens after the stop id are kept; the caller cuts at the first stop id).
    overwrite_unmasked=False follows the evaluation copy, where a top-k that must reach past the
    masked positions (fewer masks left than k) re-writes an unmasked position with its own token
    (x0 = where(mask, x0, x)), i.e. commits min(k, masks). True follows generate.py literally:
    those positions get the argmax token, chosen by torch.topk among -inf ties (not reproducible
    by another implementation; do not test an engine against it).
    """
    if remasking == "low_confidence_dynamic" and threshold is None:
        raise ValueError("low_confidence_dynamic needs a threshold")
    P = len(prompt_ids)
    num_blocks = (P + gen_length + block_length - 1) // block_length
    x = torch.full((num_blocks * block_length,), mask_id, dtype=torch.long)
    x[:P] = torch.tensor(list(prompt_ids), dtype=torch.long)
    start0 = model.forwards
    prefill_blocks = P // block_length
    cache = _prefill(model, x, prefill_blocks * block_length, block_length)
    schedule = transfer_schedule(block_length, denoising_steps)
    denoise = blocks = 0
    for blk in range(prefill_blocks, num_blocks):
        lo, hi = blk * block_length, (blk + 1) * block_length
        cur = x[lo:hi].clone()
        positions = torch.arange(lo, hi)
        for step in range(denoising_steps + 1):
            masked = cur == mask_id
            if not masked.any():  # block complete: one more forward stores its keys/values
                _, fresh = model.forward(cur[None], positions, cache, None)
                cache = _cat(cache, fresh)
                break
            logits, _ = model.forward(cur[None], positions, cache, None)  # sees the whole cache and block
            denoise += 1
            x0, p = greedy(logits[0])
            if not overwrite_unmasked:
                x0 = torch.where(masked, x0, cur)
            k = schedule[step]
            conf = torch.where(masked, p, torch.tensor(float("-inf")))
            if remasking == "sequential":
                sel = torch.zeros_like(masked)
                first = int(masked.nonzero()[0])
                sel[first:first + k] = True
            elif remasking == "low_confidence_static":
                sel = _topk(conf, k)
            elif remasking == "low_confidence_dynamic":
                high = conf > threshold
                sel = high if int(high.sum()) >= k else _topk(conf, k)
            else:
                raise ValueError(f"unknown remasking strategy {remasking!r}")
            cur[sel] = x0[sel]
        else:
            raise AssertionError("block not complete after steps+1 iterations")
        x[lo:hi] = cur
        blocks += 1
        if stop_ids is not None and any(bool((x[P:] == s).any()) for s in stop_ids):
            break
    return BlockGenResult(x[P:].tolist(), model.forwards - start0, denoise, blocks)


@torch.no_grad()
def llada2_generate(model: BlockModel, prompt_ids: Sequence[int], gen_length: int, block_length: int = 32,
                    steps: int = 32, threshold: float = 0.95, mask_id: int = 3, eos_id: Optional[int] = 2,
                    minimal_topk: int = 1, use_cache: bool = True) -> BlockGenResult:
    """LLaDA2MoeModelLM.generate at temperature 0 (batch 1, eos_early_stop=False).

    Returns ids = x[P : P + gen_length] cut after the first eos_id (the EOS included), as published.
    use_cache=False recomputes the window x[:end] block-causally at every step, exactly as the
    published loop; use_cache=True prefills the prompt's whole blocks, runs each step on the
    current block over cached keys/values, and after a block completes runs it once more to store
    its keys/values (one extra forward per block; the chosen tokens are the same).
    """
    steps = min(steps, gen_length // minimal_topk)
    P = len(prompt_ids)
    num_blocks = (P + gen_length + block_length - 1) // block_length
    x = torch.full((num_blocks * block_length,), mask_id, dtype=torch.long)
    x[:P] = torch.tensor(list(prompt_ids), dtype=torch.long)
    start0 = model.forwards
    prefill_blocks = P // block_length
    cache = _prefill(model, x, prefill_blocks * block_length, block_length) if use_cache else None
    schedule = transfer_schedule(block_length, steps)
    denoise = blocks = 0
    for blk in range(prefill_blocks, num_blocks):
        lo, hi = blk * block_length, (blk + 1) * block_length
        for step in range(steps):
            active = x[lo:hi] == mask_id
            if not active.any():
                break
            if use_cache:
                logits, _ = model.forward(x[None, lo:hi], torch.arange(lo, hi), cache, None)
            else:
                window_mask = block_causal_mask(0, hi, hi, block_length)  # the whole window, recomputed
                logits, _ = model.forward(x[None, :hi], torch.arange(hi), None, window_mask)
            denoise += 1
            x0, p = greedy(logits[0, -block_length:])
            k = schedule[step]
            conf = torch.where(active, p, torch.tensor(float("-inf")))
            high = conf > threshold
            sel = high if int(high.sum()) >= k else _topk(conf, min(k, int(active.sum())))
            x[lo:hi][sel] = x0[sel]
        if use_cache:
            _, fresh = model.forward(x[None, lo:hi], torch.arange(lo, hi), cache, None)
            cache = _cat(cache, fresh)
        blocks += 1
        if eos_id is not None and bool((x[P:hi] == eos_id).any()):
            break
    gen = x[P:P + gen_length].tolist()
    if eos_id is not None and eos_id in gen:
        gen = gen[: gen.index(eos_id) + 1]
    return BlockGenResult(gen, model.forwards - start0, denoise, blocks)


class EditGenResult(NamedTuple):
    ids: list[int]  # x[P : P + gen_length] cut after the first eos_id, as published
    forwards: int  # denoising forwards (the published loop recomputes the window each time)
    blocks: int
    filled: int  # masks filled
    edits: int  # written tokens replaced
    post_forwards: int  # forwards run on a block with no mask left


@torch.no_grad()
def llada21_generate(model: BlockModel, prompt_ids: Sequence[int], gen_length: int, block_length: int = 32,
                     threshold: float = 0.95, editing_threshold: float = 0.9, max_post_steps: int = 16,
                     num_to_transfer: int = 1, mask_id: int = 3, eos_id: Optional[int] = 2) -> EditGenResult:
    """LLaDA2.1's LLaDA2MoeModelLM.generate at temperature 0 (batch 1), written from its published
    description (inclusionAI/LLaDA2.1-mini `modeling_llada2_moe.py`):

    The canvas and block alignment are LLaDA2.0's. Each block loops with no step limit (the
    `steps` argument is computed and never used). An iteration starts by noting the block's
    tokens and its masks; if it has none it is a post step, and the block ends before the forward
    once more than max_post_steps post steps were counted. One forward of the window x[:end]
    (block-causal, recomputed: the published file's 0/1 mask is added to the scores unconverted,
    which masks nothing; this reference uses 0/-inf, as LLaDA2.0's file does, see
    docs/revising-models.md) gives x0 = argmax and p = its softmax probability. Masks filled:
    every mask with p > threshold if at least num_to_transfer of them, else the top
    min(num_to_transfer, masks) by p. Tokens edited (the same forward): every position of the
    block that was not a mask at the start of the iteration and is not a prompt token, whose x0
    differs from its token and whose p > editing_threshold. Both are written; the block ends when
    the iteration started with no mask and edited nothing. After a block, with no mask left in
    the generated part and an EOS in it, the loop stops (eos_early_stop; the output is the same
    without it: a finished block never changes). The output is cut after the first EOS.

    Written from public verbatim copies and transcriptions of the published file, which agree on
    every rule above; test_block_references ties it to the LLaDA2.0 loop (checked against the
    published code) where the two must agree. The engine itself is checked against the published
    file (scripts/check_llada21_parity.py: identical with its mask as intended, docs/revising-models.md).
    """
    P = len(prompt_ids)
    b = block_length
    num_blocks = (P + gen_length + b - 1) // b
    x = torch.full((num_blocks * b,), mask_id, dtype=torch.long)
    x[:P] = torch.tensor(list(prompt_ids), dtype=torch.long)
    forwards = blocks = filled = edits = post = 0
    for blk in range(P // b, num_blocks):
        lo, hi = blk * b, (blk + 1) * b
        in_prompt = torch.arange(lo, hi) < P
        post_steps = 0
        while True:
            before = x[lo:hi].clone()
            masked = before == mask_id
            if not masked.any():
                post_steps += 1
                if post_steps > max_post_steps:
                    break
                post += 1
            logits, _ = model.forward(x[None, :hi], torch.arange(hi), None, block_causal_mask(0, hi, hi, b))
            forwards += 1
            x0, p = greedy(logits[0, -b:])
            fill = torch.zeros(b, dtype=torch.bool)
            if masked.any():
                conf = torch.where(masked, p, torch.tensor(float("-inf")))
                high = (conf > threshold) & masked
                fill = high if int(high.sum()) >= num_to_transfer else _topk(conf, min(num_to_transfer,
                                                                                       int(masked.sum())))
            edit = ~masked & ~in_prompt & (p > editing_threshold) & (x0 != before)
            x[lo:hi] = torch.where(fill | edit, x0, before)
            filled, edits = filled + int(fill.sum()), edits + int(edit.sum())
            if not masked.any() and not edit.any():
                break
        blocks += 1
        gen = x[P:hi]
        if eos_id is not None and not (gen == mask_id).any() and bool((gen == eos_id).any()):
            break
    out = x[P:P + gen_length].tolist()
    if eos_id is not None and eos_id in out:
        out = out[: out.index(eos_id) + 1]
    return EditGenResult(out, forwards, blocks, filled, edits, post)
