"""FP8 weights (E4M3, engine/models/fp8.py) beside bf16 on random weights (issue #46): logit agreement,
token agreement of whole greedy decodes, and on CUDA a runner step's speed at batch 1 and 32.

    python scripts/fp8_quality.py                   # CPU: tiny and mid shapes, the fp8 reference path
    python scripts/fp8_quality.py --json out.json   # CUDA: the same on torch._scaled_mm, + LLaDA-8B speed
    python scripts/fp8_quality.py --smoke           # tiny shapes only (the rehearsal in gpu_check.sh)

Per model shape: random fp32 weights N(0, 0.8/sqrt(fan_in)) (norms 1; DiffusionGemma's q/k norms
head_dim^-1/4, since its attention has scale 1.0), cast to bf16; the fp8 model is
quantize_fp8 of those bf16 weights. Logits: one denoising forward over B rows (random prompt, a
canvas half masked, half random tokens), compared over the canvas positions: cosine similarity,
max |error| / the row's bf16 logit range, top-1 agreement. `bf16 vs fp32` beside it is what bf16
rounding alone costs. Decodes: LLaDA's reference reverse process at temperature 0 (greedy,
low-confidence remasking) from the same prompts; the share of generated tokens that match and of
rows that match whole. DiffusionGemma: one denoising forward after encoding a prompt (no decode).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from celeris.engine.config import ModelConfig  # noqa: E402
from celeris.engine.families.registry import card_named  # noqa: E402
from celeris.engine.models.fp8 import fp8_capable, quantize_fp8, use_kernel  # noqa: E402
from celeris.engine.models.transformer import MaskPredictor  # noqa: E402
from celeris.engine.sampling.params import SamplingParams  # noqa: E402
from celeris.engine.sampling.reference import reference_generate  # noqa: E402

MASK, EOS = 3, 2
DENSE = {"tiny": dict(d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, mlp_hidden_size=192, vocab_size=512),
         "mid": dict(d_model=1024, n_heads=16, n_kv_heads=4, n_layers=8, mlp_hidden_size=2816, vocab_size=32000)}
MOE = dict(arch="llada2", qk_norm=True, partial_rotary_factor=0.5, logits_fp32=True, first_dense_layers=1,
           num_shared_experts=1, routed_scaling_factor=2.5)
MOES = {"tiny": dict(DENSE["tiny"], num_experts=8, experts_per_token=2, moe_hidden_size=32, n_group=4, topk_group=2),
        "mid": dict(DENSE["mid"], n_layers=6, num_experts=32, experts_per_token=4, moe_hidden_size=512, n_group=4,
                    topk_group=2)}
GEMMA = {"tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                      num_global_key_value_heads=1, sliding_window=16, num_experts=8, top_k_experts=2,
                      moe_intermediate_size=32),
         "mid": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=6,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=128, global_head_dim=256,
                     num_global_key_value_heads=2, sliding_window=128, num_experts=32, top_k_experts=4,
                     moe_intermediate_size=256)}
LLADA_8B = dict(d_model=4096, n_heads=32, n_kv_heads=32, n_layers=32, mlp_hidden_size=12288, vocab_size=126464)


def init_random(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights N(0, 0.8 / sqrt(fan_in)) in fp32, every norm and scalar 1, router biases 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * (0.8 / p.shape[-1] ** 0.5))
            else:
                p.fill_(1.0)
        for b in model.buffers():
            if b.is_floating_point():
                b.fill_(0.0 if b.numel() > 1 else 1.0)
    return model.eval().requires_grad_(False)


def agreement(ref: torch.Tensor, out: torch.Tensor) -> dict:
    """ref, out (N, V) logits at the same positions."""
    ref, out = ref.float(), out.float()
    cos = F.cosine_similarity(ref, out, dim=-1)
    rel = (out - ref).abs().amax(-1) / (ref.amax(-1) - ref.amin(-1))
    return {"cosine_mean": round(cos.mean().item(), 5), "cosine_min": round(cos.min().item(), 5),
            "max_abs_err_over_range": round(rel.max().item(), 5), "mean_abs_err_over_range": round(rel.mean().item(), 5),
            "top1_agreement": round((ref.argmax(-1) == out.argmax(-1)).float().mean().item(), 4), "positions": len(ref),
            "distinct_top1": len(ref.argmax(-1).unique())}  # random models may rank one token first everywhere


def trio(cfg: ModelConfig, device: str, seed: int = 0):
    """(fp32, bf16, fp8) models of the same random weights on `device`."""
    fp32 = init_random(MaskPredictor(cfg), seed).to(device)
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    fp8 = copy.deepcopy(bf16)
    quantize_fp8(fp8)
    return fp32, bf16, fp8


def mask_model_rows(name: str, cfg: ModelConfig, device: str, a) -> list[dict]:
    t0 = time.perf_counter()
    fp32, bf16, fp8 = trio(cfg, device)
    g = torch.Generator().manual_seed(1)
    P, G, B = a.prompt_len, a.gen_length, a.batch
    ids = torch.randint(5, cfg.vocab_size, (B, P + G), generator=g)
    ids[:, P:][torch.rand(B, G, generator=g) < 0.5] = MASK  # a canvas half way through its decode
    ids = ids.to(device)
    paths = {"fp8": fp8}
    if device == "cuda":  # the device path and the reference path of the same packed model
        paths = {"fp8": fp8, "fp8_reference": copy.deepcopy(fp8)}
        use_kernel(paths["fp8_reference"], False)
    with torch.no_grad():
        logits = {k: m(ids)[:, P:].flatten(0, 1) for k, m in {"fp32": fp32, "bf16": bf16, **paths}.items()}
    row = {"model": name, "shape": shape_of(cfg), "logits": {"fp8 vs bf16": agreement(logits["bf16"], logits["fp8"]),
                                                             "bf16 vs fp32": agreement(logits["fp32"], logits["bf16"])}}
    if "fp8_reference" in logits:
        row["logits"]["fp8 kernel vs fp8 reference"] = agreement(logits["fp8_reference"], logits["fp8"])
    row["greedy_decode"] = decodes(cfg, {"fp32": fp32, "bf16": bf16, "fp8": fp8}, device, a)
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return [row]


def decodes(cfg: ModelConfig, models: dict, device: str, a) -> dict:
    """Whole greedy decodes of the same prompts; token and row agreement against bf16 (and fp32)."""
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(5, cfg.vocab_size, (a.decode_rows, a.prompt_len), generator=g).to(device)
    p = SamplingParams(gen_length=a.decode_gen, steps=a.decode_gen, block_length=a.decode_gen, temperature=0.0,
                       stop_at_eos=False)
    outs = {}
    with torch.no_grad():
        for k, m in models.items():
            canvas, _ = reference_generate(lambda x, am, m=m: m(x, key_mask=am), prompt, p, MASK)
            outs[k] = canvas[:, a.prompt_len:].cpu()

    def same(x, y) -> dict:
        return {"token_agreement": round((x == y).float().mean().item(), 4),
                "rows_identical": f"{int((x == y).all(-1).sum())}/{len(x)}"}

    return {"rows": a.decode_rows, "prompt_len": a.prompt_len, "gen_length": a.decode_gen, "steps": a.decode_gen,
            "fp8 vs bf16": same(outs["bf16"], outs["fp8"]), "bf16 vs fp32": same(outs["fp32"], outs["bf16"])}


def gemma_rows(name: str, text: dict, a) -> list[dict]:
    """DiffusionGemma's denoising logits after encoding a prompt (on the CPU: its committed path)."""
    from celeris.engine.families.revise.config import gemma_config
    from celeris.engine.families.revise.model import DiffusionGemma, KVCache

    t0 = time.perf_counter()
    text = dict(text, layer_types=["sliding_attention"] * (text["num_hidden_layers"] - 1) + ["full_attention"],
                max_position_embeddings=4096, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    cfg = gemma_config({"text_config": text, "canvas_length": a.gen_length})
    fp32 = init_random(DiffusionGemma(cfg), 0)
    with torch.no_grad():  # attention scale 1.0 leaves the temperature to the q/k norms: with norm
        for layer in fp32.layers:  # weights 1, q.k has variance head_dim and attention is one-hot and
            w = layer.self_attn.shape.head_dim ** -0.25  # chaotic; these weights give q.k variance 1,
            layer.self_attn.q_norm.weight.fill_(w)  # the 1/sqrt(head_dim) of the other families
            layer.self_attn.k_norm.weight.fill_(w)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, cfg.vocab_size, (1, a.prompt_len), generator=g)
    canvas = torch.randint(3, cfg.vocab_size, (1, a.gen_length), generator=g)

    def denoised(m) -> torch.Tensor:
        cache = KVCache(cfg)
        m.encode(prompt, cache)
        return m.denoise(canvas, cache, None)[0]  # (L, V)

    logits, base = {"fp32": denoised(fp32)}, "bf16"
    try:
        logits["bf16"] = denoised(copy.deepcopy(fp32).to(torch.bfloat16))
    except RuntimeError as e:  # this checkout's text model runs in float32 only: fp8 beside float32
        base, note = "fp32", f"bf16 forward failed ({str(e)[:80]}); fp8 packed from the fp32 weights"
    packed = copy.deepcopy(fp32).to(torch.float32 if base == "fp32" else torch.bfloat16)
    quantize_fp8(packed)
    logits["fp8"] = denoised(packed)
    shape = {k: text[k] for k in ("hidden_size", "num_hidden_layers", "num_experts", "top_k_experts", "vocab_size")}
    rows = {f"fp8 vs {base}": agreement(logits[base], logits["fp8"])}
    if base == "bf16":
        rows["bf16 vs fp32"] = agreement(logits["fp32"], logits["bf16"])
    else:  # the floor beside it: weights rounded to bf16, activations float32
        rounded = copy.deepcopy(fp32)
        with torch.no_grad():
            for t in rounded.parameters():
                t.copy_(t.bfloat16().float())
        rows["bf16-rounded weights vs fp32"] = agreement(logits["fp32"], denoised(rounded))
        rows["note"] = note
    return [{"model": name, "shape": shape, "logits": rows, "seconds": round(time.perf_counter() - t0, 1)}]


