"""Side-by-side benchmark: naive reference loop vs batched engine vs gRPC serving, in one process.

    python scripts/benchmark.py                      # celeris-tiny, CPU, 16 concurrent requests

Same prompts, model and decoder settings for every mode:
  1. naive   LLaDA's reference loop: batch 1, a full forward per step, the fixed schedule
  2. engine  the in-process engine: step-level batching of all requests, threshold decoding,
             the dual KV cache
  3. grpc    a real server on loopback with N concurrent Generate streams (final-only
             stream mode), same engine settings as 2
Workloads: the held-out two-digit addition problems of celeris-tiny (exact-match accuracy is
reported beside the speed), Austen prompts with longer generations, and `block`: the same
prompts through a block-diffusion model (a random SDAR-layout model of celeris-tiny's size,
or --block-model DIR) whose "naive" row is the same engine serving one request at a time. Throughput is output
tokens/s = generated non-EOS tokens / wall time. Achieved FLOP/s of the forwards is compared
to a matmul peak measured on the same machine. Runs are repeated; medians are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from celeris.engine.config import EngineConfig  # noqa: E402
from celeris.engine.families.registry import card_named  # noqa: E402
from celeris.engine.models.transformer import MaskPredictor  # noqa: E402
from celeris.engine.llm import LLM  # noqa: E402
from celeris.engine.sampling.params import SamplingParams  # noqa: E402
from celeris.engine.sampling.reference import reference_generate  # noqa: E402
from celeris.engine.training import data, skill  # noqa: E402

TEXT_PROMPTS = ["It is a truth universally", "Emma Woodhouse, handsome, clever,", "Mr. Darcy", "She was",
                "The family of Dashwood", "Sir Walter Elliot", "Catherine Morland", "My dear Lizzy,",
                "It was a fine morning", "Lady Catherine", "Mrs. Bennet", "Captain Wentworth",
                "Elinor", "Fanny Price", "Mr. Knightley", "Anne"]


@dataclass
class Run:
    mode: str
    workload: str
    tokens: int = 0
    seconds: float = 0.0
    correct: int = 0
    problems: int = 0
    forwards: int = 0
    flops: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def accuracy(self) -> float | None:
        return self.correct / self.problems if self.problems and self.workload == "skill" else None


def key_length(L: int, cache) -> int:
    """Keys each of the L queries run attends to, per kind of cache (engine/models/transformer.py, cache.py):
    a KVCache's whole row (its fresh columns replaced, not added), a CanvasCache's last `L`
    columns of the slot store, a BlockCache's first `length` (committed blocks and this one)."""
    if cache is None:
        return L
    if hasattr(cache, "keys"):  # KVCache
        return cache.keys[0].shape[2]
    if hasattr(cache, "length"):  # BlockCache
        return cache.length
    return cache.L  # CanvasCache


class FlopCounter:
    """Analytic forward FLOPs from the shapes each forward sees (matmuls only)."""

    def __init__(self, model):
        self.model, self.flops, self.calls = model, 0.0, 0
        cfg = model.cfg
        d, dkv = cfg.d_model, cfg.n_kv_heads * cfg.head_dim
        self.per_token = 2 * cfg.n_layers * (2 * d * d + 2 * d * dkv + 3 * d * cfg.mlp_hidden_size)
        self.handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output):
        cfg = module.cfg
        ids = args[0]
        B, L = ids.shape
        Lk = key_length(L, kwargs.get("cache"))
        out_index = kwargs.get("out_index")
        W = L if out_index is None else out_index.shape[1]
        attn = 4 * cfg.n_layers * B * L * Lk * cfg.d_model
        self.flops += B * L * self.per_token + attn + 2 * B * W * cfg.d_model * cfg.vocab_size
        self.calls += 1


def matmul_peak(seconds: float = 1.0, n: int = 1024) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        count += 1
    return 2 * n**3 * count / (time.perf_counter() - t0)


