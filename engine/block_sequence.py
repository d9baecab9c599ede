"""Per-request state of a block-diffusion request (SDAR, LLaDA2), in plain Python.

The canvas grows one block at a time over an exact KV cache. As the published loops lay it
out, positions are absolute from the prompt's first token and blocks are aligned to them: the
prompt's whole blocks are prefilled (block-causally, in chunks), and decoding starts at block
P // b, whose first P % b positions are the prompt's tail (never masked, so never chosen). So
ceil((P + G) / b) * b - P positions are decoded, up to b - 1 more than gen_length G; the
output is the first G. Each request moves through phases, one forward each:

  prefill (the next chunk of whole prompt blocks) -> denoise (the current block, until no mask
  is left) -> store (the finished block's keys/values written to the cache) -> denoise ...

A block that finishes the request (a stop token, or the last block) is not stored.
"""

from __future__ import annotations

from dataclasses import dataclass

from celeris.engine.sampler import transfer_schedule
from celeris.engine.sequence import FinishReason, Sequence, StepEvent

PREFILL, DENOISE, STORE = "prefill", "denoise", "store"


@dataclass
class BlockSequence(Sequence):
    prefill_chunk: int = 256  # most prompt tokens one prefill step takes (rounded to whole blocks)

    def __post_init__(self) -> None:
        b, P = self.params.block_length, len(self.prompt)
        self.total = -(-(P + self.params.gen_length) // b) * b  # whole blocks covering prompt + G
        self.canvas = [self.mask_id] * (self.total - P)
        if self.constraint is not None:  # the skeleton, and stop ids past the output
            layout = self.constraint.layout.canvas
            self.canvas = list(layout) + [self.constraint.layout.tail] * (self.total - P - len(layout))
        self.first_block = P // b
        self.block = self.first_block  # absolute index of the block being decoded
        self.prefilled = 0
        self.phase = PREFILL if self.first_block else DENOISE
        self._schedule = transfer_schedule(b, self.params.steps_per_block)

    # ------------------------------------------------------------------ what the runner reads

    @property
    def length(self) -> int:
        return self.total

    @property
    def decode_blocks(self) -> int:
        return self.total // self.params.block_length - self.first_block

    @property
    def _chunk(self) -> int:
        """Prompt tokens one prefill step takes: whole blocks, at least one."""
        b = self.params.block_length
        return max(b, self.prefill_chunk // b * b)

    @property
    def window(self) -> tuple[int, int]:
        """Absolute [start, end) of this step's fresh positions."""
        b = self.params.block_length
        if self.phase == PREFILL:
            return self.prefilled, min(self.first_block * b, self.prefilled + self._chunk)
        return self.block * b, (self.block + 1) * b

    @property
    def tokens_this_step(self) -> int:
        """The fixed schedule's count (SDAR / LLaDA2: the block's length split over its steps,
        remainder first); at most the masks left, which the sampler enforces."""
        if self.constraint is not None:  # every slot's front may commit
            return self.params.block_length
        return self._schedule[min(self.step_in_block, len(self._schedule) - 1)]

    @property
    def total_steps(self) -> int:
        """Forwards planned: the prefill chunks, each decoded block's steps (at most one per
        position under a threshold), and a store forward between blocks."""
        b = self.params.block_length
        prefill = -(-self.first_block * b // self._chunk)
        per_block = b if self.params.adaptive else self.params.steps_per_block
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

    def apply(self, positions: list[int], tokens: list[int], confidences: list[float],
              logprobs: tuple = (), provisional: tuple = ()) -> StepEvent:
        """Advance by one forward; on a denoise step commit the runner's picks (positions
        relative to the block's first column)."""
        start, end = self.window
        P, G = len(self.prompt), self.params.gen_length
        committed, block_done = [], False
        self.nfe += 1
        if self.phase == PREFILL:
            self.prefilled = end
            if self.prefilled >= self.first_block * self.params.block_length:
                self.phase = DENOISE
        elif self.phase == STORE:
            self.phase, self.block, self.step_in_block = DENOISE, self.block + 1, 0
        else:
            for pos, tok in zip(positions, tokens):
                self.canvas[start + pos - P] = tok
                committed.append(start + pos - P)
                if self.constraint is not None:
                    self.constraint.commit(start + pos - P, tok)
            self.token_logprobs.update(zip(committed, logprobs))
            self.step_in_block += 1
            if self.mask_id not in self.canvas[max(start - P, 0):end - P]:
                block_done = True
                self._finish_block(end - P)
        keep = [i for i, c in enumerate(committed) if c < G]
        block = min(self.block, self.total // self.params.block_length - 1) - self.first_block
        guesses = tuple((start + i - P, t, c) for i, t, c in provisional if start + i - P < G)
        return self.event(tuple(committed[i] for i in keep), tuple(confidences[i] for i in keep), block, block_done,
                          guesses)

    def _finish_block(self, end: int) -> None:
        """After the block ending at canvas index `end`: stop (the published rule: a stop id
        anywhere in what is generated), end at the last block, or store it and go on."""
        G = self.params.gen_length
        if self.stops_within(min(end, G)):  # the stop is looked for in the output (the first G) only
            return
        if end >= G:  # the last block: it holds the output's end
            self.finish_reason = FinishReason.LENGTH
        else:
            self.phase = STORE

    def cancel(self) -> StepEvent:
        self.finish_reason = FinishReason.CANCELLED
        return self.event(block=max(self.block - self.first_block, 0))
