"""`celeris bench`: load-test a server (or the engine in-process) and report throughput and latency.

`concurrency` workers send `requests` generations (after `warmup` unrecorded ones) with a prompt
of exactly `prompt_len` token ids. Reported: output tokens/s (generated non-EOS tokens over wall
time), requests/s, time to first snapshot and end-to-end latency (p50/p95/mean), and tokens per
forward pass (generated tokens / per-request forward passes: how parallel the decoder is). The
JSON report records the conditions beside the figures: machine, threads or device, model, dtype,
concurrency and the server's max batch, lengths, steps and decoder (penalties included: the
model's defaults unless the run sets them).

A backend does the per-request work: `GrpcBackend` here (the Python client against a server),
or the engine-side backend that `celeris bench --in-process` injects (server/cli/bench_inprocess.py),
so this module stays free of engine and torch imports.
"""

from __future__ import annotations

import asyncio
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Optional, Protocol

from celeris_client.client import AsyncCelerisClient
from celeris_client.progress import Progress, percentile

FILLER = "The quick brown fox jumps over the lazy dog while the sea rolls in under a grey sky. "
DECODER_KNOBS = ("temperature", "remasking", "threshold", "factor", "cfg_scale", "frequency_penalty", "presence_penalty")


@dataclass(frozen=True)
class Sample:
    ok: bool
    ttfs_s: float  # time to first snapshot
    latency_s: float
    generated: int
    forward_passes: int
    error: Optional[str] = None


class BenchBackend(Protocol):
    async def open(self) -> dict[str, Any]:
        """Start; return the conditions it knows (model, dtype, device, threads, defaults...)."""

    async def prompt_ids(self, n: int) -> list[int]: ...

    async def run(self, prompt_ids: list[int], knobs: dict[str, Any], first: Callable[[], None]) -> tuple[int, int]:
        """One generation; call first() at the first snapshot; return (generated, forward passes)."""

    async def close(self) -> None: ...


