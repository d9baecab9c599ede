"""bf16 against fp32 per denoising step on the CPU, on a LLaDA-format model with the real
126,464-token vocabulary, side by side in one run, with where each step's time goes.

    python scripts/bench_cpu_dtype.py                 # batch 1, d_model 256, 4 layers, prompt 64, gen 256, block 32, median of 3
    python scripts/bench_cpu_dtype.py --batch 1 --layers 4 --d-model 512
    git show <commit>:engine/sampling/select.py > /tmp/select_old.py
    python scripts/bench_cpu_dtype.py --dtypes bfloat16 --baseline-select /tmp/select_old.py   # selection, before and after

The model is random (its speed, not its text, is the point): LLaDA's layout (no cache, float64
confidences, x0 from the raw logits) with tiny layers, so the vocabulary-sized work (the head,
selection over the window) weighs as it does beside a real model's first layers on a CPU. Both
dtypes step the same requests through `celeris.engine.families.canvas.runner.Runner` (gen_length 256, steps 256: one
token a step, fixed schedule, low_confidence), alternating fp32 and bf16 runs; each run times
`--steps` steps after a warm-up, and the run with the median step time is reported whole.

Per-part split (milliseconds per step, wall time, measured by timing wrappers around the
runner's calls): `layers` = the transformer blocks, `head` = the LM head over the window,
`select` = `sampler.select_tokens` (of which `conf` = `sampler.confidences`), `order` =
`published_order` (the published tie order, CPU), `rest` = everything else in the step.

`--baseline-select FILE` adds a run of each dtype whose selection (`select_tokens`,
`published_order`, `confidences`) comes from FILE, an older engine/sampling/select.py, alternating
with the current one: selection before and after, side by side under the same load.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import celeris.engine.families.selection as runner_mod  # noqa: E402
import celeris.engine.sampling.select as sampler_mod  # noqa: E402
from celeris.engine.config import EngineConfig, ModelConfig  # noqa: E402
from celeris.engine.models.transformer import MaskPredictor  # noqa: E402
from celeris.engine.sampling.params import SamplingParams  # noqa: E402
from celeris.engine.families.canvas.runner import Runner  # noqa: E402
from celeris.engine.families.registry import family_of  # noqa: E402
from celeris.engine.families.canvas.sequence import CanvasSequence  # noqa: E402

VOCAB = 126_464  # LLaDA-8B's vocabulary (and embedding) size


def llada_shape(d_model: int, layers: int) -> ModelConfig:
    heads = max(1, d_model // 64)
    return ModelConfig(d_model=d_model, n_heads=heads, n_kv_heads=heads, n_layers=layers,
                       mlp_hidden_size=3 * d_model, vocab_size=VOCAB, embedding_size=VOCAB,
                       rope_theta=500000.0, mask_token_id=126336, eos_token_id=126081, name="llada-shape-random")


def random_model(cfg: ModelConfig, dtype: torch.dtype, peaked: int = 0) -> MaskPredictor:
    torch.manual_seed(0)
    model = MaskPredictor(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() == 2 else p.fill_(1.0)
        head = model.transformer.wte.weight if cfg.weight_tying else model.transformer.ff_out.weight
        head[1000:1000 + peaked] *= 50  # logit std ~16 against ~0.3: a handful of leaders a position
    return model.to(dtype).eval().requires_grad_(False)


class Clock:
    """Wall time per named part, summed over the timed steps."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.on = False

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[name] += time.perf_counter() - t0
        return timed


@contextlib.contextmanager
def patched(clock: Clock, model: MaskPredictor, sampler: Any = sampler_mod):
    """Timing wrappers around the parts of a step (restored on exit); selection from `sampler`
    (a select module)."""
    saved = [(runner_mod, "select_tokens"), (runner_mod, "published_order"), (sampler, "confidences")]
    old = [getattr(m, n) for m, n in saved]
    names = ["select", "order", "conf"]
    for (m, n), fn, name in zip(saved, [sampler.select_tokens, sampler.published_order, old[2]], names):
        setattr(m, n, clock.wrap(name, fn))
    blocks = model.transformer.blocks
    old_fwd = [b.forward for b in blocks]
    for b, f in zip(blocks, old_fwd):
        b.forward = clock.wrap("layers", f)
    model.head = clock.wrap("head", MaskPredictor.head.__get__(model))
    try:
        yield
    finally:
        for (m, n), fn in zip(saved, old):
            setattr(m, n, fn)
        for b in blocks:
            del b.forward
        del model.head


