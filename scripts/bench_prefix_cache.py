"""The prefix cache and chunked prefill, measured on the CPU (issue 44).

    python scripts/bench_prefix_cache.py [--model celeris-tiny-block] [--repeats 5]

1. Time to first snapshot (the first step that commits tokens) of turns 2-4 of a 4-turn chat whose
   prompts share a 400-token prefix, cache on vs off, median of `repeats`, side by side in one
   run (each repeat a fresh prefix; cold and cached engines alternate so both see the same load).
2. The step latency of 8 running short streams while a 900-token prompt prefills, chunked vs
   one-forward prefill, both measured in this run (median of `repeats`): the median step during
   the prefill over the median before it, the worst step during it over the worst of as many
   steps before it (like with like), and the worst during over the median before (the first
   figure reported, which sets one step's noise against a median).
Tokens are checked equal cache on and off; figures go to docs/benchmarks.md with their conditions.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from celeris.engine.families.block.sequence import PREFILL
from celeris.engine.config import EngineConfig
from celeris.engine.llm import LLM
from celeris.engine.sampling.params import SamplingParams

PARAMS = dict(gen_length=16, block_length=4, steps=16, seed=0)


def ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(5, 1000) for _ in range(n)]


def engine(model: str, cache: bool, chunked: bool = True) -> LLM:
    return LLM.load(model, EngineConfig(max_batch=9, max_prompt_tokens=1024, max_gen_length=128,
                                        prefill_chunk=256 if chunked else 1024, chunked_prefill=chunked,
                                        prefix_cache_bytes=(256 << 20) if cache else 0))


def first_snapshot(llm: LLM, prompt: list[int]) -> tuple[float, list[int]]:
    """Seconds from submission to the first step that commits tokens; the decode."""
    seq = llm.sequence(prompt, SamplingParams(**PARAMS))
    t0 = time.perf_counter()
    llm.loop.add(seq)
    ttfs = None
    while not seq.finished:
        events, _ = llm.loop.step()
        if ttfs is None and any(ev.committed for ev in events if ev.request_id == seq.request_id):
            ttfs = time.perf_counter() - t0
    return ttfs, seq.generated()


def chat_turns(model: str, repeats: int) -> None:
    cold, warm = engine(model, cache=False), engine(model, cache=True)
    times = {(c, t): [] for c in ("cold", "cached") for t in (2, 3, 4)}
    for r in range(repeats):
        rng = random.Random(r)
        history = ids(400, rng)
        for turn in range(1, 5):
            prompt = history + ids(12, rng)
            order = [("cold", cold), ("cached", warm)] if r % 2 == 0 else [("cached", warm), ("cold", cold)]
            outs = {}
            for name, llm in order:
                t, outs[name] = first_snapshot(llm, prompt)
                if turn > 1:
                    times[(name, turn)].append(t)
            assert outs["cold"] == outs["cached"], "the cache changed a decode"
            history = prompt + outs["cold"]
    print(f"time to first snapshot, 4-turn chat, 400-token shared prefix (+12 per user turn, 16 generated), "
          f"median of {repeats} [{model}]")
    print("turn  prompt~  cold ms  cached ms  ratio")
    for t in (2, 3, 4):
        c, w = statistics.median(times[("cold", t)]), statistics.median(times[("cached", t)])
        print(f"{t:>4}  {400 + 12 * t + 16 * (t - 1):>7}  {c * 1e3:7.1f}  {w * 1e3:9.1f}  {w / c:5.2f}")


def stall(model: str, chunked: bool, rng: random.Random) -> tuple[list[float], list[float]]:
    """8 short streams step alone (the baseline), then a 900-token prompt arrives: the seconds of
    their steps before it (two warm-up steps dropped; as many as the prefill can take) and while
    it prefills."""
    llm = engine(model, cache=False, chunked=chunked)
    streams = [llm.sequence(ids(16, rng), SamplingParams(**{**PARAMS, "gen_length": 128, "steps": 128,
                                                            "stop_at_eos": False}))
               for _ in range(8)]
    for s in streams:
        llm.loop.add(s)
    before = []
    for _ in range(2 + BASE_STEPS):
        _, rec = llm.loop.step()
        before.append(rec.ended - rec.started)
    long = llm.sequence(ids(900, rng), SamplingParams(**PARAMS))
    llm.loop.add(long)
    during = []
    while long.slot < 0 or long.phase == PREFILL:
        _, rec = llm.loop.step()
        during.append(rec.ended - rec.started)
    assert not any(s.finished for s in streams), "the streams must outlive the prefill"
    assert len(during) <= BASE_STEPS, "fewer baseline steps than steps during the prefill"
    return before[2:], during


BASE_STEPS = 32  # baseline steps kept: at least the steps a chunked 900-token prefill takes


def chunked_prefill(model: str, repeats: int) -> None:
    """Per repeat: the median step during the prefill over the median before it; the worst step
    during it over the worst of as many baseline steps (the last ones before it: like with like);
    and, as first reported, the worst during over the median before. Medians over repeats."""
    print(f"\nstep latency of 8 running streams (16-token prompts, block 4) while a 900-token prompt prefills, "
          f"median of {repeats} [{model}]")
    print("prefill      steps  median before  median during  ratio  worst of n before  worst during  ratio"
          "  worst during / median before")
    for chunked in (True, False):
        rows = [stall(model, chunked, random.Random(100 + r)) for r in range(repeats)]
        fig = {k: [] for k in ("mb", "md", "wb", "wd")}
        for before, during in rows:
            fig["mb"].append(statistics.median(before))
            fig["md"].append(statistics.median(during))
            fig["wb"].append(max(before[-len(during):]))
            fig["wd"].append(max(during))
        med = {k: statistics.median(v) * 1e3 for k, v in fig.items()}
        ratio = {k: statistics.median(a / b for a, b in zip(fig[k[0]], fig[k[1]]))
                 for k in (("md", "mb"), ("wd", "wb"), ("wd", "mb"))}
        name = "chunked" if chunked else "one forward"
        print(f"{name:<12} {len(rows[0][1]):>5}  {med['mb']:13.1f}  {med['md']:13.1f}  {ratio[('md', 'mb')]:5.2f}"
              f"  {med['wb']:17.1f}  {med['wd']:12.1f}  {ratio[('wd', 'wb')]:5.2f}  {ratio[('wd', 'mb')]:28.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="celeris-tiny-block")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", choices=("chat", "stall"), default=None, help="run one of the two measurements")
    a = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, CPU")
    if a.only != "stall":
        chat_turns(a.model, a.repeats)
    if a.only != "chat":
        chunked_prefill(a.model, a.repeats)


if __name__ == "__main__":
    main()