def shape_of(cfg: ModelConfig) -> dict:
    keys = ("d_model", "n_layers", "mlp_hidden_size", "vocab_size", "num_experts", "experts_per_token", "moe_hidden_size")
    return {k: getattr(cfg, k) for k in keys if getattr(cfg, k)}


def speed_rows(a, rows: list, save) -> None:
    """A runner step (LLaDA-8B shapes, no cache, graphs per the bucket policy) in bf16, then the same
    model packed to fp8 in place: median ms and tok/s at each batch (scripts/bench_gpu.py's measure)."""
    from bench_gpu import measure, random_model

    cfg = config(LLADA_8B, name="llada-8b-random", mask_token_id=126336, eos_token_id=126081, rope_theta=500000.0)
    model = random_model(cfg, "cuda", torch.bfloat16)
    opts = SimpleNamespace(prompt_len=64, gen_length=256, warmup=3, iters=10, graph_max_tokens=2048)
    for label in ("bf16", "fp8"):
        if label == "fp8":
            quantize_fp8(model)
            torch.cuda.empty_cache()
        weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        for batch in a.speed_batches:
            row = measure(model, batch, True, "none", 32, 4, opts)
            rows.append({"weights": label, "weights_gib": round(weights / 2**30, 2), **row})
            print(json.dumps(rows[-1]), flush=True)
            save()  # a run cut short by its timeout keeps every row measured so far