def load_select(path: Path) -> Any:
    """An engine/sampling/select.py of another commit, as a module beside the current one."""
    spec = importlib.util.spec_from_file_location("baseline_select", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(model: MaskPredictor, a: argparse.Namespace, sampler: Any = sampler_mod) -> dict[str, Any]:
    """`a.steps` timed steps of `a.batch` requests after `a.warmup`: ms per step, by part."""
    cfg = EngineConfig(max_batch=a.batch, max_prompt_tokens=a.prompt_len, max_gen_length=a.gen_length)
    runner = Runner(model, cfg, family_of(model.cfg))
    params = SamplingParams(gen_length=a.gen_length, steps=a.gen_length, block_length=a.block_length, seed=0,
                            stop_at_eos=False, temperature=a.temperature, top_p=a.top_p).validate(a.gen_length)

    def fresh(i: int) -> CanvasSequence:
        s = CanvasSequence(f"r{i}", [5 + i] * a.prompt_len, params, model.cfg.mask_token_id, frozenset())
        s.slot = i
        runner.load(s)
        return s

    seqs = [fresh(i) for i in range(a.batch)]

    def step() -> None:
        results, _ = runner.step(seqs)
        for i, r in enumerate(results):
            seqs[i].apply(r.positions, r.tokens, r.confidences)
            if seqs[i].finished:
                seqs[i] = fresh(i)

    clock = Clock()
    with patched(clock, model, sampler):
        for _ in range(a.warmup):
            step()
        clock.on = True
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step()
        wall = time.perf_counter() - t0
    ms = {k: 1000 * v / a.steps for k, v in clock.total.items()}
    step_ms = 1000 * wall / a.steps
    parts = {k: ms.get(k, 0.0) for k in ("layers", "head", "select", "conf", "order")}
    parts["rest"] = step_ms - parts["layers"] - parts["head"] - parts["select"] - parts["order"]
    return {"step_ms": step_ms, **{f"{k}_ms": round(v, 2) for k, v in parts.items()}}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--steps", type=int, default=24, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0, help="< 1: every request filters its nucleus")
    ap.add_argument("--peaked", type=int, default=0,
                    help="give this many tokens LM-head rows 50x the others, so each position's logits have a few "
                         "clear leaders as a trained model's do (0: all rows alike, logits near uniform)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated, run in this order")
    ap.add_argument("--baseline-select", type=Path, default=None,
                    help="an older engine/sampling/select.py: also run each dtype with its selection")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = llada_shape(a.d_model, a.layers)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    models = {k: random_model(cfg, dtypes[k], a.peaked) for k in a.dtypes.split(",")}
    baseline = load_select(a.baseline_select) if a.baseline_select else None
    variants = [(name, name, sampler_mod) for name in models]
    if baseline is not None:
        variants = [v for name in models for v in ((name, name, sampler_mod), (name + "-base", name, baseline))]
    runs: dict[str, list[dict]] = {k: [] for k, _, _ in variants}
    with torch.inference_mode():
        for rep in range(a.repeats):
            for key, name, sampler in variants:  # alternating, so all see the same load
                runs[key].append(run(models[name], a, sampler))
                print(f"repeat {rep + 1}/{a.repeats} {key}: {runs[key][-1]['step_ms']:.1f} ms a step", flush=True)
    med = {k: sorted(v, key=lambda r: r["step_ms"])[len(v) // 2] for k, v in runs.items()}
    ratio = med["float32"]["step_ms"] / med["bfloat16"]["step_ms"] if {"float32", "bfloat16"} <= set(med) else None
    load = os.getloadavg()
    cond = {"model": f"LLaDA layout, random, d_model {a.d_model}, {a.layers} layers, vocab {VOCAB}",
            "batch": a.batch, "temperature": a.temperature, "top_p": a.top_p, "peaked": a.peaked,
            "prompt_len": a.prompt_len, "gen_length": a.gen_length, "block_length": a.block_length,
            "steps_timed": a.steps, "repeats": a.repeats, "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "load_avg_1m": round(load[0], 2)}
    print(json.dumps(cond))
    head = f"{'dtype':14}" + "".join(f"{k:>9}" for k in ("step", "layers", "head", "select", "conf", "order", "rest"))
    print(head + f"{'select %':>10}")
    for name, r in med.items():
        print(f"{name:14}{r['step_ms']:9.1f}" + "".join(f"{r[k + '_ms']:9.1f}"
                                                        for k in ("layers", "head", "select", "conf", "order", "rest"))
              + f"{100 * r['select_ms'] / r['step_ms']:9.1f}%")
    for name in models:
        if baseline is not None:
            sel = [b["select_ms"] / r["select_ms"] for b, r in zip(runs[name + "-base"], runs[name])]
            print(f"{name}: baseline select / select {statistics.median(sel):.2f}x (median of {a.repeats} "
                  f"side-by-side pairs: " + ", ".join(f"{x:.2f}" for x in sel) + ")")
    if ratio is not None:
        print(f"fp32 / bf16 per step: {ratio:.2f}x (median of {a.repeats})")
    print("every run's step: " + ", ".join(f"{k} {statistics.median(r['step_ms'] for r in v):.1f} ms"
                                           for k, v in runs.items()))
    if a.json:
        a.json.write_text(json.dumps({"conditions": cond, "median": med, "runs": runs, "ratio": ratio}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
