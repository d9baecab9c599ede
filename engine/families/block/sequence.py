"""Per-request state of a block-diffusion request (SDAR, LLaDA2), in plain Python.

The canvas grows one block at a time over an exact KV cache. As the published loops lay it
out, positions are absolute from the prompt's first token and blocks are aligned to them: the
prompt's whole blocks are prefilled (block-causally, in chunks), and decoding starts at block
P // b, whose first P % b positions are the prompt's tail. A mask token there is filled like any
mask, as both published loops do (their block's masks are `x[block] == mask_id`, prompt tail
included), and kept in the runner's token row, never in the output; a mask token in the prompt's
whole blocks stays as it is (those blocks are only prefilled). So
ceil((P + G) / b) * b - P positions are decoded, up to b - 1 more than gen_length G; the
output is the first G. Each request moves through phases, one forward each:

  prefill (the next chunk of whole prompt blocks) -> denoise (the current block, until no mask
  is left) -> store (the finished block's keys/values written to the cache) -> denoise ...

A block that finishes the request (a stop token, or the last block) is not stored. Where the
runner fuses (`fuse_first_block`, its per-row path), the prefill step of the prompt's last chunk
is also the first block's first denoise step (`joins_decode`): one forward, counted as a denoise
step, so its noise and every token are those of the unfused order.

LLaDA2.1 (token editing, `edits`): each denoise step also replaces written tokens of the block
(never the prompt's tail) where the model's pick differs with probability > editing_threshold;
once the block has no mask left it runs up to max_post_steps more steps while edits go on, and
ends at the first step that edits nothing. Such a post step writes the block's keys/values, so a
block that ends on an edit-free step needs no store step. Every step commits at least
num_to_transfer masks: its published name for the block split over its steps, rounded up.
The published loop has no step limit: an edit may write the mask token back, so edits that keep
re-opening positions would never end. Celeris stops editing a block after EDIT_STEP_FACTOR times
its planned steps (mask steps plus max_post_steps), far past any decode seen in the parity runs;
its masks are then filled and it ends like any block.

LLaDA2.2 (`joint_ids` set by the runner: its checkpoint names edit tokens): the block's steps are
its joint decode (engine/families/block/levenshtein.py), which the runner runs on each step's
logits. A step may re-open a written position as a mask (a SPLIT, or the pad after a DELETE):
such a position is a revision, no longer committed, and the block ends when its `JointBlock` says.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional

from celeris.engine.families.block.levenshtein import EditIds, JointBlock
from celeris.engine.families.sequence import DecodeSequence
from celeris.engine.events import FinishReason, StepEvent
from celeris.engine.sampling.schedule import transfer_schedule

PREFILL, DENOISE, STORE = "prefill", "denoise", "store"
EDIT_STEP_FACTOR = 4  # edits stop after this many times a block's planned steps (module doc)


@dataclass
class BlockSequence(DecodeSequence):
    prefill_chunk: int = 256  # most prompt tokens one prefill step takes (rounded to whole blocks)
    edits: bool = False  # the family's LLaDA2.1 loop (see the module doc)
    cache_salt: str = ""  # the prefix cache's tenant (engine/models/prefix_cache.py)
    # This step's cap on the prefill chunk while other rows denoise (engine/families/block/chunked_prefill.py); 0: none.
    step_chunk: int = 0
    # Set by the runner (its eager path): the step that prefills the prompt's last chunk denoises the
    # first block in the same forward (engine/families/block/chunked_prefill.py).
    fuse_first_block: bool = False
    joint_ids: Optional[EditIds] = None  # LLaDA2.2's joint decode, with these ids (module doc)
    joint: Optional[JointBlock] = None  # its state over the current block

    def __post_init__(self) -> None:
        b, P = self.params.block_length, len(self.prompt)
        self.total = -(-(P + self.params.gen_length) // b) * b  # whole blocks covering prompt + G
        self.canvas = [self.mask_id] * (self.total - P)
        if self.constraint is not None:  # the skeleton, and stop ids past the output
            layout = self.constraint.layout.canvas
            self.canvas = list(layout) + [self.constraint.layout.tail] * (self.total - P - len(layout))
        self.first_block = P // b
        self.prompt_tail = list(self.prompt[self.first_block * b:])  # the prompt's tokens in the first decoded block
        self.block = self.first_block  # absolute index of the block being decoded
        self.prefilled = 0
        self.post_steps = 0  # LLaDA2.1: steps run on the current block since its last mask was filled
        self.phase = PREFILL if self.first_block else DENOISE
        self._schedule = transfer_schedule(b, self.params.steps_per_block)
        self.prefix_keys: list[bytes] = []  # the prompt's whole blocks' prefix cache keys
        self.prefill_steps = 0  # prefill forwards run (their count depends on chunking and the cache)

    def skip_prefill(self, tokens: int) -> None:
        """The prompt's first `tokens` (whole blocks) were copied from the prefix cache: prefill
        goes on from there (none left: decoding starts at the next step)."""
        self.prefilled = self.cached_tokens = tokens
        if tokens >= self.first_block * self.params.block_length:
            self.phase = DENOISE

    # ------------------------------------------------------------------ what the runner reads

    @property
    def length(self) -> int:
        return self.total

    @property
    def first_window(self) -> int:
        """Output positions the first decoded block holds: it is aligned to absolute positions, so
        the prompt's tail takes its first P % b."""
        b = self.params.block_length
        return b - len(self.prompt) % b

    @property
    def editing(self) -> bool:
        """Whether written tokens may be replaced (LLaDA2.1 with an editing threshold; a structured
        output's tokens are never edited)."""
        return self.edits and self.params.editing_threshold is not None and self.constraint is None

    @property
    def edits_now(self) -> bool:
        """Whether this step may edit: editing, and the block within its step limit (module doc)."""
        return self.editing and self.step_in_block < EDIT_STEP_FACTOR * self._block_steps

    @property
    def _block_steps(self) -> int:
        """LLaDA2.1's planned steps for one block: its masks' steps, then max_post_steps."""
        b = self.params.block_length
        return -(-b // self._schedule[0]) + (self.params.max_post_steps if self.editing else 0)

    @property
    def revising(self) -> bool:
        return self.editing

    @property
    def stores_block(self) -> bool:
        """This step's forward writes its window's keys/values: prefill and store steps, and an
        editing block's post steps (no mask left: if nothing is edited they are the final ones)."""
        if self.phase != DENOISE:
            return True
        return self.editing and not self._block_masked()

    def _block_canvas(self) -> list[int]:
        start, end = self.block_window
        return self.canvas[max(start - len(self.prompt), 0):end - len(self.prompt)]

    def _block_masked(self) -> bool:
        """Whether the block being decoded still holds a mask: in its output positions, or (as
        published) in the prompt's tail that shares the first decoded block. A structured row
        never commits the prompt's columns, so only its output positions count."""
        if self.mask_id in self._block_canvas():
            return True
        return self.block == self.first_block and self.constraint is None and self.mask_id in self.prompt_tail

    @property
    def noise_step(self) -> int:
        """The step index that keys this row's sampling noise: forwards since prefill ended, so
        a seeded decode is the same however its prompt was prefilled (in chunks of any size, or
        partly copied from the prefix cache)."""
        return self.nfe - self.prefill_steps

    @property
    def decode_blocks(self) -> int:
        return self.total // self.params.block_length - self.first_block

    @property
    def _chunk(self) -> int:
        """Prompt tokens one prefill step takes: whole blocks, at least one."""
        b = self.params.block_length
        chunk = max(b, self.prefill_chunk // b * b)
        return min(chunk, max(b, self.step_chunk // b * b)) if self.step_chunk else chunk

    @property
    def prefill_window(self) -> tuple[int, int]:
        """Absolute [start, end) of the prompt's whole blocks this prefill step computes."""
        return self.prefilled, min(self.first_block * self.params.block_length, self.prefilled + self._chunk)

    @property
    def block_window(self) -> tuple[int, int]:
        """Absolute [start, end) of the block being decoded (while prefilling: the first one)."""
        b = self.params.block_length
        return self.block * b, (self.block + 1) * b

    @property
    def joins_decode(self) -> bool:
        """A prefill step that ends the prompt and, in the same forward, runs the first block's
        first denoise step (`fuse_first_block`): the very step the next one would run."""
        return (self.phase == PREFILL and self.fuse_first_block
                and self.prefill_window[1] == self.first_block * self.params.block_length)

    @property
    def denoising(self) -> bool:
        """Whether this step selects tokens in `block_window`."""
        return self.phase == DENOISE or self.joins_decode

    @property
    def window(self) -> tuple[int, int]:
        """Absolute [start, end) of this step's fresh positions: a prefill chunk (and the first
        block when it joins decoding), or the block being decoded."""
        if self.phase == PREFILL:
            start, end = self.prefill_window
            return start, self.block_window[1] if self.joins_decode else end
        return self.block_window

    @property
    def tokens_this_step(self) -> int:
        """The fixed schedule's count (SDAR / LLaDA2: the block's length split over its steps,
        remainder first); at most the masks left, which the sampler enforces."""
        if self.constraint is not None:  # every slot's front may commit
            return self.params.block_length
        if self.edits:  # LLaDA2.1's num_to_transfer: the same count every step
            return self._schedule[0]
        return self._schedule[min(self.step_in_block, len(self._schedule) - 1)]

    @property
    def total_steps(self) -> int:
        """Forwards planned: the prefill chunks, each decoded block's steps (at most one per
        position under a threshold), and a store forward between blocks."""
        b = self.params.block_length
        prefill = -(-(self.first_block * b - self.cached_tokens) // self._chunk)
        if prefill and self.fuse_first_block:  # the last chunk's forward is the first denoise step too
            prefill -= 1
        per_block = b if self.params.adaptive else self.params.steps_per_block
        if self.edits:
            per_block = self._block_steps
        return prefill + self.decode_blocks * per_block + self.decode_blocks - 1

    @property
    def output(self) -> list[int]:
        return self.canvas[:self.params.gen_length]

    @property
    def kv_cache(self) -> str:
        return "exact"  # the committed blocks' keys/values, always

    def _view(self, block: int, block_complete: bool) -> tuple[tuple[int, ...], int, int]:
        """The first gen_length positions; settled = those before the block being decoded."""
        b, P, G = self.params.block_length, len(self.prompt), self.params.gen_length
        if self.finished:
            settled = G
        else:  # after a finished block (stored next) its positions are final too
            current = self.block + (1 if self.phase == STORE else 0)
            settled = min(G, max(0, current * b - P))
        return tuple(self.output), self.decode_blocks, settled

    # ------------------------------------------------------------------ progress

    def _apply(self, positions: list[int], tokens: list[int], confidences: list[float],
               logprobs: tuple = (), provisional: tuple = ()) -> Callable[[], StepEvent]:
        """Advance by one forward; on a denoise step commit the runner's picks (positions
        relative to the block's first column): masks filled and, for LLaDA2.1, tokens edited."""
        start, end = self.block_window
        P, G = len(self.prompt), self.params.gen_length
        committed, revised, block_done = [], [], False
        self.nfe += 1
        phase = self._prefill_done() if self.phase == PREFILL else self.phase
        if phase == STORE:
            self._next_block()
        elif phase == DENOISE:
            masks_before, stored = self._block_masked(), self.stores_block
            own = []  # indices into positions of the output positions committed
            for j, (pos, tok) in enumerate(zip(positions, tokens)):
                i = start + pos - P
                if i < 0:  # a mask token of the prompt's tail, filled as published: not output
                    self.prompt_tail[start + pos - self.first_block * self.params.block_length] = tok
                    continue
                if self.canvas[i] != self.mask_id:
                    revised.append(i)
                self.canvas[i] = tok
                if tok == self.mask_id and self.joint_ids is not None:
                    continue  # re-opened by an edit: a revision, no longer committed
                committed.append(i)
                own.append(j)
                if self.constraint is not None:
                    self.constraint.commit(i, tok)
            if logprobs:
                self.token_logprobs.update(zip(committed, (logprobs[j] for j in own)))
            confidences = [confidences[j] for j in own]
            self.step_in_block += 1
            if self._block_ends(masks_before, bool(revised)):
                block_done = True
                self._finish_block(end - P, stored and not revised)
        keep = [i for i, c in enumerate(committed) if c < G]
        block = min(self.block - (1 if block_done and self.phase == DENOISE and not self.finished else 0),
                    self.total // self.params.block_length - 1) - self.first_block
        guesses = tuple((start + i - P, t, c) for i, t, c in provisional if 0 <= start + i - P < G)
        return functools.partial(self.event, tuple(committed[i] for i in keep), tuple(confidences[i] for i in keep),
                                 block, block_done, guesses, tuple(i for i in sorted(revised) if i < G))

    def _prefill_done(self) -> str:
        """Record a prefill step's chunk; DENOISE if the step joined decoding (its first block's
        picks are committed next, as a first denoise step: not counted in `prefill_steps`, so
        `noise_step` is 0 there as in an unjoined decode), else PREFILL."""
        joins = self.joins_decode
        self.prefilled = self.prefill_window[1]
        if self.prefilled >= self.first_block * self.params.block_length:
            self.phase = DENOISE
        if not joins:
            self.prefill_steps += 1
        return DENOISE if joins else PREFILL

    def _block_ends(self, masks_before: bool, edited: bool) -> bool:
        """After a denoise step: is the block finished? Without editing, once no mask is left. With
        it, as LLaDA2.1's loop decides: a step that starts with no mask left is a post step; the
        block ends after one that edits nothing, or when the next step would be a post step past
        max_post_steps (an edit may write the mask token back: that position is filled first)."""
        filled = not self._block_masked()
        if self.joint_ids is not None and self.joint is not None:
            return self.joint.done
        if not self.editing:
            return filled
        if not masks_before:
            self.post_steps += 1
            if not edited:
                return True
        return filled and self.post_steps >= self.params.max_post_steps

    def _next_block(self) -> None:
        self.phase, self.block, self.step_in_block, self.post_steps = DENOISE, self.block + 1, 0, 0

    def _finish_block(self, end: int, stored: bool = False) -> None:
        """After the block ending at canvas index `end`: stop (the published rule: a stop id
        anywhere in what is generated), end at the last block, or store it (unless this step's
        forward already stored its final keys/values) and go on."""
        G = self.params.gen_length
        if self.stops_within(min(end, G)):  # the stop is looked for in the output (the first G) only
            return
        if end >= G:  # the last block: it holds the output's end
            self.finish_reason = FinishReason.LENGTH
        elif stored:
            self._next_block()
        else:
            self.phase = STORE

    def cancel(self) -> StepEvent:
        self.finish_reason = FinishReason.CANCELLED
        return self.event(block=max(self.block - self.first_block, 0))
