"""LLaDA2.2 as the tests' reference: its config keys, its gate, and a tiny folder of its format.

LLaDA2.2 (inclusionAI LLaDA2.2-flash) keeps LLaDA2.1's architecture name, tensor names and
layout; its config.json adds `block_size` 32 and `expert_capacity` 48 (the block-routed gate) and
`delete_token_id` / `split_token_id` (156930 / 156931 on flash: ordinary vocabulary ids its loop
may write), and its generation_config.json lists two stop ids. The released gate, as its model
card's modeling file describes it: scores = sigmoid(h W^T) in float32 plus expert_bias; over each
`block_size` tokens (the flattened batch-1 window, whose length the reference asserts is a
multiple of it) every expert scores its best token score; the block keeps its top
`expert_capacity` experts, each token its top-k among them; weights are the unbiased scores,
normalised and scaled as in LLaDA2.0. Transcribed here in plain torch, independently of
engine/models/moe.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.unit.block_references.checkpoints import EOS_ID, write_llada2_checkpoint
from tests.unit.block_references.modeling import LLaDA2Model, block_causal_mask

# The tiny checkpoints' edit ids: ordinary ids of the vocabulary (as 156930/156931 are on flash),
# and a second stop id (flash lists <|endoftext|> and <|role_end|>).
DELETE_ID, SPLIT_ID, ROLE_END_ID = 1000, 1001, 1002
LLADA22_KEYS = dict(block_size=32, expert_capacity=4, delete_token_id=DELETE_ID, split_token_id=SPLIT_ID,
                    num_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, use_qk_norm=True)


def block_routed_gate(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, block: int, capacity: int,
                      top_k: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """h (N, D) -> expert ids (N, k), float32 weights (N, k), as the released gate."""
    scores = torch.sigmoid(F.linear(h.float(), weight.float()))
    choice = scores + bias.float()
    N, E = choice.shape
    assert N % block == 0, "the released gate asserts a block-aligned window"
    per_block = choice.view(N // block, block, E).max(dim=1).values
    allowed = torch.zeros(N // block, E, dtype=torch.bool)
    allowed[torch.arange(N // block)[:, None], per_block.topk(capacity, dim=-1).indices] = True
    allowed = allowed.repeat_interleave(block, dim=0)
    idx = choice.masked_fill(~allowed, float("-inf")).topk(top_k, dim=-1).indices
    w = scores.gather(1, idx)
    if top_k > 1:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return idx, w * scaling


class LLaDA22Model(LLaDA2Model):
    """The reference LLaDA2 model with the released block-routed gate."""

    def route(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = f"model.layers.{i}.mlp.gate"
        c = self.cfg
        return block_routed_gate(h, self.w[f"{p}.weight"], self.w[f"{p}.expert_bias"], c["block_size"],
                                 c["expert_capacity"], self.top_k, self.scaling)


def write_llada22_checkpoint(folder: Path, seed: int = 0, edit_scale: float = 1.0, **overrides) -> Path:
    """A random LLaDA2.2-format folder: LLaDA2's tensors, LLaDA2.2's config keys, two stop ids.
    `edit_scale` scales the output head's DELETE and SPLIT rows, so a random model writes them."""
    folder = write_llada2_checkpoint(folder, seed, torch.float32, **(LLADA22_KEYS | overrides))
    if edit_scale != 1.0:
        tensors = load_file(str(folder / "model.safetensors"))
        tensors["lm_head.weight"][[DELETE_ID, SPLIT_ID]] *= edit_scale
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    gen = json.loads((folder / "generation_config.json").read_text())
    gen["eos_token_id"] = [EOS_ID, ROLE_END_ID]
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return folder


# ------------------------------------------------------------------ the joint decode, as published


class JointResult(NamedTuple):
    forwards: int  # forwards run on the block
    escapes: int  # anti-loop re-picks (0: the random draw never ran)
    edit_ops: int  # DELETE and SPLIT tokens consumed


def _consume(written: list[int], before: list[int], original: list[bool], mask: int, delete: int,
             split: int) -> tuple[list[int], list[bool]]:
    """`_apply_edit_operations_with_tracking` as described: a scan left to right; DELETE drops its
    position, SPLIT expands to [mask, the position's pre-step token]; then cut or mask-padded to
    the block's length; inserted and padded masks are not original."""
    toks, flags = [], []
    for t, old, o in zip(written, before, original):
        if t == delete:
            continue
        if t == split:
            toks.extend([mask, old])
            flags.extend([False, o])
        else:
            toks.append(t)
            flags.append(o)
    n = len(written)
    while len(toks) < n:
        toks.append(mask)
        flags.append(False)
    return toks[:n], flags[:n]