def config(shape: dict, **kw) -> ModelConfig:
    card = card_named(kw.pop("arch", "llada"))  # its traits: LLaDA2 rotates in the model dtype
    return card.config(**dict(shape, embedding_size=shape["vocab_size"], mask_token_id=MASK, eos_token_id=EOS, **kw))


def cpu_name() -> str:
    try:
        line = next(x for x in open("/proc/cpuinfo") if x.startswith("model name"))
        return line.split(":", 1)[1].strip()
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def conditions(a, device: str) -> dict:
    cuda = device == "cuda"
    return {"device": torch.cuda.get_device_name() if cuda else cpu_name(), "load_average": os.getloadavg()[0],
            "fp8_path": "torch._scaled_mm (row-wise)" if cuda else "reference (dequantised, float32 matmul)",
            "torch": torch.__version__, "cuda": torch.version.cuda if cuda else None, "threads": torch.get_num_threads(),
            "init": "N(0, 0.8/sqrt(fan_in)), norms 1 (DiffusionGemma's q/k norms head_dim^-1/4)", "logit_rows": a.batch, "prompt_len": a.prompt_len,
            "canvas": a.gen_length, "smoke": a.smoke, "date": time.strftime("%Y-%m-%d")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, few positions and steps: seconds")
    ap.add_argument("--sizes", default="tiny,mid")
    ap.add_argument("--models", default="dense,moe,gemma", help="comma-separated subset")
    ap.add_argument("--batch", type=int, default=4, help="rows of the logit comparison")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-length", type=int, default=64, help="canvas of the logit comparison")
    ap.add_argument("--decode-rows", type=int, default=4)
    ap.add_argument("--decode-gen", type=int, default=32, help="tokens (= steps) of each greedy decode")
    ap.add_argument("--speed-batches", default="1,32", help="CUDA: batches of the LLaDA-8B step ('' skips it)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    sizes = ["tiny"] if a.smoke else [s for s in a.sizes.split(",") if s]
    if a.smoke:  # every phase in seconds, not figures: the CPU rehearsal of gpu_check.sh
        a.batch, a.prompt_len, a.gen_length, a.decode_rows, a.decode_gen = 2, 8, 16, 2, 8
    a.speed_batches = [int(b) for b in a.speed_batches.split(",") if b] if not a.smoke else []
    device = "cuda" if torch.cuda.is_available() and fp8_capable("cuda") and not a.smoke else "cpu"
    report = {"conditions": conditions(a, device), "rows": [], "speed": []}

    def save() -> None:
        if a.json:
            a.json.write_text(json.dumps(report, indent=2) + "\n")

    if device == "cuda" and a.speed_batches:  # first: the figure only the device can give
        speed_rows(a, report["speed"], save)
    for size in sizes:
        runs = [(f"dense-{size}", lambda: mask_model_rows(f"dense-{size}", config(DENSE[size]), device, a)),
                (f"moe-{size}", lambda: mask_model_rows(f"moe-{size}", config(MOES[size], **MOE), device, a))]
        if device == "cpu":  # DiffusionGemma's text model runs on the CPU in this checkout
            runs.append((f"gemma-{size}", lambda: gemma_rows(f"diffusion-gemma-{size}", GEMMA[size], a)))
        for name, make in [r for r in runs if r[0].split("-")[0] in a.models.split(",")]:
            for row in make():
                report["rows"].append(row)
                print(json.dumps(row), flush=True)
                save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
