"""Hostile clients, round five (issue 60 item 1): a flood of tool schemas that compile for seconds
costs other clients little. Four chat requests at once, each with tools whose parameters are
distinct `allOf` of 4 x `anyOf` of 8 objects (~0.5 s each to compile on a 2-core VM), beside a
plain 16-token completion and `/health`: the plain request's time beside the flood against alone
(medians over 5 runs) and /health's slowest answer are printed, and asserted with a generous
margin only (CI runs at load 8 on 2 cores); the issue's bars (1.5x, 100 ms) are the printed
figures' to meet on a quiet machine.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import statistics
import time
import urllib.request

import pytest

from celeris.engine.config import EngineConfig
from celeris.engine.llm import LLM
from tests.integration.http_helpers import post
from tests.integration.live_server import live_server

pytestmark = pytest.mark.slow
RUNS = 5


def _schema(seed: int) -> dict:
    r = random.Random(seed)

    def obj(k: int) -> dict:
        return {"type": "object", "required": [f"p{seed}_{k}_0"], "properties": {
            f"p{seed}_{k}_{j}": {"type": r.choice(["string", "integer", "boolean"])} for j in range(2)}}
    return {"type": "object", "allOf": [{"anyOf": [obj(a * 8 + b) for b in range(8)]} for a in range(4)]}


def _flood_body(k: int, tools: int) -> dict:
    """`tools` slow schemas, then one the library refuses: every schema compiles, then a 400 (the
    flood costs its compiles, not a long prompt's decoding)."""
    bad = {"type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}
    return {"model": "celeris-tiny", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": f"f{k}_{i}", "parameters": _schema(k * 1000 + i)}}
                      for i in range(tools)] + [{"type": "function", "function": {"name": "bad", "parameters": bad}}]}


def _answer(live, body: dict) -> tuple[int, str]:
    r = post(live, "/v1/chat/completions", body)
    return r.status, r.read()[:160].decode(errors="replace")


def _plain(live) -> float:
    t0 = time.perf_counter()
    r = post(live, "/v1/completions", {"model": "celeris-tiny", "prompt": "It was", "max_tokens": 16, "seed": 1})
    assert r.status == 200, r.read()
    r.read()
    return time.perf_counter() - t0


def _health(live) -> float:
    t0 = time.perf_counter()
    with urllib.request.urlopen(live.http_url + "/health", timeout=30) as r:
        r.read()
    return time.perf_counter() - t0


def test_a_tool_schema_flood_beside_a_plain_request_and_health(capsys):
    llm = LLM.load(None, EngineConfig(max_prompt_tokens=65536, max_gen_length=64))
    with live_server(llm) as live:
        _plain(live)  # warm
        alone = statistics.median(_plain(live) for _ in range(RUNS))
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            flood = [pool.submit(_answer, live, _flood_body(k, 10)) for k in range(4)]
            time.sleep(0.5)  # the flood is compiling
            beside, health = [], []
            for _ in range(RUNS):
                beside.append(_plain(live))
                health.append(_health(live))
            statuses = [f.result() for f in flood]
        ratio = statistics.median(beside) / alone
        with capsys.disabled():
            print(f"\n[issue 60 item 1] plain 16-token completion: alone {alone:.3f} s, beside 4 x 10-tool flood "
                  f"{statistics.median(beside):.3f} s (median of {RUNS}): {ratio:.2f}x; /health slowest "
                  f"{max(health) * 1000:.0f} ms, median {statistics.median(health) * 1000:.0f} ms; flood answers "
                  f"{statuses}")
        assert all(s == 400 and "uniqueItems" in text for s, text in statuses), statuses  # refused after compiling
        assert ratio < 4.0 and max(health) < 1.0, (ratio, health)
