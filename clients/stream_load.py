"""Concurrent raw Generate streams, measured per request: the client side of bench_serving.

scripts/bench_serving.py runs this module as its own process (`python -m celeris_client.stream_load`),
so the clients never share cores' time slices or a GIL with the server the way they did when the
benchmark's clients rode the server's event loop. It reads one JSON job per stdin line and
answers one JSON line per job on stdout:

    job:    {"target", "concurrency", "mode", "requests": [{"prompt", "gen_length", ...}, ...]}
    answer: {"wall_s", "cpu_s", "records": [{"ok", "first_s", "latency_s", "messages", "bytes", "tokens", "error"}]}

`cpu_s` is this process's CPU time over the job: what the clients took from the machine's cores.

It uses the generated stubs directly rather than the client library: the library rebuilds
snapshots (a cost of the client, not of serving), and the bytes a request costs on the wire are
the sum of its messages' `ByteSize()`. Stream modes are (name, StreamOptions builder) pairs;
the delta ones appear when the protos have `SNAPSHOT_FORMAT_DELTA`, `delta-provisional` when
they have `StreamOptions.provisional`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any, Callable

import grpc

from celeris.v1 import generation_pb2 as pb
from celeris.v1 import generation_pb2_grpc as pb_grpc

REQUEST_FIELDS = ("gen_length", "steps", "block_length", "threshold", "seed", "frequency_penalty", "presence_penalty")


def stream_modes() -> list[tuple[str, Callable[[], pb.StreamOptions]]]:
    """Every stream mode the protos offer, cheapest first among the every-step ones."""
    modes: list[tuple[str, Callable[[], pb.StreamOptions]]] = []
    if hasattr(pb, "SNAPSHOT_FORMAT_DELTA"):
        delta = pb.SNAPSHOT_FORMAT_DELTA
        modes.append(("delta", lambda: pb.StreamOptions(format=delta)))
    modes += [("full", lambda: pb.StreamOptions()),  # every step, whole snapshots (the default)
              ("block", lambda: pb.StreamOptions(mode=pb.STREAM_MODE_BLOCK_COMPLETE)),
              ("final", lambda: pb.StreamOptions(mode=pb.STREAM_MODE_FINAL_ONLY))]
    if hasattr(pb, "SNAPSHOT_FORMAT_DELTA"):
        modes.append(("block-delta", lambda: pb.StreamOptions(mode=pb.STREAM_MODE_BLOCK_COMPLETE,
                                                              format=pb.SNAPSHOT_FORMAT_DELTA)))
    if "provisional" in pb.StreamOptions.DESCRIPTOR.fields_by_name and hasattr(pb, "SNAPSHOT_FORMAT_DELTA"):
        # every step, deltas plus the block's predictions: what a live UI showing guesses asks for
        modes.append(("delta-provisional", lambda: pb.StreamOptions(format=pb.SNAPSHOT_FORMAT_DELTA,
                                                                    provisional=True)))
    return modes


OPT_IN_MODES = ("delta-provisional",)  # offered, but measured only when asked for by name


MODES = dict(stream_modes())


def build(spec: dict[str, Any], mode: str) -> pb.GenerateRequest:
    req = pb.GenerateRequest(prompt=spec["prompt"], stream_options=MODES[mode]())
    for f in REQUEST_FIELDS:
        if spec.get(f) is not None:
            setattr(req, f, spec[f])
    return req


async def one(stub: pb_grpc.GenerationServiceStub, req: pb.GenerateRequest) -> dict[str, Any]:
    """One stream: time to its first message, latency, messages, bytes on the wire, tokens."""
    t0 = time.perf_counter()
    first = None
    messages = size = tokens = 0
    try:
        async for msg in stub.Generate(req):
            if first is None:
                first = time.perf_counter() - t0
            messages += 1
            size += msg.ByteSize()
            if msg.done:
                tokens += msg.usage.generated_tokens
    except grpc.RpcError as e:
        t = time.perf_counter() - t0
        return {"ok": False, "first_s": t, "latency_s": t, "messages": messages, "bytes": size, "tokens": 0,
                "error": f"{e.code().name}: {e.details()}"}
    latency = time.perf_counter() - t0
    return {"ok": True, "first_s": latency if first is None else first, "latency_s": latency,
            "messages": messages, "bytes": size, "tokens": tokens, "error": None}


async def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """`concurrency` workers on one channel (one client process, one connection) drain the list."""
    reqs = [build(spec, job["mode"]) for spec in job["requests"]]
    records: list[dict[str, Any]] = [{}] * len(reqs)
    queue = list(enumerate(reqs))
    async with grpc.aio.insecure_channel(job["target"]) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        await channel.channel_ready()

        async def worker() -> None:
            while queue:
                i, req = queue.pop(0)
                records[i] = await one(stub, req)

        t0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(max(1, job["concurrency"]))))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"wall_s": wall, "cpu_s": cpu, "records": records}


def main() -> int:
    """Serve jobs until stdin closes; an unknown mode or a bad job answers {"error": ...}."""
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            answer = asyncio.run(run_job(json.loads(line)))
        except Exception as e:  # report, keep serving: the parent decides what a failure means
            answer = {"error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
