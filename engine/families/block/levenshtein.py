"""LLaDA2.2's joint decode of one block: masks filled, tokens rewritten, positions deleted or split.

As its model card's `generate` -> `_joint_decode_block` lays it out (batch 1, temperature 0 by
default), one step of a block, from the block's tokens and one forward's logits:

1. Bookkeeping: `post_steps` counts the steps begun with no *original* mask left (a mask the block
   held on entry; masks an edit opens are new) and resets to 0 while one remains.
2. x0 and p: the argmax and its softmax probability (float32), or a sample at a temperature.
3. Mask-to-token: every mask with p > threshold, unless fewer than `schedule[step] + new masks`
   clear it (the schedule spreads the block's original masks over `steps` steps), then that many
   most confident masks; from step `steps` on, every mask.
4. Token-to-token: every written position (never the prompt's) whose x0 differs, p > editing
   threshold. x0 may be DELETE or SPLIT, two ordinary vocabulary ids of the checkpoint.
5. The final round: when this step leaves no original mask and the budget would then be spent
   (`post_steps + 1 > max_post_steps`), every mask is filled and a chosen DELETE or SPLIT is
   replaced by the best other token, so the block ends resolved.
6. Anti-loop: when the written block (before edits are consumed) is one the block already held
   after an earlier step, a changed position is drawn and re-picked without its current token,
   up to 5 times, until the block is new (never on a final round).
7. Edits are consumed left to right: DELETE drops its position, SPLIT becomes a mask and the
   position's previous token; the block is cut, or padded with masks, to its fixed length. The
   original-mask flags travel with their tokens; inserted and padded masks are new.
8. The block ends when a step changed nothing and left no mask, when no mask is left and the
   budget is spent (the reference checks this before its next forward: here it is known after
   this step), or at the hard cap of steps.

Where Celeris differs, and why:
- The anti-loop draw: the reference draws the position with torch.randint from the process's
  global generator, so no run can be repeated. Celeris draws it uniformly from the changed
  positions too, with a generator keyed by the request's seed, the block and the step: the same
  request decodes the same alone or in any batch, and a run can be replayed from its seed.
- The hard cap: the reference stops with masks left; Celeris makes the capped step a final round,
  so a block never ends with a mask or an edit token in it.
- The prompt's tokens that share the first block are never edited, deleted or moved (the
  reference consumes a literal DELETE or SPLIT id there; here the prompt is opaque input).

In the block runner (`joint_results`): a row runs it when its checkpoint names edit tokens
(ModelConfig.delete_token_id, split_token_id) and it edits (an editing threshold, no structured
output: a skeleton's tokens are never moved). Each row's step runs on the host over its own
block's logits, as the reference runs it: its tokens depend on its own logits and seed only, the
same alone and in any batch. The new block is written into the runner's token row (the next
forward reads it) and reported as the positions it changed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from celeris.engine.loop.runner_api import RowResult

MAX_STEPS_PER_BLOCK = 1000  # the reference's hard cap of steps on one block
ESCAPE_TRIES = 5  # the reference's anti-loop re-picks per step


@dataclass(frozen=True)
class EditIds:
    mask: int
    delete: int
    split: int


@dataclass(frozen=True)
class JointKnobs:
    """One request's knobs of the joint decode (SamplingParams' names)."""

    threshold: float = 0.5
    editing_threshold: float = 0.0
    steps: int = 32  # the mask-to-token schedule's length, per block
    max_post_steps: int = 16
    temperature: float = 0.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: int = 0
    max_steps: int = MAX_STEPS_PER_BLOCK


@dataclass
class JointBlock:
    """One request's state over the block it decodes (a new one per block)."""

    index: int  # the block's absolute index (keys the draws)
    original: list[bool]  # per position: holds (or held) a mask the block had on entry
    schedule: list[int]  # masks to fill per step, over the block's original masks
    step: int = 0
    post_steps: int = 0
    seen: set[tuple[int, ...]] = field(default_factory=set)
    done: bool = False
    escapes: int = 0  # anti-loop re-picks so far (reported)

    @classmethod
    def enter(cls, index: int, tokens: list[int], mask: int, steps: int) -> "JointBlock":
        original = [t == mask for t in tokens]
        return cls(index, original, spread(sum(original), steps))


@dataclass(frozen=True)
class JointStep:
    tokens: list[int]  # the block after the step, edits consumed
    confidence: list[float]  # per position: p of the token written there this step (0 elsewhere)
    done: bool


