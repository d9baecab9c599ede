"""The served phase of scripts/bench_gpu.py: `celeris serve` in its own process on the device,
driven over gRPC with every-step delta streams, beside the in-process engine on the same load.

The model is a random LLaDA-format checkpoint with celeris-tiny's tokenizer and the shapes asked
for (weights are random: a step's cost depends on shapes, not values), written to a temporary
folder that both the server and the in-process engine load.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench_serving import TENSOR_THREAD, cell, engine_cell, request_specs  # noqa: E402
from benchmark import TEXT_PROMPTS  # noqa: E402
from celeris.engine.config import EngineConfig, ModelConfig  # noqa: E402
from celeris.engine.llm import EMBEDDED_MODELS, LLM  # noqa: E402
from celeris.engine.models.transformer import MaskPredictor  # noqa: E402
from celeris.engine.sampling.params import SamplingParams  # noqa: E402
from celeris.engine.threads import available_cpus, serving_threads  # noqa: E402
from celeris.engine.families.checkpoint import save_model  # noqa: E402
from serving_process import ClientProcess, ServeProcess  # noqa: E402


def write_model(folder: Path, shapes: dict[str, int], dtype: torch.dtype) -> Path:
    """celeris-tiny's config and tokenizer with `shapes` (d_model, n_heads, n_layers, ...)."""
    src = EMBEDDED_MODELS["celeris-tiny"]
    cfg = json.loads((src / "config.json").read_text()) | shapes | {"name": "served-random"}
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_text((src / name).read_text())
    fields = {k: v for k, v in cfg.items() if k in ModelConfig.__dataclass_fields__}
    with torch.device("meta"):
        model = MaskPredictor(ModelConfig(**fields))
    model = model.to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() == 2 else p.fill_(1.0)
    save_model(model, folder)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def served(device: str, dtype: torch.dtype, shapes: dict[str, int], concurrency: int, gen: int,
           kv_cache: str, repeats: int, log_dir: Path) -> dict[str, Any]:
    """Output tok/s served (delta streams) and in-process on the same requests; medians of repeats."""
    p = SamplingParams(gen_length=gen, steps=gen // 4, block_length=min(32, gen), seed=0, frequency_penalty=0.0)
    n = max(8, 2 * concurrency)
    prompts = (TEXT_PROMPTS * (n // len(TEXT_PROMPTS) + 1))[:n]
    specs = request_specs(prompts, p)
    dtype_name = str(dtype).replace("torch.", "")
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model(Path(tmp) / "model", shapes, dtype)
        cfg = EngineConfig(device=device, dtype=dtype_name, max_batch=concurrency, max_gen_length=max(512, gen),
                           max_queue=4 * concurrency, kv_cache=kv_cache)
        llm = TENSOR_THREAD.submit(LLM.load, folder, cfg).result()
        extra = ("--device", device, "--dtype", dtype_name)
        with ServeProcess(folder, serving_threads(available_cpus()), concurrency, kv_cache, log_dir / "served.log", max_gen_length=gen,
                          extra=extra) as server, ClientProcess() as client:
            TENSOR_THREAD.submit(llm.generate, prompts[:2], p).result()  # warm: kernels, graphs
            client.run({"target": server.target, "concurrency": 2, "mode": "delta", "requests": specs[:2]})
            runs: dict[str, list] = {"engine": [], "served": []}
            for _ in range(repeats):
                runs["engine"].append(engine_cell(llm, prompts, p, concurrency))
                runs["served"].append(cell(server, client, "delta", concurrency, specs, 1.0))
        llm.close()
    eng = statistics.median(r["tokens_per_s"] for r in runs["engine"])
    srv = statistics.median(r["tokens_per_s"] for r in runs["served"])
    return {"phase": "served", "shapes": shapes, "concurrency": concurrency, "requests": n, "gen_length": gen,
            "steps": p.steps, "block_length": p.block_length, "kv_cache": kv_cache, "stream": "delta",
            "repeats": repeats, "engine_tokens_per_s": round(eng, 1), "served_tokens_per_s": round(srv, 1),
            "served_over_engine": round(srv / eng, 3),
            "failed": sum(r["failed"] for r in runs["served"])}