def workload(llm: LLM, name: str, n: int) -> tuple[list[str], SamplingParams, list[tuple[str, str]]]:
    if name == "skill":
        pairs = skill.heldout_pairs()[:n]
        g = data.SKILL_GEN_LENGTH
        return [p for p, _ in pairs], SamplingParams(gen_length=g, steps=g, block_length=g, seed=0), pairs
    prompts = (TEXT_PROMPTS * (n // len(TEXT_PROMPTS) + 1))[:n]
    return prompts, SamplingParams(gen_length=64, steps=64, block_length=16, seed=0), []


def random_block_llm(template: LLM, config: EngineConfig, block_length: int = 4) -> LLM:
    """A random SDAR-layout model with celeris-tiny's sizes and tokenizer: a speed figure only."""
    c = template.model.cfg
    cfg = card_named("sdar").config(d_model=c.d_model, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads,
                      n_layers=c.n_layers, mlp_hidden_size=c.mlp_hidden_size, vocab_size=c.vocab_size,
                      embedding_size=c.vocab_size, mask_token_id=c.mask_token_id, eos_token_id=c.eos_token_id,
                      qk_norm=True, block_length=block_length, name=f"random SDAR layout ({c.name} sizes)")
    torch.manual_seed(0)
    model = MaskPredictor(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() == 2 else p.fill_(1.0)
    return LLM(model.eval().requires_grad_(False), template.tokenizer, config, name=cfg.name)


def run_sequential(llm: LLM, prompts, params, pairs, counter: FlopCounter) -> Run:
    """The block workload's baseline: the same engine, one request at a time."""
    run = Run("naive", "text")
    f0, c0, t0 = counter.flops, counter.calls, time.perf_counter()
    for p in prompts:
        run.tokens += len(llm.generate([p], params)[0].token_ids)
    run.seconds = time.perf_counter() - t0
    run.flops, run.forwards = counter.flops - f0, counter.calls - c0
    run.problems = len(prompts)
    return run


def score(run: Run, llm: LLM, texts: list[str], pairs) -> None:
    run.problems = len(texts)
    if pairs:
        run.correct = sum(skill.is_correct(p, t) for (p, _), t in zip(pairs, texts))


def run_naive(llm: LLM, prompts, params, pairs, counter: FlopCounter) -> Run:
    run = Run("naive", "skill" if pairs else "text")
    fwd = lambda x, m: llm.model(x, key_mask=None if m is None else m.bool())  # noqa: E731
    texts, f0, c0 = [], counter.flops, counter.calls
    t0 = time.perf_counter()
    for p in prompts:
        ids = torch.tensor([llm.encode_prompt(p)])
        canvas, nfe = reference_generate(fwd, ids, params, llm.tokenizer.mask_id, stop_ids=llm.tokenizer.stop_ids)
        out = llm.tokenizer.until_stop(canvas[0, ids.shape[1]:].tolist())
        run.tokens += len(out)
        texts.append(llm.tokenizer.decode(out))
    run.seconds = time.perf_counter() - t0
    run.flops, run.forwards = counter.flops - f0, counter.calls - c0
    score(run, llm, texts, pairs)
    return run


def run_engine(llm: LLM, prompts, params, pairs, counter: FlopCounter | None, concurrency: int) -> Run:
    """The in-process engine in waves of `concurrency` requests (also bench_serving's baseline,
    which passes no FlopCounter: its hook would cost the engine time the server does not pay)."""
    run = Run("engine", "skill" if pairs else "text")
    f0, c0 = (counter.flops, counter.calls) if counter else (0.0, llm.loop.forwards)
    texts: list[str] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), concurrency):  # waves of `concurrency` requests, like N clients
        results = llm.generate(prompts[i:i + concurrency], params)
        run.tokens += sum(len(r.token_ids) for r in results)
        texts += [r.text for r in results]
    run.seconds = time.perf_counter() - t0
    if counter:
        run.flops, run.forwards = counter.flops - f0, counter.calls - c0
    else:
        run.forwards = llm.loop.forwards - c0
    score(run, llm, texts, pairs)
    return run


def run_grpc(llm: LLM, prompts, params, pairs, counter: FlopCounter, concurrency: int) -> Run:
    import grpc

    from celeris.v1 import generation_pb2 as pb
    from celeris.v1 import generation_pb2_grpc as pb_grpc
    from celeris.server.app import create_server
    from celeris.server.settings import ServerSettings
    from celeris.server.telemetry import configure_logging

    run = Run("grpc", "skill" if pairs else "text")

    async def main() -> list[str]:
        configure_logging(json_logs=True, stream=open(os.devnull, "w"))  # logs on, as JSON, to a sink
        server, port = await create_server(llm, ServerSettings(host="127.0.0.1", port=0, drain_seconds=0))
        texts: list[str] = [""] * len(prompts)
        queue = list(enumerate(prompts))
        f0, c0 = counter.flops, counter.calls
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.GenerationServiceStub(ch)

            async def client() -> None:
                while queue:
                    i, p = queue.pop(0)
                    req = pb.GenerateRequest(prompt=p, gen_length=params.gen_length, steps=params.steps,
                                             block_length=params.block_length, seed=params.seed or 0,
                                             frequency_penalty=params.frequency_penalty,  # not the model's
                                             presence_penalty=params.presence_penalty,  # default: same work
                                             stream_options=pb.StreamOptions(mode=pb.STREAM_MODE_FINAL_ONLY))
                    if params.threshold is not None:
                        req.threshold = params.threshold
                    async for msg in stub.Generate(req):
                        if msg.done:
                            texts[i] = msg.text
                            run.tokens += msg.usage.generated_tokens

            t0 = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(concurrency)))
            run.seconds = time.perf_counter() - t0
        run.flops, run.forwards = counter.flops - f0, counter.calls - c0
        await server.stop(drain_seconds=0, grace_seconds=1)
        return texts

    texts = asyncio.run(main())
    score(run, llm, texts, pairs)
    return run