def spread(masks: int, steps: int) -> list[int]:
    """`masks` over `steps` steps, evenly, the remainder first."""
    base, rem = divmod(masks, max(steps, 1))
    return [base + (1 if s < rem else 0) for s in range(max(steps, 1))]


def consume_edits(written: list[int], before: list[int], original: list[bool], ids: EditIds,
                  protected: int = 0) -> tuple[list[int], list[bool]]:
    """DELETE and SPLIT consumed left to right; the first `protected` positions (the prompt's)
    pass as they are. -> (tokens, original-mask flags), both the block's length."""
    L = len(written)
    tokens, flags = list(written[:protected]), list(original[:protected])
    for i in range(protected, L):
        if written[i] == ids.delete:
            continue
        if written[i] == ids.split:  # a new mask, then the position's previous token
            tokens += [ids.mask, before[i]]
            flags += [False, original[i]]
        else:
            tokens.append(written[i])
            flags.append(original[i])
    pad = L - len(tokens)
    return (tokens + [ids.mask] * pad)[:L], (flags + [False] * pad)[:L]


def _draw(knobs: JointKnobs, block: int, step: int, what: int) -> random.Random:
    """The generator of one draw, keyed by the request's seed and where it is made."""
    return random.Random(f"llada2.2:{knobs.seed}:{block}:{step}:{what}")


