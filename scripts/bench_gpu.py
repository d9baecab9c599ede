"""The device benchmark of issue 28: denoise steps and whole requests, graphs on and off, and
serving over gRPC beside the in-process engine. One JSON report with the conditions and a
top-level `targets` object ({"measured": x, "goal": y, "met": bool} per target).

    python scripts/bench_gpu.py --json out.json           # the device run (CUDA, bf16, real shapes)
    python scripts/bench_gpu.py --smoke --json out.json   # the same phases, tiny shapes, CPU

Weights are random (no download): a step's cost depends on shapes, not values. Phases:
- step: one runner step at steady state (median ms) per model, cache mode, batch and graph
  setting: LLaDA-8B (cache none / prefix / dual), SDAR-8B (block 4), LLaDA2-mini-shaped MoE;
- served: `celeris serve` in its own process with every-step delta streams vs the engine in
  process on the same load (scripts/bench_gpu_served.py).
Each row is measured only while the time budget (--budget-s) lasts; skipped rows are listed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "protos"), str(Path(__file__).resolve().parent)]

from celeris.engine.config import EngineConfig, ModelConfig  # noqa: E402
from celeris.engine.families.registry import card_named, family_of, row_of  # noqa: E402
from celeris.engine.models.graphs import eager_capture  # noqa: E402
from celeris.engine.models.transformer import MaskPredictor  # noqa: E402
from celeris.engine.sampling.params import SamplingParams  # noqa: E402

LLADA_8B = ModelConfig(d_model=4096, n_heads=32, n_kv_heads=32, n_layers=32, mlp_hidden_size=12288,
                       vocab_size=126464, embedding_size=126464, rope_theta=500000.0, mask_token_id=126336,
                       eos_token_id=126081, name="llada-8b-random")
SDAR_8B = card_named("sdar").config(d_model=4096, n_heads=32, n_kv_heads=8, n_layers=36, mlp_hidden_size=12288,
                      vocab_size=151936, embedding_size=151936, rope_theta=1e6, mask_token_id=151669,
                      eos_token_id=151643, explicit_head_dim=128, qk_norm=True, block_length=4,
                      name="sdar-8b-random")
# LLaDA2.0-mini's published shapes (Ling-mini-2.0 layout): 16B total, 256 routed experts.
LLADA2_MINI = card_named("llada2").config(d_model=2048, n_heads=16, n_kv_heads=4, n_layers=20,
                          mlp_hidden_size=5120, vocab_size=157184, embedding_size=157184, rope_theta=600000.0,
                          mask_token_id=156895, eos_token_id=156892, explicit_head_dim=128, qk_norm=True,
                          partial_rotary_factor=0.5, out_bias=False, logits_fp32=True, block_length=32,
                          num_experts=256, experts_per_token=8, num_shared_experts=1, moe_hidden_size=512,
                          first_dense_layers=1, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                          name="llada2-mini-random")
TINY = ModelConfig(d_model=64, n_heads=4, n_kv_heads=4, n_layers=2, mlp_hidden_size=128, vocab_size=512,
                   embedding_size=512, mask_token_id=3, eos_token_id=2, name="tiny-random")
TINY_SDAR = card_named("sdar").config(d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, mlp_hidden_size=128,
                        vocab_size=512, embedding_size=512, mask_token_id=3, eos_token_id=2, qk_norm=True,
                        block_length=4, name="tiny-sdar-random")
TINY_LLADA2 = card_named("llada2").config(d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, mlp_hidden_size=128,
                          vocab_size=512, embedding_size=512, mask_token_id=3, eos_token_id=2, qk_norm=True,
                          partial_rotary_factor=0.5, logits_fp32=True, block_length=4, num_experts=8,
                          experts_per_token=2, num_shared_experts=1, moe_hidden_size=32, first_dense_layers=1,
                          n_group=4, topk_group=2, name="tiny-llada2-random")

# (model key, cache mode, block length, tokens a step, batches): the device plan, cheapest first.
PLAN = [("sdar", "exact", 4, 2, (1, 8, 32, 64, 128)),
        ("llada", "dual", 32, 4, (1, 8, 32, 64, 128)),
        ("llada", "prefix", 32, 4, (1, 32)),
        ("llada", "none", 32, 4, (1, 8, 32)),
        ("llada2", "exact", 32, 4, (1, 8, 32, 64))]
MODELS = {"llada": (TINY, LLADA_8B), "sdar": (TINY_SDAR, SDAR_8B), "llada2": (TINY_LLADA2, LLADA2_MINI)}
SERVED_SHAPES = {"d_model": 2048, "n_heads": 16, "n_kv_heads": 16, "n_layers": 22, "mlp_hidden_size": 5632}


def random_model(cfg: ModelConfig, device: str, dtype: torch.dtype) -> MaskPredictor:
    with torch.device("meta"):
        model = MaskPredictor(cfg)
    model = model.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.02) if p.dim() == 2 else p.fill_(1.0)
        for name, b in model.named_buffers():  # the MoE routers' expert_bias
            b.zero_()
    return model.eval().requires_grad_(False)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(model: MaskPredictor, batch: int, graphs: bool, cache: str, block: int, per_step: int, a) -> dict:
    """Median step time at steady state; tok/s = tokens committed / wall time over the measured steps."""
    device = next(model.parameters()).device
    family = family_of(model.cfg)
    is_block, row = family.block, row_of(family)
    cfg = EngineConfig(device=str(device), max_batch=max(batch, 1), max_prompt_tokens=a.prompt_len,
                       max_gen_length=a.gen_length, cuda_graphs=graphs, graph_max_tokens=a.graph_max_tokens,
                       kv_cache="none" if is_block else cache, dtype=str(model.dtype).replace("torch.", ""))
    runner = row.runner(model, cfg, family)
    if graphs and device.type == "cpu":  # the smoke run rehearses the graph path eagerly
        runner._graphs.capture = eager_capture
        runner.use_graphs = runner.static = True
    params = SamplingParams(gen_length=a.gen_length, steps=a.gen_length // per_step, block_length=block,
                            seed=0, stop_at_eos=False).validate(a.gen_length)
    kind = row.sequence

    def fresh(i: int):
        s = kind(f"r{i}", [5 + i % 50] * a.prompt_len, params, model.cfg.mask_token_id, frozenset())
        s.slot = i
        runner.load(s)
        return s

    seqs = [fresh(i) for i in range(batch)]

    def one_step() -> tuple[int, bool]:
        results, stats = runner.step(seqs)
        for i, r in enumerate(results):  # keep the schedule moving; a finished request starts over
            seqs[i].apply(r.positions, r.tokens, r.confidences)
            if seqs[i].finished:
                seqs[i] = fresh(i)
        return stats.committed, stats.cuda_graph

    reserved0 = torch.cuda.memory_reserved() if device.type == "cuda" else 0
    for _ in range(a.warmup):
        one_step()
    times, committed, graphed = [], 0, False
    sync(device)
    t_all = time.perf_counter()
    for _ in range(a.iters):
        sync(device)
        t0 = time.perf_counter()
        c, g = one_step()  # the step syncs once when it reads results back
        times.append(time.perf_counter() - t0)
        committed, graphed = committed + c, graphed or g
    wall = time.perf_counter() - t_all
    row = {"phase": "step", "model": model.cfg.name, "cache": cache, "batch": batch, "block_length": block,
           "tokens_per_step": per_step, "graphs_setting": graphs, "cuda_graphs": graphed, "median_step_ms": round(1e3 * statistics.median(times), 3),
           "tokens_per_s": round(committed / wall, 1), "graphs_captured": len(runner._graphs)}
    if device.type == "cuda":
        row["graph_pool_mb"] = round((torch.cuda.memory_reserved() - reserved0) / 2**20, 1) if graphs else 0.0
    return row


SHAPE_FIELDS = ("d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size", "vocab_size", "num_experts",
                "experts_per_token", "moe_hidden_size")


def conditions(a, device: str, dtype: torch.dtype) -> dict:
    cuda = device == "cuda"
    shapes = {MODELS[k][0 if a.smoke else 1].name: {f: getattr(MODELS[k][0 if a.smoke else 1], f) for f in SHAPE_FIELDS}
              for k in MODELS}
    return {"device": torch.cuda.get_device_name() if cuda else (platform.processor() or "cpu"),
            "torch": torch.__version__, "cuda": torch.version.cuda if cuda else None,
            "dtype": str(dtype).replace("torch.", ""), "prompt_len": a.prompt_len, "gen_length": a.gen_length,
            "warmup": a.warmup, "iters": a.iters, "graph_max_tokens": a.graph_max_tokens,
            "threads": torch.get_num_threads(), "commit": git_commit(), "smoke": a.smoke, "shapes": shapes,
            "served_shapes": a.served_shapes, "budget_s": a.budget_s,
            "tokens_per_s": "tokens committed / wall time over the measured steady-state steps (store and "
                            "prefill steps included; finished requests restart)"}


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def pick(rows: list[dict], model: str, cache: str, batch: int, graphs: bool, key: str):
    for r in rows:
        if (r.get("phase") == "step" and r["model"] == model and r["cache"] == cache and r["batch"] == batch
                and r["graphs_setting"] == graphs):
            return r[key]
    return None


def target(measured, goal, higher: bool) -> dict:
    met = measured is not None and (measured >= goal if higher else measured <= goal)
    return {"measured": measured, "goal": goal, "met": met}


def targets(rows: list[dict]) -> dict:
    """Issue 28's device targets, from the graphs-on rows (the engine's default on CUDA)."""
    sdar, llada = SDAR_8B.name, LLADA_8B.name
    ratios = []
    for r in rows:
        if r.get("phase") == "step" and not r["graphs_setting"]:
            g = pick(rows, r["model"], r["cache"], r["batch"], True, "median_step_ms")
            if g is not None and r["median_step_ms"] > 0:
                ratios.append(round(g / r["median_step_ms"], 3))
    served = next((r for r in rows if r.get("phase") == "served"), None)
    eight_b = served is not None and served["shapes"].get("d_model") == 4096 and served["concurrency"] == 64
    return {
        "sdar8b_block4_step_ms_batch1": target(pick(rows, sdar, "exact", 1, True, "median_step_ms"), 8.0, False),
        "sdar8b_block4_step_ms_batch32": target(pick(rows, sdar, "exact", 32, True, "median_step_ms"), 15.0, False),
        "llada8b_dual_4_per_step_tok_s_batch1": target(pick(rows, llada, "dual", 1, True, "tokens_per_s"), 700, True),
        "llada8b_dual_4_per_step_tok_s_batch64": target(pick(rows, llada, "dual", 64, True, "tokens_per_s"), 2500,
                                                        True),
        "graphs_over_eager_worst_step_ratio": target(max(ratios) if ratios else None, 1.03, False),
        "served_8b_tok_s_concurrency64": target(served["served_tokens_per_s"] if eight_b else None, 2082, True),
        "served_over_in_process": target(served["served_over_engine"] if served else None, 0.95, True),
    }


def crossover(rows: list[dict]) -> dict:
    """Per model and cache mode: graphs / eager step time at each batch measured, and the first
    batch where graphs are more than 3% slower (None: never). With graphs on, a row above the
    bucket policy's graph_max_tokens runs eager (its `cuda_graphs` says what ran)."""
    out: dict[str, dict] = {}
    for r in rows:
        if r.get("phase") != "step" or r["graphs_setting"]:
            continue
        g = next((x for x in rows if x.get("phase") == "step" and x["graphs_setting"] and x["model"] == r["model"]
                  and x["cache"] == r["cache"] and x["batch"] == r["batch"]), None)
        if g is not None:
            entry = out.setdefault(f"{r['model']}/{r['cache']}", {"ratios": {}, "first_slower_batch": None})
            ratio = round(g["median_step_ms"] / r["median_step_ms"], 3)
            entry["ratios"][str(r["batch"])] = ratio
            if ratio > 1.03 and entry["first_slower_batch"] is None:
                entry["first_slower_batch"] = r["batch"]
    return out


