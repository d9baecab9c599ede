"""Nemotron-Labs-Diffusion's three modes side by side on the CPU, in the engine (step-level batching).

A random checkpoint of celeris-tiny's size in the released format (written to a temp folder, with
a random r-16 draft adapter), N prompts of celeris-tiny's tokenizer decoded together per mode:
ar, diffusion (block b, threshold), linear_spec (block b). Reported per mode: output tokens/s
(generated non-EOS tokens / wall time), forwards per request, tokens per forward (generated /
forwards of a request), denoise steps per block (diffusion) and accepted tokens per verify pass
(linear_spec). Random weights: a random adapter drafts what the model would not write, so
linear_spec accepts about one token a pass here; its figure on a released checkpoint is the
adapter's, not measurable without one. Usage: python scripts/bench_nemotron.py [--batch 8] [--gen 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from celeris.engine.config import EngineConfig  # noqa: E402
from celeris.engine.llm import LLM  # noqa: E402
from tests.helpers import TEXTS  # noqa: E402
from tests.unit.families.nemotron_helpers import write_tiny_nemotron  # noqa: E402


def run_mode(llm: LLM, prompts: list[str], mode: str, a: argparse.Namespace) -> dict:
    p = replace(llm.defaults, decoding=mode, gen_length=a.gen, steps=a.gen, block_length=a.block,
                threshold=a.threshold if mode == "diffusion" else None, stop_at_eos=False)
    seqs = [llm.request(x, p.with_seed(i)) for i, x in enumerate(prompts)]
    t0 = time.perf_counter()
    llm.run(seqs)
    wall = time.perf_counter() - t0
    tokens = sum(len(s.generated()) for s in seqs)
    forwards = sum(s.nfe for s in seqs) / len(seqs)
    row = {"mode": mode, "batch": len(seqs), "tokens_per_s": round(tokens / wall, 1),
           "forwards_per_request": round(forwards, 1), "tokens_per_forward": round(tokens / len(seqs) / forwards, 2)}
    if mode == "diffusion":
        blocks = a.gen // a.block
        denoise = forwards - 1 - (blocks - 1)  # less the prefill and the store steps between blocks
        row["denoise_steps_per_block"] = round(denoise / blocks, 2)
    if mode == "linear_spec":
        row["accepted_per_verify"] = round(sum(s.accepted_tokens for s in seqs) / sum(s.verify_passes for s in seqs), 2)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_tiny_nemotron(Path(tmp) / "nemotron", d_model=128, n_heads=4, n_kv_heads=2, head_dim=32,
                                     n_layers=4, mlp_hidden_size=384)
        llm = LLM.load(folder, EngineConfig(max_batch=a.batch, max_prompt_tokens=128, max_gen_length=a.gen))
        prompts = (TEXTS * a.batch)[:a.batch]
        run_mode(llm, prompts[:1], "ar", a)  # warm-up
        rows = [run_mode(llm, prompts, m, a) for m in ("ar", "diffusion", "linear_spec")]
    print(json.dumps({"conditions": {"gen_length": a.gen, "block_length": a.block, "threshold": a.threshold,
                                     "threads": a.threads, "dtype": "float32", "device": "cpu"}, "rows": rows},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
