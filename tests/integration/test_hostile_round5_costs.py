"""Hostile clients, round five: what one client's costs do to another's, measured (slow).

Item 1: a flood of tool schemas that compile for seconds costs other clients little. Four chat
requests at once, each with tools whose parameters are distinct `allOf` of 4 x `anyOf` of 8 objects (~0.5 s each to compile on a 2-core VM), beside a
plain 16-token completion and `/health`: the plain request's time beside the flood against alone
(medians over 5 runs) and /health's slowest answer are printed, and asserted with a generous
margin only (CI runs at load 8 on 2 cores); the issue's bars (1.5x, 100 ms) are the printed
figures' to meet on a quiet machine. Items 5 and 6 (a structured n=16 call beside a short completion,
a 4,000-token prompt beside eight streams) below, printed the same way.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import random
import statistics
import time
import urllib.request
from urllib.parse import urlparse

import pytest
import torch

from celeris.engine.config import EngineConfig
from celeris.engine.families.block.sequence import PREFILL
from celeris.engine.llm import LLM
from celeris.engine.sampling.params import SamplingParams
from tests.integration.http_helpers import post
from tests.integration.live_server import live_server
from tests.unit.block_references.checkpoints import write_sdar_checkpoint

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


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "days"],
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}


def _as(live, path: str, body: dict, client: str):
    """A POST from `client` (the server keys clients on X-Forwarded-For here): (status, body).
    No read timeout of its own: the n=16 call takes minutes on a loaded machine."""
    conn = http.client.HTTPConnection("127.0.0.1", urlparse(live.http_url).port, timeout=1800)
    conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json",
                                                          "X-Forwarded-For": client})
    r = conn.getresponse()
    return r.status, r.read()


def _plain_from(live, client: str) -> float:
    t0 = time.perf_counter()
    status, body = _as(live, "/v1/completions", {"model": "celeris-tiny", "prompt": "It was", "max_tokens": 16,
                                                 "seed": 1}, client)
    assert status == 200, body
    return time.perf_counter() - t0


def test_an_n16_required_tool_call_beside_another_clients_completion(capsys):
    """Issue 60 item 5: one client's n=16 "required" call (16 structured rows over a ~340-token
    prompt) beside another client's 16-token completion. Its structured rows keep to their share
    of each step's mask work (engine/loop/fair_share.within_constraint_budget), its rows to their
    share of a forward's tokens, and a row's wait counts in its own steps' cost
    (engine/loop/time_share.py). Both medians measured in this run and printed; asserted at 3x
    only (CI at load 8), the issue's bar being 2x."""
    llm = LLM.load(None, EngineConfig(max_prompt_tokens=512, max_gen_length=64))
    with live_server(llm, trust_forwarded_for=True) as live:
        _plain_from(live, "10.0.0.1")  # warm
        alone = statistics.median(_plain_from(live, "10.0.0.1") for _ in range(RUNS))
        body = {"model": "celeris-tiny", "n": 16, "max_tokens": 48, "tool_choice": "required", "tools": [WEATHER],
                "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            call = pool.submit(_as, live, "/v1/chat/completions", body, "10.0.0.2")
            time.sleep(1.0)  # its rows are running
            beside = [_plain_from(live, "10.0.0.1") for _ in range(RUNS)]
            status, text = call.result()
        ratio = statistics.median(beside) / alone
        with capsys.disabled():
            print(f"\n[issue 60 item 5] 16-token completion: alone {alone:.3f} s, beside another client's n=16 "
                  f"required tool call {statistics.median(beside):.3f} s (median of {RUNS}): {ratio:.2f}x "
                  f"(runs {', '.join(f'{b:.2f}' for b in beside)}); load average {os.getloadavg()[0]:.1f}")
        assert status == 200 and len(json.loads(text)["choices"]) == 16, text[:300]
        assert ratio < 3.0, ratio


BEFORE = 60  # decode-only steps measured before the long prompt comes (the streams outlast its prefill)


def _sdar_4k(folder) -> LLM:
    write_sdar_checkpoint(folder, max_position_embeddings=8192, hidden_size=128, intermediate_size=256, head_dim=32,
                          num_hidden_layers=4)
    return LLM.load(folder, EngineConfig(max_batch=16, max_prompt_tokens=4096, max_gen_length=256,
                                         prefix_cache_bytes=0))


def test_a_4000_token_prompt_beside_eight_streams(tmp_path, capsys):
    """Issue 60 item 6: eight streams decode (a block of 4 a step) when a 4,000-token prompt
    arrives. The step loop's own step times: the median of the 60 steps before it against the
    worst and the median while it prefills, printed with the worst step before (the machine's own
    spikes: a shared 2-core VM stalls a 4-token step now and then). On a quiet machine the worst is the issue's
    bar (2x); a loaded one's steps vary several-fold alone (one step of 200 ms among 24 ms ones at
    load 5), so the assertion compares the prefill steps' median, which the pacer aims at 1.5x the
    steps before, at 3x."""
    llm = _sdar_4k(tmp_path / "sdar-4k")
    rnd = random.Random(0)
    seqs = [llm.sequence([rnd.randrange(10, 250) for _ in range(8)],
                         SamplingParams(seed=k, gen_length=256, steps=256, block_length=4, stop_at_eos=False))
            for k in range(8)]
    times: list[float] = []
    with torch.inference_mode():
        for s in seqs:
            llm.loop.add(s, bounded=False)
        for _ in range(BEFORE + 10):
            times.append(llm.loop.step()[1].stats.seconds)
        long = llm.sequence([rnd.randrange(10, 250) for _ in range(4000)],
                            SamplingParams(seed=99, gen_length=16, steps=16, block_length=4, stop_at_eos=False))
        llm.loop.add(long, bounded=False)
        during: list[float] = []
        while long.nfe == 0 or long.phase == PREFILL:
            during.append(llm.loop.step()[1].stats.seconds)
    before, noise = statistics.median(times[10:]), max(times[10:])
    worst, p90 = max(during), sorted(during)[int(0.9 * (len(during) - 1))]
    with capsys.disabled():
        print(f"\n[issue 60 item 6] 4,000-token prompt beside 8 streams: step median before {before * 1000:.1f} ms; "
              f"during its prefill ({len(during)} steps) median {statistics.median(during) * 1000:.1f} ms, 90th "
              f"percentile {p90 * 1000:.1f} ms, worst {worst * 1000:.1f} ms = {worst / before:.2f}x (the worst of the "
              f"{BEFORE} steps before: {noise / before:.2f}x); load average {os.getloadavg()[0]:.1f}")
    assert len(during) < 4000 // 4  # chunks of several blocks, not one a step
    assert statistics.median(during) < 3 * before, (during, before)
