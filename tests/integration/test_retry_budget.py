"""Retries that cannot stampede (issue 40, items 5 and 9), against real `celeris serve` children.

A burst of client calls against a full server arrives as at most 1.5x the calls issued (the
client's retry budget, the server's queue-based RetryInfo with jitter), and `celeris batch` rides
out a server restart on the same port: every item ends "ok", each exactly once.

Arrivals are counted by the server itself: `celeris_requests_total` counts every Generate call
that reached the servicer, refused or served, once. No wall-clock bounds (CI is loaded).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from celeris_client import AsyncCelerisClient, CelerisError

pytestmark = pytest.mark.slow

BURST = 200
SHORT = dict(gen_length=8, steps=4, block_length=8, seed=1)


def arrivals(server) -> float:
    """Generate calls the server has recorded, whatever their outcome."""
    return sum(v for k, v in server.metrics().items() if k.startswith("celeris_requests_total{"))


def wait_settled(server, at_least: int) -> float:
    """The arrivals count once it stops moving (a refused call is recorded as its handler ends)."""
    last, stable = -1.0, 0
    while stable < 3:
        time.sleep(0.3)
        now = arrivals(server)
        stable = stable + 1 if now == last and now >= at_least else 0
        last = now
    return last


def test_a_burst_of_200_calls_arrives_as_at_most_one_and_a_half_times_as_many(spawn):
    server = spawn("--max-batch", "4", "--max-queue", "4")

    async def burst() -> list[object]:
        async with AsyncCelerisClient(server.target, timeout=120) as client:
            calls = [client.generate("It is a truth universally", **SHORT) for _ in range(BURST)]
            return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(burst())
    unexpected = [r for r in results if isinstance(r, BaseException) and not isinstance(r, CelerisError)]
    assert not unexpected, unexpected[:3]
    refused = [r for r in results if isinstance(r, CelerisError)]
    assert all(e.code == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused), {e.code for e in refused}
    assert len(refused) < BURST  # the server served some of the burst
    seen = wait_settled(server, BURST)
    print(f"burst of {BURST}: {seen:.0f} calls arrived ({seen / BURST:.2f}x), {BURST - len(refused)} served")
    assert seen <= 1.5 * BURST, f"{seen:.0f} calls arrived for {BURST} issued"


def test_celeris_batch_rides_out_a_server_restart_on_the_same_port(spawn, tmp_path):
    """kill -9 mid-batch, a few seconds down, a new server on the same port: every item ends
    "ok" exactly once (before: the items in flight and those started while it was down failed)."""
    from celeris_client import cli

    server = spawn()
    items = 60
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": f"q{k}", "prompt": f"It is a truth {k}"}) + "\n" for k in range(items)))
    argv = ["batch", str(inp), str(out), "--server", server.target, "--concurrency", "4", "--gen-length", "32",
            "--steps", "32", "--block-length", "32", "--seed", "1"]
    rc: list[int] = []
    runner = threading.Thread(target=lambda: rc.append(cli.main(argv)), daemon=True)
    runner.start()
    while len(lines(out)) < 4:  # under way
        assert runner.is_alive(), "the batch ended before the restart"
        time.sleep(0.05)
    server.close()  # kill -9
    done_at_kill = len(lines(out))
    time.sleep(3)
    spawn(port=server.port)
    runner.join(300)
    assert not runner.is_alive() and rc == [0], (rc, [r for r in lines(out) if r["status"] != "ok"][:3])
    records = lines(out)
    assert done_at_kill < items  # the restart happened mid-batch
    assert sorted(r["id"] for r in records) == sorted(f"q{k}" for k in range(items))  # each once
    assert all(r["status"] == "ok" for r in records)


def lines(path: Path) -> list[dict]:
    """The batch's whole output lines so far."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