def _probs(logits: torch.Tensor, knobs: JointKnobs) -> torch.Tensor:
    """(L, V) logits -> (L, V) float32 probabilities to pick from (temperature, top-k, top-p)."""
    x = logits.float()
    if knobs.temperature > 0:
        x = x / knobs.temperature
        if knobs.top_k:
            kth = x.topk(min(knobs.top_k, x.shape[-1]), dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if knobs.top_p is not None and knobs.top_p < 1:
            srt, order = x.sort(dim=-1, descending=True)
            cut = srt.softmax(-1).cumsum(-1) - srt.softmax(-1) > knobs.top_p  # keep the first over top_p
            x = x.masked_fill(torch.zeros_like(cut).scatter(-1, order, cut), float("-inf"))
    return torch.softmax(x, dim=-1)


def _pick(probs: torch.Tensor, knobs: JointKnobs, rng: random.Random) -> torch.Tensor:
    """(L, V) -> (L,) token ids: the argmax at temperature 0, else one sample per row."""
    if knobs.temperature <= 0:
        return probs.argmax(dim=-1)
    g = torch.Generator().manual_seed(rng.getrandbits(63))
    return torch.multinomial(probs.cpu(), 1, generator=g)[:, 0].to(probs.device)


def joint_step(logits: torch.Tensor, tokens: list[int], state: JointBlock, knobs: JointKnobs, ids: EditIds,
               protected: int = 0) -> JointStep:
    """One step of the block (module doc). logits (L, V) of the block's positions; the first
    `protected` positions are the prompt's."""
    L = len(tokens)
    probs = _probs(logits, knobs)  # (L, V)
    x0 = _pick(probs, knobs, _draw(knobs, state.index, state.step, 0))
    p = probs.gather(1, x0[:, None])[:, 0]
    before = torch.tensor(tokens, device=logits.device)
    masked = before == ids.mask
    original = torch.tensor(state.original, device=logits.device)
    originals_left = int((masked & original).sum())
    state.post_steps = 0 if originals_left else state.post_steps + 1
    fill = _fill(masked, original, p, state, knobs)
    editable = ~masked & (torch.arange(L, device=logits.device) >= protected)
    edit = editable & (p > knobs.editing_threshold) & (x0 != before)
    last = state.step + 1 >= knobs.max_steps
    final = last or (not bool((masked & original & ~fill).any()) and state.post_steps + 1 > knobs.max_post_steps)
    if final:
        fill = masked.clone()
        x0 = _no_edit_tokens(x0, probs, fill | edit, knobs, ids, _draw(knobs, state.index, state.step, 1))
    chosen = fill | edit
    written = torch.where(chosen, x0, before).tolist()
    if not final and tuple(written) in state.seen:
        _escape(written, tokens, probs, state, knobs)
    state.seen.add(tuple(written))
    if any(t in (ids.delete, ids.split) for t in written[protected:]):
        new, state.original = consume_edits(written, tokens, state.original, ids, protected)
    else:
        new = written
    state.step += 1
    left = ids.mask in new
    no_originals = not any(t == ids.mask and o for t, o in zip(new, state.original))
    spent = no_originals and state.post_steps + 1 > knobs.max_post_steps
    state.done = (not left and (new == tokens or spent)) or last
    conf = torch.where(chosen, p, torch.zeros_like(p)).tolist()
    return JointStep(new, conf, state.done)


def _fill(masked: torch.Tensor, original: torch.Tensor, p: torch.Tensor, state: JointBlock,
          knobs: JointKnobs) -> torch.Tensor:
    """Mask-to-token: the threshold's picks, at least the schedule's count plus the new masks."""
    n = int(masked.sum())
    if not n:
        return masked
    if state.step >= len(state.schedule):
        return masked.clone()
    conf = torch.where(masked, p, torch.full_like(p, float("-inf")))
    need = state.schedule[state.step] + n - int((masked & original).sum())
    high = (conf > knobs.threshold) & masked
    if int(high.sum()) >= need:
        return high
    out = torch.zeros_like(masked)
    out[conf.topk(min(need, n)).indices] = True
    return out


def _no_edit_tokens(x0: torch.Tensor, probs: torch.Tensor, chosen: torch.Tensor, knobs: JointKnobs, ids: EditIds,
                    rng: random.Random) -> torch.Tensor:
    """The final round's picks with DELETE and SPLIT re-picked among the other tokens."""
    bad = chosen & ((x0 == ids.delete) | (x0 == ids.split))
    if not bool(bad.any()):
        return x0
    rows = probs[bad].clone()
    rows[:, [ids.delete, ids.split]] = 0
    x0 = x0.clone()
    x0[bad] = _pick(rows / rows.sum(-1, keepdim=True), knobs, rng)
    return x0


def _escape(written: list[int], before: list[int], probs: torch.Tensor, state: JointBlock,
            knobs: JointKnobs) -> None:
    """Anti-loop (module doc, item 6), in place on `written`."""
    for attempt in range(ESCAPE_TRIES):
        changed = [i for i, (a, b) in enumerate(zip(written, before)) if a != b]
        if not changed:
            return
        rng = _draw(knobs, state.index, state.step, 2 + attempt)
        i = changed[rng.randrange(len(changed))]
        row = probs[i:i + 1].clone()
        row[0, written[i]] = 0
        written[i] = int(_pick(row / row.sum(), knobs, rng)[0])
        state.escapes += 1
        if tuple(written) not in state.seen:
            return


# ------------------------------------------------------------------ in the block runner


def edit_ids(cfg: Any, seq: Any) -> Optional[EditIds]:
    """The edit ids a request decodes with, or None (its family's plain rule)."""
    if getattr(cfg, "delete_token_id", -1) < 0 or not seq.editing:
        return None
    return EditIds(cfg.mask_token_id, cfg.delete_token_id, cfg.split_token_id)


def knobs(p: Any) -> JointKnobs:
    """A request's SamplingParams as the joint decode reads them (no threshold: never)."""
    return JointKnobs(threshold=math.inf if p.threshold is None else p.threshold,
                      editing_threshold=p.editing_threshold, steps=p.steps_per_block,
                      max_post_steps=p.max_post_steps, temperature=p.temperature, top_k=p.top_k or None,
                      top_p=p.top_p, seed=p.seed or 0)


def joint_results(rows: Sequence[Any], logits: torch.Tensor, ids: torch.Tensor,
                  tokens: torch.Tensor) -> list[RowResult]:
    """One joint step per row: logits (R, W, V) and ids (R, W) of the rows' blocks (columns from
    the block's first); each row's new block is written into `tokens` (slots, max_len)."""
    out = []
    for r, s in enumerate(rows):
        a, e = s.block_window
        before = ids[r, :e - a].tolist()
        if s.joint is None or s.joint.index != s.block:
            s.joint = JointBlock.enter(s.block, before, s.joint_ids.mask, s.params.steps_per_block)
        step = joint_step(logits[r, :e - a], before, s.joint, knobs(s.params), s.joint_ids,
                          protected=max(0, len(s.prompt) - a))
        tokens[s.slot, a:e] = torch.tensor(step.tokens, dtype=tokens.dtype, device=tokens.device)
        changed = [i for i, (t, u) in enumerate(zip(before, step.tokens)) if t != u]
        out.append(RowResult(changed, [step.tokens[i] for i in changed], [step.confidence[i] for i in changed]))
    return out