def joint_decode_block(block_logits: Callable[[torch.Tensor, int], torch.Tensor], x: torch.Tensor, lo: int,
                       hi: int, *, steps: int, threshold: float, editing_threshold: float, max_post_steps: int,
                       mask: int, delete: int, split: int, max_steps_per_block: int = 1000,
                       draw: Optional[Callable[[list[int]], int]] = None) -> JointResult:
    """`_joint_decode_block` at temperature 0 (batch 1), written from its published description,
    in place on x (1-D): the loop's shape is the reference's (budget checked at the top of an
    iteration, before its forward). `block_logits(x, hi)` -> the block's (hi - lo, V) logits.
    `draw(changed positions)` stands for its torch.randint (None: it must never choose among
    several positions; with one the choice is forced)."""
    b = hi - lo
    entry = x[lo:hi].clone()
    prompt = entry != mask  # the reference's prompt: what is not a mask on entry
    original = (entry == mask).tolist()
    n0 = sum(original)
    schedule = [n0 // steps + (1 if s < n0 % steps else 0) for s in range(steps)]
    post_steps = forwards = escapes = edit_ops = 0
    seen: set[tuple[int, ...]] = set()
    for step in range(max_steps_per_block):
        block = x[lo:hi].clone()
        masked = block == mask
        orig_left = int((masked & torch.tensor(original)).sum())
        post_steps = post_steps + 1 if orig_left == 0 else 0
        if not masked.any() and post_steps > max_post_steps:
            break
        logits = block_logits(x, hi)
        forwards += 1
        probs = torch.softmax(logits.float(), dim=-1)
        p, x0 = probs.max(dim=-1)
        fill = torch.zeros(b, dtype=torch.bool)
        if masked.any():
            conf = torch.where(masked, p, torch.tensor(float("-inf")))
            if step >= steps:
                fill = masked.clone()
            else:
                need = schedule[step] + int(masked.sum()) - orig_left
                high = (conf > threshold) & masked
                if int(high.sum()) >= need:
                    fill = high
                else:
                    fill[conf.topk(min(need, int(masked.sum()))).indices] = True
        edit = ~masked & ~prompt & (p > editing_threshold) & (x0 != block)
        originals_unfilled = bool((masked & torch.tensor(original) & ~fill).any())
        final = not originals_unfilled and post_steps + 1 > max_post_steps
        if final:  # the last round: resolve every mask, write no edit token
            fill = masked.clone()
            for i in range(b):
                if (fill[i] or edit[i]) and int(x0[i]) in (delete, split):
                    row = logits[i].float().clone()
                    row[[delete, split]] = float("-inf")
                    x0[i] = row.argmax()
        written = torch.where(fill | edit, x0, block).tolist()
        if not final and tuple(written) in seen:
            for _ in range(5):
                changed = [i for i in range(b) if written[i] != int(block[i])]
                if not changed:
                    break
                if len(changed) > 1:  # torch.randint over the changed positions
                    assert draw is not None, "the anti-loop drew among several positions"
                i = changed[draw(changed)] if len(changed) > 1 else changed[0]
                row = logits[i].float().clone()
                row[written[i]] = float("-inf")
                written[i] = int(torch.softmax(row, -1).argmax())
                escapes += 1
                if tuple(written) not in seen:
                    break
        seen.add(tuple(written))
        edit_ops += sum(t in (delete, split) for t in written)
        new, original = _consume(written, block.tolist(), original, mask, delete, split)
        x[lo:hi] = torch.tensor(new)
        if mask not in new and new == block.tolist():
            break
    return JointResult(forwards, escapes, edit_ops)


class Llada22Result(NamedTuple):
    ids: list[int]  # x[P : P + gen_length] cut after the first stop id, as published
    forwards: int
    blocks: int
    escapes: int
    edit_ops: int


@torch.no_grad()
def llada22_generate(model: LLaDA22Model, prompt_ids: Sequence[int], gen_length: int, block_length: int = 32,
                     steps: int = 32, threshold: float = 0.5, editing_threshold: float = 0.0,
                     max_post_steps: int = 16, mask_id: int = 3, eos_ids: tuple[int, ...] = (EOS_ID,),
                     draw: Optional[Callable[[list[int]], int]] = None) -> Llada22Result:
    """LLaDA2.2's generate at temperature 0 (batch 1): LLaDA2.0's canvas and block alignment, each
    block by `joint_decode_block` over the window x[:end] recomputed block-causally every forward;
    after a block with no mask left in the generated part and a stop id in it, the loop stops."""
    P, b = len(prompt_ids), block_length
    num_blocks = (P + gen_length + b - 1) // b
    x = torch.full((num_blocks * b,), mask_id, dtype=torch.long)
    x[:P] = torch.tensor(list(prompt_ids), dtype=torch.long)
    forwards = blocks = escapes = edit_ops = 0
    c = model.cfg

    def block_logits(x: torch.Tensor, hi: int) -> torch.Tensor:
        logits, _ = model.forward(x[None, :hi], torch.arange(hi), None, block_causal_mask(0, hi, hi, b))
        return logits[0, -b:]

    for blk in range(P // b, num_blocks):
        lo, hi = blk * b, (blk + 1) * b
        r = joint_decode_block(block_logits, x, lo, hi, steps=steps, threshold=threshold,
                               editing_threshold=editing_threshold, max_post_steps=max_post_steps, mask=mask_id,
                               delete=c["delete_token_id"], split=c["split_token_id"], draw=draw)
        forwards, escapes, blocks = forwards + r.forwards, escapes + r.escapes, blocks + 1
        edit_ops += r.edit_ops
        gen = x[P:hi].tolist()
        if mask_id not in gen and any(t in eos_ids for t in gen):
            break
    out = x[P:P + gen_length].tolist()
    stop = next((i for i, t in enumerate(out) if t in eos_ids), None)
    return Llada22Result(out if stop is None else out[:stop + 1], forwards, blocks, escapes, edit_ops)
