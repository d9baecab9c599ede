"""DiffusionGemma's step at 8 rows vs 1 row on the CPU (issue 62): what one shared forward saves.

    python scripts/bench_gemma_batch.py --threads 1 --json out.json

For each shape (random weights, float32): rows past their first step (each holding its
self-conditioning input; prompts of 12-19 tokens, so every row reads a cache of its own length),
steady-state steps of `slots.step_rows` timed one at a time, interleaved between three setups:
one row; 8 rows in one shared forward (the default on the CPU); 8 rows each in its own forward
(`model.shared_forward = False`: how the step ran before issue 62). CPU time is the process's
(`time.process_time`, every thread), wall time beside it; medians over the repeats. A step's time
includes the draws (the sampler), which are per row either way.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from celeris.engine.families.revise.config import gemma_config  # noqa: E402
from celeris.engine.families.revise.sampler import ReviseParams  # noqa: E402
from celeris.engine.families.revise.slots import SlotState, step_rows  # noqa: E402
from celeris.engine.families.revise.weights import random_gemma  # noqa: E402

LAYERS = {"num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "num_global_key_value_heads": 1,
          "sliding_window": 64}
SHAPES = {  # name: (text config, canvas)
    "tiny": (dict(LAYERS, hidden_size=32, head_dim=8, global_head_dim=16, intermediate_size=48,
                  moe_intermediate_size=16, num_experts=8, top_k_experts=3, vocab_size=96), 8),
    "mid": (dict(LAYERS, hidden_size=512, head_dim=64, global_head_dim=128, intermediate_size=1024,
                 moe_intermediate_size=256, num_experts=16, top_k_experts=3, vocab_size=4096), 64),
    "wide": (dict(LAYERS, hidden_size=1024, head_dim=128, global_head_dim=256, intermediate_size=2048,
                  moe_intermediate_size=512, num_experts=32, top_k_experts=4, vocab_size=8192), 128),
}
P = ReviseParams(max_denoising_steps=1024, confidence_threshold=0.0)  # no canvas stops: steps only


def model_of(name: str):
    text, canvas = SHAPES[name]
    raw = {"architectures": ["DiffusionGemmaForBlockDiffusion"], "canvas_length": canvas, "text_config": text}
    return random_gemma(gemma_config(raw, name=f"bench-{name}"), "float32", seed=1)


def setup(model, batch: int) -> list[SlotState]:
    seqs = [SlotState(model, [2] + [5 + (r * 7 + i) % 80 for i in range(11 + r)], P, r, model.cfg.canvas_length,
                      (), 0, batched_encoding=True) for r in range(batch)]
    step_rows(model, seqs)  # encode, first step: from here every row holds its self-conditioning input
    return seqs


def timed(model, seqs: list[SlotState], shared: bool) -> tuple[float, float]:
    model.shared_forward = shared
    before = model.calls.denoise
    c0, w0 = time.process_time(), time.perf_counter()
    step_rows(model, seqs)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    assert model.calls.denoise - before == (1 if shared else len(seqs))
    return cpu, wall


def bench(name: str, repeats: int) -> dict:
    model = model_of(name)
    runs = {"1 row": (setup(model, 1), True), "8 rows, one forward": (setup(model, 8), True),
            "8 rows, a forward each": (setup(model, 8), False)}
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
    for _ in range(2):  # warm-up
        for k, (seqs, shared) in runs.items():
            timed(model, seqs, shared)
    for _ in range(repeats):  # interleaved: the shared machine's load falls on every setup alike
        for k, (seqs, shared) in runs.items():
            times[k].append(timed(model, seqs, shared))
    med = {k: (statistics.median(c for c, _ in v) * 1e3, statistics.median(w for _, w in v) * 1e3)
           for k, v in times.items()}
    one = med["1 row"][0]
    text, canvas = SHAPES[name]
    return {"shape": name, "d_model": text["hidden_size"], "experts": f"{text['num_experts']} top-{text['top_k_experts']}",
            "canvas": canvas, "vocab": text["vocab_size"], "layers": text["num_hidden_layers"],
            "cpu_ms": {k: round(c, 2) for k, (c, _) in med.items()},
            "wall_ms": {k: round(w, 2) for k, (_, w) in med.items()},
            "8_vs_1_cpu": {k: round(c / one, 2) for k, (c, _) in med.items() if k != "1 row"}}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="tiny,mid,wide")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    report = {"machine": f"{cpu_name()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads",
              "load_average": os.getloadavg()[0],
              "torch": torch.__version__, "dtype": "float32", "repeats": a.repeats,
              "results": [bench(s, a.repeats) for s in a.shapes.split(",")]}
    print(json.dumps(report, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
