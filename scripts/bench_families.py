"""The 2026 families on the CPU: forwards per block and tokens per forward, by decoder.

    python scripts/bench_families.py            # 8 prompts, gen_length 64, each decoder, 3 repeats
    python scripts/bench_families.py --quick    # 4 prompts, gen_length 32, 1 repeat

Each family is a tiny random checkpoint in its released format (written by the tests' helpers:
its speed and its decoding's shape are the point, not its text), served by the in-process engine
with every prompt in one batch. Per decoder: forwards per decoded block (every forward a request
ran after its prompt: denoise steps and block stores), output tokens per forward, output tokens/s
(generated tokens up to the first stop / wall time). Medians of --repeats. docs/benchmarks.md has the figures and their conditions.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from celeris.engine.config import EngineConfig  # noqa: E402
from celeris.engine.llm import LLM  # noqa: E402
from celeris.engine.sampling.params import SamplingParams  # noqa: E402
from tests.unit.block_references.llada22 import write_llada22_checkpoint  # noqa: E402

PROMPTS = [[17, 301, 45], [88, 5, 640, 31, 77, 402, 15, 9], [12, 33, 999, 4, 58, 61, 700, 13, 90, 210, 6],
           [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30,
            31, 32, 33, 34, 35, 36, 37], [400], [401, 402], [403, 404, 405, 406, 407], [500] * 20]


def llada22(folder: Path) -> Path:
    """LLaDA2.2's format: 2 layers, 8 experts (capacity 4 per 32-token block), edits favoured."""
    return write_llada22_checkpoint(folder, seed=3, edit_scale=2.0, num_hidden_layers=2)


# family: (writer, {decoder: knobs}); steps = gen_length (32 per 32-token block, as published)
FAMILIES = {
    "llada2.2": (llada22, {
        "joint, published defaults (0.5 / 0.0 / 16)": dict(threshold=0.5, editing_threshold=0.0, max_post_steps=16),
        "joint, Q-like (0.95 / 0.9 / 16)": dict(threshold=0.95, editing_threshold=0.9, max_post_steps=16),
        "threshold 0.5, no edits": dict(threshold=0.5, editing_threshold=None),
    }),
}


def run(llm: LLM, prompts: list[list[int]], gen: int, knobs: dict) -> dict:
    seqs = [llm.sequence(p, SamplingParams(seed=i, gen_length=gen, block_length=32, steps=gen, **knobs))
            for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    for s in seqs:
        llm.loop.add(s)
    llm.loop.run_to_completion()
    wall = time.perf_counter() - t0
    tokens = sum(len(s.generated()) for s in seqs)
    forwards = sum(s.nfe - s.prefill_steps for s in seqs)
    blocks = sum(s.block - s.first_block + 1 for s in seqs)
    return dict(per_block=forwards / blocks, per_forward=tokens / forwards, tps=tokens / wall, wall=wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    prompts, gen, repeats = (PROMPTS[:4], 32, 1) if a.quick else (PROMPTS, 64, a.repeats)
    print(f"{len(prompts)} prompts in one batch, gen_length {gen}, block 32, float32, CPU, median of {repeats}")
    print("| family | decoder | forwards per block | tokens per forward | tokens/s |")
    print("|---|---|---|---|---|")
    for family, (write, decoders) in FAMILIES.items():
        with tempfile.TemporaryDirectory() as tmp:
            llm = LLM.load(write(Path(tmp) / family), EngineConfig(max_batch=len(prompts), max_prompt_tokens=64,
                                                                  max_gen_length=gen))
            for name, knobs in decoders.items():
                rows = [run(llm, prompts, gen, knobs) for _ in range(repeats)]
                med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
                print(f"| {family} | {name} | {med['per_block']:.1f} | {med['per_forward']:.2f} | {med['tps']:.0f} |")


if __name__ == "__main__":
    main()
