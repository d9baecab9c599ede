"""The engine's front: one model and its scheduler, as both doors (gRPC, HTTP) and the CLI use it.

A door holds an `Engine` and nothing of the loop: it builds each of a call's samples (`prepare`:
validated and tokenized, off the event loop when long), admits them all or none (`submit`), reads
each `RequestStream` of `StepEvent`s, and cancels or stops; the per-step hooks (`on_step`,
`on_dead`) and the limits (`slots`, `max_open`, `max_open_per_client`) are here too. A `Prepared`
request tells its door what it may know before the request runs (its id, parameters and structure
path), never its decoding state.

The server imports four engine modules (tests/unit/test_imports.py): this one, `requests` (what a
request may say), `events` (what comes back) and `errors`. What else of the engine a door or the
command line needs (loading a model, the tokenizer, canvas deltas, threads, the offline commands)
is named here, so a move inside the engine never reaches the server.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from celeris.engine.config import EngineConfig
from celeris.engine.detok import CanvasDeltas
from celeris.engine.errors import EngineError
from celeris.engine.families.sequence import DecodeSequence
from celeris.engine.llm import LLM, Result, default_prompt_tokens, model_defaults, model_folder
from celeris.engine.loop.request_stream import RequestStream
from celeris.engine.loop.scheduler import Formatter, Scheduler
from celeris.engine.loop.step_loop import StepRecord
from celeris.engine.models.prefix_cache import DEFAULT_PREFIX_CACHE_BYTES, budget_from_gb
from celeris.engine.requests import Request
from celeris.engine.sampling.params import SamplingParams
from celeris.engine.threads import (TensorThread, affinity_cpus, cgroup_cpu_quota, configure_switch_interval,
                                    configure_threads, freeze_startup_heap, gemm_rows_invariant)
from celeris.engine.tokenizer import MASK_MARKER, Tokenizer


@dataclass(frozen=True)
class Prepared:
    """One request validated and tokenized, not yet admitted: what its door may know of it."""

    request_id: str
    ticket: int  # which submission it is (request ids can be reused once one ends)
    params: SamplingParams  # validated, seed filled in
    prompt_tokens: int
    structure_path: str  # how its structured output decodes (skeleton, document, regex); "" for free text
    seq: DecodeSequence = field(repr=False, compare=False)  # the engine's own: doors never read it


# A door's maker of one sample's event formatter (engine/loop/scheduler.py: run off the event loop).
FormatterFactory = Callable[[Prepared], Optional[Formatter]]


class Engine:
    """`llm` (the model, its tokenizer and request builder) plus the `Scheduler` serving its loop."""

    def __init__(self, llm: LLM, on_step: Optional[Callable[[StepRecord], None]] = None,
                 max_open: Optional[int] = None, thread: Optional[TensorThread] = None, unread_timeout: float = 0.0):
        self.llm = llm
        # The step worker runs on `thread`, the thread that loaded the model (engine/threads.py says why).
        self.scheduler = Scheduler(llm.loop, on_step=on_step, max_open=max_open, thread=thread,
                                   unread_timeout=unread_timeout)

    # ------------------------------------------------------------------ limits and state

    @property
    def slots(self) -> int:
        """Requests one step can serve at once (the runner's rows)."""
        return self.llm.loop.runner.slots

    @property
    def max_open(self) -> int:
        """Streams admitted and not yet closed, at most (parked ones too)."""
        return self.scheduler.max_open

    @property
    def max_open_per_client(self) -> int:
        return self.scheduler.max_open_per_owner

    @max_open_per_client.setter
    def max_open_per_client(self, n: int) -> None:
        self.scheduler.max_open_per_owner = n

    @property
    def running(self) -> int:
        return self.scheduler.running

    @property
    def queued(self) -> int:
        return self.scheduler.queued

    @property
    def open(self) -> int:
        return self.scheduler.open

    @property
    def active(self) -> int:
        """Requests the engine still works on."""
        return self.scheduler.active

    @property
    def steps(self) -> int:
        return self.scheduler.steps

    @property
    def accepting(self) -> bool:
        return self.scheduler.accepting

    @property
    def prefix_cache_stats(self) -> Any:
        """The prefix cache's counters (block models, when the cache is on), else None."""
        prefixes = getattr(self.llm.loop.runner, "prefixes", None)
        return prefixes.cache.stats if prefixes is not None else None

    def on_dead(self, callback: Callable[[], None]) -> None:
        """Call `callback()` (on the event loop) if the step worker dies: nothing can be served after."""
        self.scheduler.on_dead = callback

    # ------------------------------------------------------------------ requests

    async def prepare(self, req: Request, inline: bool = True, client: str = "") -> Prepared:
        """Validate and tokenize `req` (a long one on a worker thread; `client`'s structured and tool
        builds wait at its own gate, engine/structured/lanes.py); raises InvalidRequest."""
        return self._prepared(await self.llm.build_async(req, inline, client))

    def prepare_now(self, req: Request) -> Prepared:
        """`prepare` on the calling thread (benchmarks, warm-up)."""
        return self._prepared(self.llm.build(req))

    @staticmethod
    def _prepared(seq: DecodeSequence) -> Prepared:
        path = seq.constraint.layout.path if seq.constraint is not None else ""
        return Prepared(seq.request_id, seq.ticket, seq.params, len(seq.prompt), path, seq)

    def submit(self, prepared: list[Prepared], formatters: Optional[list[Optional[FormatterFactory]]] = None,
               client: str = "") -> list[RequestStream]:
        """Admit one call's samples all or none (Unavailable, Overloaded, InvalidRequest raise here, before
        any stream exists); `formatters[k](prepared[k])` makes sample k's event formatter. Each stream
        carries its request's `structure_path`."""
        makers = formatters or [None] * len(prepared)
        streams = self.scheduler.submit_group([p.seq for p in prepared],
                                              [f(p) if f else None for f, p in zip(makers, prepared)], client)
        for stream, p in zip(streams, prepared):
            stream.structure_path = p.structure_path
        return streams

    async def warm_up(self) -> None:
        """One tiny generation of the model's family through the real path, so the first user
        request is not the slow one."""
        ids = self.llm.encode_prompt([self.llm.tokenizer.eos_id])
        seq = self.llm.sequence(ids, self.llm.warmup_params, "warmup")
        with self.scheduler.submit(seq) as stream:
            async for _ in stream:
                pass

    def cancel(self, request_id: str) -> None:
        """Cancel the running request with this id, if any (its door still closes its stream)."""
        self.scheduler.cancel(request_id)

    # ------------------------------------------------------------------ life

    def start(self) -> None:
        """Start the step worker (on the running event loop)."""
        self.scheduler.start()

    def refuse(self) -> None:
        """Refuse new work from now on (draining): submits raise Unavailable."""
        self.scheduler.accepting = False

    def interrupt(self, error: EngineError) -> None:
        """End every request still in the engine with `error` (shutdown's grace is over)."""
        self.scheduler.interrupt(error)

    async def stop(self) -> None:
        """Refuse new work, let the step in flight finish, cancel what is left."""
        await self.scheduler.stop()


# ---------------------------------------------------------------------- offline commands (the CLI)
# The training room is loaded only when its command runs.

def add_train_args(parser: argparse.ArgumentParser) -> None:
    from celeris.engine.training.train import add_train_args as add

    add(parser)


def train(args: argparse.Namespace) -> dict:
    from celeris.engine.training.train import run

    return run(args)


def evaluate(llm: LLM, cache_dir: Path, limit: Optional[int] = None) -> dict:
    from celeris.engine.training.evaluate import evaluate as run

    return run(llm, cache_dir, limit=limit)


def format_report(report: dict) -> str:
    from celeris.engine.training.evaluate import format_report as fmt

    return fmt(report)


def simulate(llm: LLM, step_s: float) -> None:
    """Benchmarks only: replace the model's forward by a fixed pace (engine/loop/sim_runner.py)."""
    from celeris.engine.loop.sim_runner import simulate as run

    run(llm, step_s)


__all__ = ["DEFAULT_PREFIX_CACHE_BYTES", "MASK_MARKER", "CanvasDeltas", "Engine", "EngineConfig", "Formatter", "default_prompt_tokens",
           "FormatterFactory", "LLM", "Prepared", "RequestStream", "Result", "StepRecord", "TensorThread", "Tokenizer",
           "add_train_args", "affinity_cpus", "budget_from_gb", "cgroup_cpu_quota", "configure_switch_interval",
           "configure_threads", "evaluate", "format_report", "freeze_startup_heap", "gemm_rows_invariant",
           "model_defaults", "model_folder", "simulate", "train"]