def step_phase(a, device: str, dtype: torch.dtype, start: float, rows: list, skipped: list, save) -> None:
    for key, cache, block, per_step, batches in PLAN:
        if a.models and key not in a.models:
            continue
        cfg = MODELS[key][0 if a.smoke else 1]
        if time.monotonic() - start > a.budget_s:
            skipped.append(f"{cfg.name} {cache}: over budget")
            continue
        model = random_model(cfg, device, dtype)
        for batch in batches if not a.smoke else batches[:2]:
            for graphs in (False, True):  # (on the CPU, graphs on is the eager rehearsal of that path)
                if time.monotonic() - start > a.budget_s:
                    skipped.append(f"{cfg.name} {cache} batch {batch} graphs {graphs}: over budget")
                    continue
                try:
                    rows.append(measure(model, batch, graphs, cache, min(block, a.gen_length), per_step, a))
                    print(json.dumps(rows[-1]), flush=True)
                    save()  # a run cut short by its timeout still leaves every row measured so far
                except torch.cuda.OutOfMemoryError as e:  # a row the device cannot hold: say so, go on
                    skipped.append(f"{cfg.name} {cache} batch {batch} graphs {graphs}: out of memory ({e})"[:300])
                if device == "cuda":
                    torch.cuda.empty_cache()
        del model
        if device == "cuda":
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: every phase, seconds")
    ap.add_argument("--phases", default="step,served")
    ap.add_argument("--models", default="", help="comma-separated subset of llada,sdar,llada2 (default all)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--iters", type=int, default=16)
    ap.add_argument("--graph-max-tokens", type=int, default=EngineConfig.graph_max_tokens)
    ap.add_argument("--served-concurrency", type=int, default=64)
    ap.add_argument("--served-gen", type=int, default=256)
    ap.add_argument("--served-shapes", type=json.loads, default=SERVED_SHAPES, help="JSON: served model shapes")
    ap.add_argument("--budget-s", type=float, default=200.0,
                    help="no new step row starts after this many seconds (the served phase still runs)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    a.models = [m for m in a.models.split(",") if m]
    cuda = torch.cuda.is_available() and not a.smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    if a.smoke:
        a.prompt_len, a.gen_length, a.warmup, a.iters = 8, 16, 1, 3
        a.served_concurrency, a.served_gen, a.served_shapes = 2, 16, {}
    start, rows, skipped = time.monotonic(), [], []
    report = {"conditions": conditions(a, device, dtype), "rows": rows, "skipped": skipped}

    def save() -> None:
        report["targets"] = targets(rows)
        report["graph_crossover"] = crossover(rows)
        report["wall_s"] = round(time.monotonic() - start, 1)
        if a.json:
            a.json.write_text(json.dumps(report, indent=2) + "\n")

    if "step" in a.phases:
        step_phase(a, device, dtype, start, rows, skipped, save)
    if "served" in a.phases:
        if time.monotonic() - start > a.budget_s + 60:
            skipped.append("served: over budget")
        else:
            from bench_gpu_served import served
            log_dir = (a.json.parent if a.json else Path("."))
            rows.append(served(device, dtype, a.served_shapes, a.served_concurrency, a.served_gen, "dual",
                               1 if a.smoke else 3, log_dir))
            print(json.dumps(rows[-1]), flush=True)
    save()
    print(json.dumps(report["targets"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
