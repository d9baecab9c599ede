"""A runner that simulates an accelerator's pace: each step sleeps a fixed time, runs no model.

Why: on a CPU box the serving overhead per step (admission, applying results, building and
sending messages) hides behind a slow forward, or drowns a fast one. A GPU step of a large model
takes tens of milliseconds and leaves the host's cores free while it runs; `time.sleep`
releases the GIL the way a CUDA synchronisation does. So with this runner in place of the real
one the server's steps/s, set beside the runner's own steps/s, measures what the serving stack
costs at a GPU's pace (`celeris serve --simulate-step-ms 20`, scripts/bench_serving.py).

Streams keep realistic shapes: every step commits, in each request's current block, the first
masked positions the request's schedule asks for (at least one), with ordinary token ids (never
EOS, a stop id or the mask) and confidence 1.0, so blocks finish and requests end on schedule;
with `provisional` the block's other masked positions are reported at confidence 0.5.
Full-canvas models only: block-diffusion sequences have their own runner contract.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence as Seq

from celeris.engine.loop.runner_api import RowResult, StepRunner, StepStats
from celeris.engine.loop.step_loop import StepLoop
from celeris.engine.loop.sequence import Sequence


class SimulatedRunner(StepRunner):
    """A `runner_api.StepRunner` whose steps take a fixed time: rows cost their length, and
    every row joins the same forward."""

    def __init__(self, slots: int, step_s: float, token_pool: Seq[int]):
        if step_s < 0:
            raise ValueError("step_s must be >= 0")
        if not token_pool:
            raise ValueError("token_pool must hold at least one ordinary token id")
        self.slots, self.step_s, self.pool = slots, step_s, list(token_pool)

    # A simulated step costs the same whatever its rows, so splitting the batch into length
    # groups (engine.batching.partition) never pays: one forward per step, as on a GPU that
    # is not yet saturated.
    forward_overhead_tokens = 1 << 40

    @staticmethod
    def row_tokens(seq: Sequence) -> int:
        return seq.length

    @staticmethod
    def forward_kind(seq: Sequence) -> None:
        return None

    def load(self, seq: Sequence) -> None:
        """Nothing to copy: the canvas lives in the Sequence, which `apply` keeps current."""

    @staticmethod
    def resumable(seq: Sequence) -> bool:
        """Any sample can leave its slot and come back (engine/loop/fair_share.py): nothing is cached."""
        return True

    def _row(self, seq: Sequence) -> RowResult:
        p = seq.params
        start = seq.block_start
        block = seq.canvas[start:start + p.block_length]
        masked = [i for i, t in enumerate(block) if t == seq.mask_id]
        n = max(1, seq.tokens_this_step) if not p.adaptive else max(1, p.block_length // max(1, p.steps_per_block))
        picks = masked[:n]
        # Ids follow the canvas position, so a request's text is the same whatever its batch.
        token = lambda i: self.pool[(start + i) % len(self.pool)]  # noqa: E731
        # Provisional picks (when asked): the tokens later steps will commit, at confidence 0.5.
        guesses = tuple((i, token(i), 0.5) for i in masked[n:]) if p.provisional else ()
        return RowResult(picks, [token(i) for i in picks], [1.0] * len(picks), (), guesses)

    # The device's time is the sleep: host work queued before it (`during`) overlaps it.
    overlaps_host = True

    def step(self, seqs: Seq[Sequence], during: Optional[Callable[[], None]] = None
             ) -> tuple[list[RowResult], StepStats]:
        t0 = time.perf_counter()
        results = [self._row(s) for s in seqs]
        if during is not None:
            during()
        # Sleep to the step time (the host work above counts toward it, as a GPU overlaps it).
        left = self.step_s - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)
        longest = max((s.length for s in seqs), default=0)
        window = max((s.params.block_length for s in seqs), default=0)
        return results, StepStats(len(seqs), len(seqs), longest, window, sum(len(r.positions) for r in results),
                                  time.perf_counter() - t0)


def ordinary_tokens(tokenizer, text: str = "the quick brown fox jumps over the lazy dog and") -> list[int]:
    """Token ids of plain text that are not special (EOS, end-of-turn, mask): what the simulated
    runner commits, so streams decode to readable text and never stop early."""
    special = set(tokenizer.stop_ids) | {tokenizer.mask_id, tokenizer.eos_id, tokenizer.pad_id, tokenizer.bos_id}
    return [t for t in tokenizer.encode(text) if t not in special]


def simulate(llm, step_s: float) -> SimulatedRunner:
    """Swap `llm`'s runner for a SimulatedRunner of the same slots (before a Scheduler is built
    on `llm.loop`). The model stays loaded: the tokenizer and request validation are real."""
    if not llm.family.simulable:
        raise ValueError("the simulated runner serves full-canvas models only")
    runner = SimulatedRunner(llm.config.max_batch, step_s, ordinary_tokens(llm.tokenizer))
    llm.runner = runner
    llm.loop = StepLoop(runner, llm.config.max_queue)
    return runner


__all__ = ["SimulatedRunner", "ordinary_tokens", "simulate"]
