"""DiffusionGemma on one device (issue #46): peak memory per sequence and decode throughput, random
weights of the real 26B-A4B shapes (vocabulary 262,144, canvas 256), one JSON report.

    python scripts/bench_gemma.py --json out.json            # CUDA, bf16, the 26B-A4B shapes
    python scripts/bench_gemma.py --smoke --json out.json    # the same phases on the CPU, tiny layers
    python scripts/bench_gemma.py --phases memory --layers tiny --vocab 262144 --device cpu   # the CPU proxy

Phases:
- memory: one steady-state step (every row past its first step, so holding its self-conditioning
  input) at batch 1 and 8: the (L, V) bytes the rows hold between steps, and the step's transient
  peak above its start. CUDA: torch.cuda.max_memory_allocated. CPU: the profiler's allocation and
  free events in time order (the same proxy tests/unit/families/test_revise_memory.py asserts).
  Both divided per sequence. Runs against the tree it is imported from (a worktree for "before").
- decode: whole canvases through the runner's step (slots.step_rows), batch 1 and 8, 16 and 48
  denoising steps a canvas (the stop rule off: every canvas runs all its steps), prompt 64 encoded
  before the clock starts. decode tok/s = 256 x batch / wall of the canvas's steps.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from celeris.engine.families.revise.config import gemma_config  # noqa: E402
from celeris.engine.families.revise.model import DiffusionGemma  # noqa: E402
from celeris.engine.families.revise.sampler import ReviseParams  # noqa: E402
from celeris.engine.families.revise.slots import SlotState, step_rows  # noqa: E402

# google/diffusiongemma-26B-A4B-it's text config (every sixth layer global, the last global).
GEMMA_26B_A4B = {"hidden_size": 2816, "num_hidden_layers": 30, "num_attention_heads": 16, "num_key_value_heads": 8,
                 "num_global_key_value_heads": 2, "head_dim": 256, "global_head_dim": 512, "intermediate_size": 2112,
                 "moe_intermediate_size": 704, "num_experts": 128, "top_k_experts": 8, "vocab_size": 262144,
                 "sliding_window": 1024, "final_logit_softcapping": 30.0}
TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "global_head_dim": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "num_experts": 4,
        "top_k_experts": 2, "vocab_size": 512, "sliding_window": 8}
VLLM = {"decode_tok_s_batch1_fp8_16_steps": 1756, "conditions": "vLLM, one H100, FP8, batch 1, 16 steps a canvas "
        "(decode only); 612 end-to-end tok/s on an A100, bf16, batch 1, GSM8K (issue #46's figures)"}


def make_model(layers: dict, vocab: int, canvas: int, dtype: torch.dtype, device: str) -> DiffusionGemma:
    raw = {"architectures": ["DiffusionGemmaForBlockDiffusion"], "canvas_length": canvas,
           "text_config": dict(layers, vocab_size=vocab)}
    cfg = gemma_config(raw, name="diffusion-gemma-random")
    try:
        from celeris.engine.families.revise.weights import random_gemma
    except ImportError:  # the tree before #46: made here the same way
        with torch.device("meta"):
            model = DiffusionGemma(cfg).to(dtype)
        model = model.to_empty(device=device)
        with torch.no_grad():
            for name, t in model.state_dict().items():
                t.fill_(1.0) if "norm" in name or name.endswith(("scalar", "scale")) else t.normal_(0.0, 0.02)
        return model.eval()
    return random_gemma(cfg, dtype, device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def rows(model: DiffusionGemma, batch: int, steps: int, prompt: int = 64) -> list[SlotState]:
    p = ReviseParams(max_denoising_steps=steps, confidence_threshold=0.0)  # never confident: all steps run
    L = model.cfg.canvas_length
    return [SlotState(model, [2] + [3 + (r * 7 + i) % 1000 for i in range(prompt - 1)], p, r, L, (), 0)
            for r in range(batch)]


def held_bytes(seqs: list[SlotState], vocab: int) -> int:
    """What the rows keep between steps in full-vocabulary tensors (the self-conditioning input)."""
    return sum(t.nbytes for s in seqs for t in vars(s).values()
               if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[-1] == vocab)


def cpu_step_peak(model: DiffusionGemma, seqs: list[SlotState], warm: int) -> tuple[int, int]:
    """(peak live bytes above the measured step's start, allocations of >= one (L, V) float32), from the
    profiler's memory events; the warm-up steps run inside it so every free is of a known block."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(warm):
            step_rows(model, seqs)
        with record_function("measured step"):
            step_rows(model, seqs)
    events = list(prof.profiler.kineto_results.events())
    mark = next(e for e in events if e.name() == "measured step")
    start, end = mark.start_ns(), mark.start_ns() + mark.duration_ns()
    full = model.cfg.canvas_length * model.cfg.vocab_size * 4
    live, at_start, peak, big = 0, None, 0, 0
    for t, n in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        if t >= start and at_start is None:
            at_start = live
        live += n
        if start <= t <= end:
            peak, big = max(peak, live - at_start), big + (n >= full)
    return peak, big


def memory_phase(model: DiffusionGemma, device: torch.device, batches: list[int]) -> list[dict]:
    cfg, out = model.cfg, []
    full = cfg.canvas_length * cfg.vocab_size * 4
    for batch in batches:
        seqs = rows(model, batch, steps=8, prompt=16)
        big = None
        if device.type == "cuda":
            for _ in range(2):
                step_rows(model, seqs)
            sync(device)
            held = held_bytes(seqs, cfg.vocab_size)
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step_rows(model, seqs)
            sync(device)
            peak = torch.cuda.max_memory_allocated() - base
        else:
            peak, big = cpu_step_peak(model, seqs, warm=2)
            held = held_bytes(seqs, cfg.vocab_size)  # after the step: the rows hold the same between steps
        row = {"phase": "memory", "batch": batch, "held_per_seq_mib": round(held / batch / 2**20, 1),
               "step_transient_peak_per_seq_mib": round(peak / batch / 2**20, 1),
               "per_seq_mib": round((held + peak) / batch / 2**20, 1),
               "per_seq_in_full_vocab_fp32": round((held + peak) / batch / full, 2),
               "full_vocab_fp32_allocs_in_step": big, "one_full_vocab_fp32_mib": round(full / 2**20, 1),
               "how": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "profiler memory events"}
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def decode_phase(model: DiffusionGemma, device: torch.device, batches: list[int], steps_list: list[int],
                 budget_s: float, start: float) -> list[dict]:
    out = []
    for steps in steps_list:
        for batch in batches:
            if time.time() - start > budget_s:
                out.append({"phase": "decode", "batch": batch, "steps": steps, "skipped": "over budget"})
                continue
            step_rows(model, rows(model, batch, 2, prompt=8))  # warm-up: kernels, allocator
            seqs = rows(model, batch, steps)
            sync(device)
            t0, n = time.perf_counter(), 0
            while not all(s.finished for s in seqs):
                step_rows(model, seqs)
                n += 1
            sync(device)
            wall = time.perf_counter() - t0
            tokens = sum(len(s.final) for s in seqs)
            row = {"phase": "decode", "batch": batch, "steps": steps, "forwards": n, "tokens": tokens,
                   "wall_s": round(wall, 3), "decode_tok_s": round(tokens / wall, 1),
                   "ms_per_step": round(1000 * wall / n, 2)}
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny layers and vocabulary on the CPU: every phase, seconds")
    ap.add_argument("--device", default=None, help="cuda (default where present) or cpu")
    ap.add_argument("--layers", choices=("26b-a4b", "tiny"), default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--canvas", type=int, default=256)
    ap.add_argument("--dtype", default=None, help="bfloat16 on CUDA, float32 on the CPU by default")
    ap.add_argument("--phases", default="memory,decode")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", default="16,48")
    ap.add_argument("--budget-s", type=float, default=240.0, help="no decode row starts after this many seconds")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() and not a.smoke else "cpu"))
    shape = a.layers or ("tiny" if a.smoke or device.type == "cpu" else "26b-a4b")
    layers = TINY if shape == "tiny" else GEMMA_26B_A4B
    vocab = a.vocab or (TINY["vocab_size"] if a.smoke else GEMMA_26B_A4B["vocab_size"])
    canvas = 16 if a.smoke else a.canvas
    dtype = getattr(torch, a.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    batches, steps = [int(x) for x in a.batches.split(",")], [int(x) for x in a.steps.split(",")]
    if a.smoke:
        steps = [2]
    start = time.time()
    model = make_model(layers, vocab, canvas, dtype, str(device))
    weights = sum(t.nbytes for t in model.state_dict().values())
    report = {"conditions": {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor()
                             or "cpu", "torch": torch.__version__, "cuda": torch.version.cuda, "dtype": str(dtype),
                             "layers": layers, "vocab": vocab, "canvas": canvas,
                             "weights_gib": round(weights / 2**30, 2),
                             "threads": torch.get_num_threads(), "smoke": a.smoke, "weights": "random"},
              "vllm_published": VLLM, "rows": []}
    if "memory" in a.phases:
        report["rows"] += memory_phase(model, device, batches)
    if "decode" in a.phases:
        report["rows"] += decode_phase(model, device, batches, steps, a.budget_s, start)
    report["wall_s"] = round(time.time() - start, 1)
    if a.json:
        a.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