def median_run(runs: list[Run]) -> Run:
    runs = sorted(runs, key=lambda r: r.tokens_per_s)
    return runs[len(runs) // 2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="checkpoint folder (default: celeris-tiny)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--problems", type=int, default=128, help="skill problems per run")
    ap.add_argument("--text-requests", type=int, default=16)
    ap.add_argument("--threshold", type=float, default=0.9, help="engine/grpc decoder threshold")
    ap.add_argument("--kv-cache", default="dual", choices=("none", "prefix", "dual"))
    ap.add_argument("--block-model", type=Path, default=None,
                    help="block-diffusion checkpoint for the block workload (default: a random SDAR-layout model)")
    ap.add_argument("--workloads", default="skill,text,block", help="comma-separated subset of skill,text,block")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None, help="also write the report here")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    base = dict(max_batch=a.concurrency, max_queue=4 * a.concurrency, max_prompt_tokens=128, max_gen_length=128)
    naive_llm = LLM.load(a.model, EngineConfig(**base))
    fast_llm = LLM.load(a.model, EngineConfig(**base, kv_cache=a.kv_cache))
    block_llm = (LLM.load(a.block_model, EngineConfig(**base)) if a.block_model
                 else random_block_llm(naive_llm, EngineConfig(**base)))
    counters = {id(m): FlopCounter(m) for m in (naive_llm.model, fast_llm.model, block_llm.model)}
    peak = matmul_peak()
    report = {"conditions": {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
                             "threads": a.threads, "model": naive_llm.name, "dtype": "float32",
                             "concurrency": a.concurrency, "engine": f"threshold={a.threshold}, kv_cache={a.kv_cache}",
                             "naive": "fixed schedule, steps=gen_length, batch 1", "repeats": a.repeats,
                             "matmul_peak_gflops": round(peak / 1e9, 1)}, "workloads": {}}
    chosen = a.workloads.split(",")
    for name, n in [w for w in (("skill", a.problems), ("text", a.text_requests), ("block", a.text_requests))
                    if w[0] in chosen]:
        if name == "block":  # the fixed schedule, 2 tokens a step
            prompts, _, pairs = workload(naive_llm, "text", n)
            bl = block_llm.model.cfg.block_length
            params = fast = SamplingParams(gen_length=64, steps=32, block_length=bl, seed=0)
            slow_llm = engine_llm = block_llm
            naive = lambda ps, prs: run_sequential(block_llm, ps, params, prs, counters[id(block_llm.model)])  # noqa: E731
        else:
            prompts, params, pairs = workload(naive_llm, name, n)
            fast = replace(params, threshold=a.threshold)
            slow_llm, engine_llm = naive_llm, fast_llm
            naive = lambda ps, prs: run_naive(naive_llm, ps, params, prs, counters[id(naive_llm.model)])  # noqa: E731
        counter = counters[id(engine_llm.model)]
        runs: dict[str, list[Run]] = {"naive": [], "engine": [], "grpc": []}
        warm = prompts[:2], pairs[:2]  # first calls pay for allocation and kernel selection
        naive(*warm)
        run_engine(engine_llm, warm[0], fast, warm[1], counter, a.concurrency)
        run_grpc(engine_llm, warm[0], fast, warm[1], counter, a.concurrency)
        for rep in range(a.repeats):
            print(f"[{name}] repeat {rep + 1}/{a.repeats}: naive", end="", flush=True)
            runs["naive"].append(naive(prompts, pairs))
            print(", engine", end="", flush=True)
            runs["engine"].append(run_engine(engine_llm, prompts, fast, pairs, counter, a.concurrency))
            print(", grpc", flush=True)
            runs["grpc"].append(run_grpc(engine_llm, prompts, fast, pairs, counter, a.concurrency))
        med = {m: median_run(r) for m, r in runs.items()}
        report["workloads"][name] = {
            "model": slow_llm.name, "gen_length": params.gen_length, "steps": params.steps, "block_length": params.block_length,
            "requests": len(prompts),
            **{m: asdict(r) | {"tokens_per_s": r.tokens_per_s, "accuracy": r.accuracy,
                               "gflops_per_s": r.flops / r.seconds / 1e9} for m, r in med.items()},
            "ratio_engine_over_naive": med["engine"].tokens_per_s / med["naive"].tokens_per_s,
            "ratio_grpc_over_engine": med["grpc"].tokens_per_s / med["engine"].tokens_per_s}
    print(format_report(report, peak))
    if a.json:
        a.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def format_report(report: dict, peak: float) -> str:
    c = report["conditions"]
    lines = [f"\nceleris benchmark: {c['model']}, {c['dtype']}, {c['machine']}, {c['threads']} threads, "
             f"concurrency {c['concurrency']}, median of {c['repeats']}; matmul peak {peak / 1e9:.1f} GFLOP/s",
             f"engine/grpc decoder: {c['engine']}; naive: {c['naive']}"]
    for name, w in report["workloads"].items():
        naive = "one request at a time" if name == "block" else f"naive steps={w['steps']}"
        lines += [f"\n{name} ({w['model']}): {w['requests']} requests, gen_length={w['gen_length']}, "
                  f"block_length={w['block_length']}, {naive}",
                  f"{'mode':8} {'tokens/s':>10} {'accuracy':>9} {'forwards':>9} {'GFLOP/s':>8} {'% peak':>7}"]
        for m in ("naive", "engine", "grpc"):
            r = w[m]
            acc = "-" if r["accuracy"] is None else f"{100 * r['accuracy']:.1f}%"
            lines.append(f"{m:8} {r['tokens_per_s']:10.1f} {acc:>9} {r['forwards']:9d} {r['gflops_per_s']:8.2f}"
                         f" {100 * r['gflops_per_s'] * 1e9 / peak:6.1f}%")
        lines.append(f"engine / naive = {w['ratio_engine_over_naive']:.2f}x   grpc / engine = {w['ratio_grpc_over_engine']:.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