class GrpcBackend:
    """The Python client against a running server (created in open(): grpc.aio needs the loop)."""

    def __init__(self, target: str, **client_kwargs: Any):
        self.target, self.client_kwargs = target, client_kwargs
        self.client: Optional[AsyncCelerisClient] = None

    async def open(self) -> dict[str, Any]:
        self.client = AsyncCelerisClient(self.target, **self.client_kwargs)
        info = await self.client.model_info()
        return {"server": self.client.target, "model": info.name, "architecture": info.architecture,
                "parameters": info.parameter_count, "dtype": info.dtype, "device": info.device,
                "threads": None,  # the server's, not known from here; see machine for the client
                "max_batch": info.limits.max_batch, "defaults": asdict(info.defaults)}

    async def prompt_ids(self, n: int) -> list[int]:
        chunk = list((await self.client.tokenize(FILLER * 8)).ids)
        return (chunk * (n // max(1, len(chunk)) + 1))[:n]

    async def run(self, prompt_ids: list[int], knobs: dict[str, Any], first: Callable[[], None]) -> tuple[int, int]:
        snap = None
        async for snap in self.client.stream(prompt_ids, **knobs):
            first()
        usage = snap.usage if snap is not None else None
        return (usage.generated_tokens, usage.forward_passes) if usage else (0, 0)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()


async def _measure(backend: BenchBackend, ids: list[int], knobs: dict[str, Any]) -> Sample:
    t0 = time.perf_counter()
    first_at: list[float] = []

    def first() -> None:
        if not first_at:
            first_at.append(time.perf_counter())

    try:
        gen, fwd = await backend.run(ids, knobs, first)
    except Exception as e:  # a failed request is a data point, not the end of the run
        t = time.perf_counter() - t0
        return Sample(False, t, t, 0, 0, f"{type(e).__name__}: {e}".splitlines()[0])
    end = time.perf_counter()
    return Sample(True, (first_at[0] if first_at else end) - t0, end - t0, gen, fwd)


def summarize(samples: list[Sample], wall_s: float) -> dict[str, Any]:
    ok = [s for s in samples if s.ok]
    gen, fwd = sum(s.generated for s in ok), sum(s.forward_passes for s in ok)

    def dist(xs: list[float]) -> dict[str, Optional[float]]:
        r = lambda x: None if x is None else round(x, 5)  # noqa: E731
        mean = sum(xs) / len(xs) if xs else None
        return {"p50": r(percentile(xs, 50)), "p95": r(percentile(xs, 95)), "mean": r(mean)}

    errors = sorted({s.error for s in samples if s.error})
    return {"requests": len(samples), "ok": len(ok), "failed": len(samples) - len(ok), "wall_s": round(wall_s, 4),
            "output_tokens": gen, "output_tokens_per_s": round(gen / wall_s, 3) if wall_s > 0 else None,
            "requests_per_s": round(len(ok) / wall_s, 3) if wall_s > 0 else None,
            "time_to_first_snapshot_s": dist([s.ttfs_s for s in ok]), "latency_s": dist([s.latency_s for s in ok]),
            "tokens_per_forward": round(gen / fwd, 4) if fwd else None, "errors": errors[:10]}


def machine() -> dict[str, Any]:
    return {"host": platform.node(), "platform": platform.platform(), "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "python": platform.python_version()}


async def run_bench(backend: BenchBackend, *, concurrency: int, requests: int, prompt_len: int,
                    knobs: dict[str, Any], warmup: int = 1, show_progress: bool = True) -> dict[str, Any]:
    """Run the load and return the report: {"conditions": ..., "results": ...}."""
    conditions = await backend.open()
    try:
        ids = await backend.prompt_ids(prompt_len)
        for _ in range(warmup):
            await _measure(backend, ids, knobs)
        progress = Progress(requests, label="bench ", out=sys.stderr) if show_progress else None
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(requests):
            queue.put_nowait(i)
        samples: list[Sample] = []

        async def worker() -> None:
            while not queue.empty():
                queue.get_nowait()
                samples.append(s := await _measure(backend, ids, knobs))
                if progress:
                    progress.update(s.ok)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
        wall = time.perf_counter() - t0
        if progress:
            progress.close()
    finally:
        await backend.close()
    defaults = conditions.pop("defaults", {})
    settings = {k: knobs.get(k, defaults.get(k)) for k in ("gen_length", "steps", "block_length", *DECODER_KNOBS)}
    conditions |= {"machine": machine(), "concurrency": concurrency, "requests": requests, "warmup": warmup,
                   "prompt_tokens": len(ids), "gen_length": settings["gen_length"], "steps": settings["steps"],
                   "block_length": settings["block_length"], "decoder": {k: settings[k] for k in DECODER_KNOBS},
                   "stream": "every step"}
    return {"started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "conditions": conditions,
            "results": summarize(samples, wall)}


def describe(report: dict[str, Any]) -> str:
    c, r = report["conditions"], report["results"]
    ttfs, lat = r["time_to_first_snapshot_s"], r["latency_s"]
    ms = lambda x: "--" if x is None else f"{x * 1000:.1f} ms"  # noqa: E731
    dec = ", ".join(f"{k}={v}" for k, v in c["decoder"].items() if v is not None)
    return "\n".join([
        f"model {c['model']} ({c['dtype']}, {c['device']}) via {c['server']}; threads {c['threads'] or 'n/a'}",
        f"concurrency {c['concurrency']} (server max batch {c['max_batch']}), {r['requests']} requests; "
        f"prompt {c['prompt_tokens']} tokens, gen_length {c['gen_length']}, steps {c['steps']}, "
        f"block_length {c['block_length']}; decoder {dec}",
        f"output tokens/s     {r['output_tokens_per_s']}  ({r['output_tokens']} tokens in {r['wall_s']} s)",
        f"requests/s          {r['requests_per_s']}  ({r['ok']} ok, {r['failed']} failed)",
        f"first snapshot      p50 {ms(ttfs['p50'])}  p95 {ms(ttfs['p95'])}",
        f"latency             p50 {ms(lat['p50'])}  p95 {ms(lat['p95'])}",
        f"tokens per forward  {r['tokens_per_forward']}",
    ])
