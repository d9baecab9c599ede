"""Steps/s and tokens/s of the batched denoising step, CUDA graphs on vs off.

    python scripts/bench_gpu.py                 # LLaDA-8B architecture, random bf16 weights, CUDA
    python scripts/bench_gpu.py --arch sdar     # SDAR-8B architecture (block diffusion, exact KV cache)
    python scripts/bench_gpu.py --tiny          # a tiny config on CPU (what CI-class machines can run)

Weights are random (no download): the step's cost depends on shapes, not values. Every request
uses the fixed schedule (gen_length / steps tokens per denoising step); tokens/s counts the
tokens the measured steps committed (block models also spend prefill and store forwards).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from celeris.engine.config import EngineConfig, ModelConfig  # noqa: E402
from celeris.engine.model import MaskPredictor  # noqa: E402
from celeris.engine.params import SamplingParams  # noqa: E402
from celeris.engine.block_runner import BlockRunner  # noqa: E402
from celeris.engine.block_sequence import BlockSequence  # noqa: E402
from celeris.engine.runner import Runner  # noqa: E402
from celeris.engine.sequence import Sequence  # noqa: E402

LLADA_8B = ModelConfig(d_model=4096, n_heads=32, n_kv_heads=32, n_layers=32, mlp_hidden_size=12288,
                       vocab_size=126464, embedding_size=126464, rope_theta=500000.0, mask_token_id=126336,
                       eos_token_id=126081, name="llada-8b-random")
SDAR_8B = ModelConfig(arch="sdar", d_model=4096, n_heads=32, n_kv_heads=8, n_layers=36, mlp_hidden_size=12288,
                      vocab_size=151936, embedding_size=151936, rope_theta=1e6, mask_token_id=151669,
                      eos_token_id=151643, explicit_head_dim=128, qk_norm=True, block_length=4,
                      name="sdar-8b-random")
TINY_SDAR = ModelConfig(arch="sdar", d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, mlp_hidden_size=128,
                        vocab_size=512, embedding_size=512, mask_token_id=3, eos_token_id=2, qk_norm=True,
                        block_length=4, name="tiny-sdar-random")
TINY = ModelConfig(d_model=64, n_heads=4, n_kv_heads=4, n_layers=2, mlp_hidden_size=128, vocab_size=512,
                   embedding_size=512, mask_token_id=3, eos_token_id=2, name="tiny-random")


def random_model(cfg: ModelConfig, device: str, dtype: torch.dtype) -> MaskPredictor:
    with torch.device("meta"):
        model = MaskPredictor(cfg)
    model = model.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() == 2 else p.fill_(1.0)
    return model.eval().requires_grad_(False)


def measure(model: MaskPredictor, batch: int, graphs: bool, args) -> dict:
    device = next(model.parameters()).device
    cfg = EngineConfig(device=str(device), max_batch=max(batch, 1), max_prompt_tokens=args.prompt_len,
                       max_gen_length=args.gen_length, cuda_graphs=graphs)
    block = model.cfg.family == "block"
    runner = (BlockRunner if block else Runner)(model, cfg)
    params = SamplingParams(gen_length=args.gen_length, steps=args.steps,
                            block_length=model.cfg.block_length if block else args.block_length,
                            seed=0, stop_at_eos=False).validate(args.gen_length)
    kind = BlockSequence if block else Sequence

    def fresh(i: int) -> Sequence:
        s = kind(f"r{i}", [5 + i] * args.prompt_len, params, model.cfg.mask_token_id, frozenset())
        s.slot = i
        runner.load(s)
        return s

    seqs = [fresh(i) for i in range(batch)]

    def one_step() -> int:
        results, stats = runner.step(seqs)
        for i, r in enumerate(results):  # keep the schedule moving; a finished canvas starts over
            seqs[i].apply(r.positions, r.tokens, r.confidences)
            if seqs[i].finished:
                seqs[i] = fresh(i)
        return stats.committed

    for _ in range(args.warmup):
        one_step()
    times, committed = [], 0
    for _ in range(args.iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        committed += one_step()  # the step itself syncs once when it reads results back
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    return {"batch": batch, "cuda_graphs": graphs and device.type == "cuda" and not block,
            "median_step_ms": round(1e3 * step_s, 3), "steps_per_s": round(1 / step_s, 2),
            "tokens_per_s": round(committed / args.iters / step_s, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny config (CPU smoke run)")
    ap.add_argument("--arch", default="llada", choices=("llada", "sdar"),
                    help="llada: LLaDA-8B (full canvas); sdar: SDAR-8B (block diffusion, block 4, exact cache)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64, help="tokens per step = gen_length / steps")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.tiny
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    configs = {"llada": (TINY, LLADA_8B), "sdar": (TINY_SDAR, SDAR_8B)}[a.arch]
    model = random_model(configs[0] if a.tiny or not cuda else configs[1], device, dtype)
    rows = []
    for batch in (int(b) for b in a.batches.split(",")):
        for graphs in ((False, True) if cuda and model.cfg.family == "full" else (False,)):
            r = measure(model, batch, graphs, a)
            rows.append(r)
            print(json.dumps(r), flush=True)
    cond = {"model": model.cfg.name, "device": torch.cuda.get_device_name() if cuda else "cpu",
            "dtype": str(dtype).replace("torch.", ""), "prompt_len": a.prompt_len, "gen_length": a.gen_length,
            "block_length": model.cfg.block_length or a.block_length, "steps": a.steps,
            "tokens_per_step": a.gen_length // a.steps,
            "threads": torch.get_num_threads()}
    print(json.dumps(cond))
    if a.json:
        a.json.write_text(json.dumps({"conditions": cond, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
