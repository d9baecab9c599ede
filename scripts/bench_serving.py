"""The serving benchmark in the deployment shape: `celeris serve` in its own process, the clients
in another (clients/stream_load.py), the in-process engine beside them in the same run.

    python scripts/bench_serving.py            # concurrency 1,16,64 x gen_length 64,256 x stream modes, 3 repeats
    python scripts/bench_serving.py --quick    # a smoke configuration (57 CPU-s; docs/benchmarks.md)

Per cell (concurrency, gen_length, stream mode) and repeat: output tokens/s (client wall time),
time to first message and latency (p50/p95), messages and bytes per request (sum of ByteSize()),
and per server step: forward time (celeris_step_latency_seconds, the wall time of runner.step),
the server process's CPU (/proc/<pid>/stat), the event loop's CPU (celeris_event_loop_cpu_seconds),
CPU outside the forward = (process CPU - forward CPU) / steps, the forward's CPU counted as
its wall time on one core (none for the simulated runner, whose forward is a sleep), and the
client process's CPU per server step (what the clients take from the same cores). `engine`
rows are `LLM.generate` in this process, stepped on the thread that loaded the model as the server
steps, with the same prompts, parameters, threads and waves; their `fwd ms` is the engine's whole
step (wall time per step), set beside the server's forward.

GPU-shaped simulation: a second server with `--simulate-step-ms` (engine/loop/sim_runner.py) serves
`--sim-batch` concurrent every-step streams; its steps/s is set beside the simulated runner's own
steps/s in a bare loop. Medians of --repeats; report written with --json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmark import TEXT_PROMPTS, run_engine  # noqa: E402
from celeris_client.progress import percentile  # noqa: E402
from celeris.engine.config import EngineConfig  # noqa: E402
from celeris.engine.llm import LLM  # noqa: E402
from celeris.engine.sampling.params import SamplingParams  # noqa: E402
from celeris.engine.loop.scheduler import Scheduler  # noqa: E402
from celeris.engine.loop.sim_runner import SimulatedRunner, ordinary_tokens  # noqa: E402
from celeris.engine.threads import TensorThread, available_cpus, serving_threads  # noqa: E402
from serving_process import ClientProcess, ServeProcess  # noqa: E402
from serving_report import format_report, median_by, targets  # noqa: E402

# The engine baseline's model is loaded and stepped here, as `celeris serve` does its own.
TENSOR_THREAD = TensorThread("bench-engine")


def params_for(gen: int, a: argparse.Namespace) -> SamplingParams:
    """steps = gen_length over blocks of --block-length, threshold decoding: the benchmark.py text
    workload's decoder at each length."""
    return SamplingParams(gen_length=gen, steps=gen, block_length=min(a.block_length, gen), seed=0,
                          threshold=a.threshold)


def request_specs(prompts: list[str], p: SamplingParams) -> list[dict[str, Any]]:
    # Every knob the engine row decodes with, so served requests do the same work: a knob left
    # out would take the model's default (celeris-tiny's frequency_penalty) on the server only.
    return [{"prompt": x, "gen_length": p.gen_length, "steps": p.steps, "block_length": p.block_length,
             "threshold": p.threshold, "seed": p.seed, "frequency_penalty": p.frequency_penalty,
             "presence_penalty": p.presence_penalty} for x in prompts]


def cell(server: ServeProcess, client: ClientProcess, mode: str, concurrency: int, specs: list[dict],
         forward_cores: float, uncounted: tuple[int, ...] = ()) -> dict[str, Any]:
    """One measured run of one cell through the server, with the server's per-step split.
    text_tokens_per_s leaves `uncounted` ids out (only in stream modes whose last message holds
    the tokens)."""
    before = server.sample()
    ans = client.run({"target": server.target, "concurrency": concurrency, "mode": mode, "requests": specs,
                      "uncounted_ids": list(uncounted)})
    after = server.sample()
    recs = ans["records"]
    ok = [r for r in recs if r["ok"]]
    d = {k: after[k] - before[k] for k in after}
    steps = max(1, int(d["steps"]))
    ms = lambda x: None if x is None else 1000 * x  # noqa: E731
    tokens = sum(r["tokens"] for r in ok)
    text_tokens = sum(r.get("text_tokens", 0) for r in ok)
    return {"tokens": tokens, "wall_s": ans["wall_s"], "tokens_per_s": tokens / ans["wall_s"],
            "text_tokens_per_s": text_tokens / ans["wall_s"], "requests_per_s": len(ok) / ans["wall_s"],
            "failed": len(recs) - len(ok), "errors": sorted({r["error"] for r in recs if r["error"]})[:3],
            "first_p50_ms": ms(percentile([r["first_s"] for r in ok], 50)),
            "latency_p50_ms": ms(percentile([r["latency_s"] for r in ok], 50)),
            "latency_p95_ms": ms(percentile([r["latency_s"] for r in ok], 95)),
            "messages_per_request": sum(r["messages"] for r in ok) / max(1, len(ok)),
            "bytes_per_request": sum(r["bytes"] for r in ok) / max(1, len(ok)),
            "steps": int(d["steps"]), "steps_per_s": d["steps"] / ans["wall_s"],
            "forwards_per_step": d.get("forwards", 0.0) / steps,
            "forward_ms": 1000 * d["forward_s"] / steps, "cpu_ms": 1000 * d["cpu_s"] / steps,
            "loop_cpu_ms": 1000 * d["loop_cpu_s"] / steps,
            "outside_ms": 1000 * max(0.0, d["cpu_s"] - forward_cores * d["forward_s"]) / steps,
            "client_cpu_ms": 1000 * ans["cpu_s"] / steps if "cpu_s" in ans else None}


def engine_cell(llm: LLM, prompts: list[str], p: SamplingParams, concurrency: int) -> dict[str, Any]:
    """The in-process engine on the same load, stepped on the thread that loaded the model, as
    `celeris serve` steps it (engine/threads.py): stepped on another thread, its OpenMP team waits
    passively between regions and a busy host stalls it at random."""
    run = TENSOR_THREAD.submit(run_engine, llm, prompts, p, [], None, concurrency).result()
    return {"tokens": run.tokens, "wall_s": run.seconds, "tokens_per_s": run.tokens_per_s, "steps": run.forwards,
            "steps_per_s": run.forwards / run.seconds, "forward_ms": 1000 * run.seconds / max(1, run.forwards)}


def scheduler_cell(llm: LLM, prompts: list[str], p: SamplingParams, concurrency: int) -> dict[str, Any]:
    """The in-process Scheduler on the server's load: `concurrency` closed-loop clients (each sends
    its next request when its last one ends, as the client process does), stepped on the thread
    that loaded the model, every event read; no transport, no formatting. The engine rows run
    waves instead, whose blocks stay aligned: a closed loop admits requests mid-block, and rows
    needing a cache refresh then take a forward of their own in the same step."""
    async def main() -> dict[str, Any]:
        sched = Scheduler(llm.loop, thread=TENSOR_THREAD)
        sched.start()
        queue, tokens = list(prompts), 0
        steps0, forwards0 = llm.loop.steps, llm.loop.forwards

        async def client() -> None:
            nonlocal tokens
            while queue:
                with sched.submit(llm.request(queue.pop(0), p)) as stream:
                    async for ev in stream:
                        last = ev
                    tokens += len(last.generated)

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        await sched.stop()
        steps, forwards = llm.loop.steps - steps0, llm.loop.forwards - forwards0
        return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "steps": steps,
                "steps_per_s": steps / wall, "forwards_per_step": forwards / max(1, steps)}

    return asyncio.run(main())


def run_matrix(a: argparse.Namespace, llm: LLM, client: ClientProcess, modes: list[str], log: Path) -> dict:
    """Every (gen_length, concurrency) cell: the engine, then each stream mode, per repeat."""
    cells: dict[str, dict] = {}
    with ServeProcess(a.model, a.threads, max(a.concurrency), a.kv_cache, log / "server.log",
                      max_gen_length=max(a.gen_lengths)) as server:
        for gen in a.gen_lengths:
            p = params_for(gen, a)
            warm = request_specs(TEXT_PROMPTS[:2], p)  # first calls pay allocation and kernel selection
            TENSOR_THREAD.submit(llm.generate, TEXT_PROMPTS[:2], p).result()
            for mode in modes:
                client.run({"target": server.target, "concurrency": 2, "mode": mode, "requests": warm})
            for c in a.concurrency:
                n = a.requests or max(8, 2 * c)
                prompts = (TEXT_PROMPTS * (n // len(TEXT_PROMPTS) + 1))[:n]
                runs: dict[str, list] = {m: [] for m in ["engine", "scheduler", *modes]}
                for rep in range(a.repeats):
                    print(f"[gen {gen}, concurrency {c}, {n} requests] repeat {rep + 1}/{a.repeats}: engine, scheduler",
                          end="", flush=True)
                    runs["engine"].append(engine_cell(llm, prompts, p, c))
                    runs["scheduler"].append(scheduler_cell(llm, prompts, p, c))
                    for mode in modes:
                        print(f", {mode}", end="", flush=True)
                        runs[mode].append(cell(server, client, mode, c, request_specs(prompts, p), 1.0))
                    print(flush=True)
                cells[f"{gen}/{c}"] = {"gen_length": gen, "concurrency": c, "requests": n, "steps": p.steps,
                                       "block_length": p.block_length,
                                       "modes": {m: median_by(r, "tokens_per_s") for m, r in runs.items()}}
    return cells


def runner_alone(a: argparse.Namespace, llm: LLM, p: SamplingParams) -> float:
    """Steps/s of the simulated runner in a bare loop over a full batch: the ceiling. Stepped on
    the thread that loaded the model, as `celeris serve` steps its runner (not the main thread)."""
    runner = SimulatedRunner(a.sim_batch, a.simulate_step_ms / 1000, ordinary_tokens(llm.tokenizer))
    seqs = [llm.request(x, p) for x in (TEXT_PROMPTS * a.sim_batch)[:a.sim_batch]]
    steps = p.steps

    def loop() -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            runner.step(seqs)
        return steps / (time.perf_counter() - t0)

    return TENSOR_THREAD.submit(loop).result()


def run_simulation(a: argparse.Namespace, llm: LLM, client: ClientProcess, modes: list[str], log: Path) -> dict:
    p = SamplingParams(gen_length=a.sim_gen_length, steps=a.sim_gen_length,
                       block_length=min(a.block_length, a.sim_gen_length), seed=0)
    mode = a.sim_mode or ("delta" if "delta" in modes else "full")  # every-step streams; delta once it exists
    specs = request_specs((TEXT_PROMPTS * a.sim_batch)[:a.sim_batch], p)
    alone, served = [], []
    with ServeProcess(a.model, a.threads, a.sim_batch, "none", log / "server-sim.log",
                      max_gen_length=a.sim_gen_length, simulate_step_ms=a.simulate_step_ms) as server:
        client.run({"target": server.target, "concurrency": 2, "mode": mode, "requests": specs[:2]})
        for rep in range(a.repeats):
            print(f"[simulated {a.simulate_step_ms:g} ms step, batch {a.sim_batch}, gen {a.sim_gen_length}] "
                  f"repeat {rep + 1}/{a.repeats}: runner alone, server ({mode})", flush=True)
            alone.append(runner_alone(a, llm, p))
            served.append(cell(server, client, mode, a.sim_batch, specs, 0.0))
    alone.sort()
    server_med = median_by(served, "steps_per_s")
    return {"step_ms": a.simulate_step_ms, "batch": a.sim_batch, "gen_length": a.sim_gen_length, "mode": mode,
            "runner_steps_per_s": alone[len(alone) // 2], "server": server_med,
            "ratio": server_med["steps_per_s"] / alone[len(alone) // 2]}


def git_commit() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev + ("+dirty" if dirty else "") if rev else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="checkpoint folder (default: celeris-tiny)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of the server and the engine baseline (default: what `celeris serve` picks)")
    ap.add_argument("--concurrency", type=ints, default=[1, 16, 64], help="comma-separated (default 1,16,64)")
    ap.add_argument("--gen-lengths", type=ints, default=[64, 256], help="comma-separated (default 64,256)")
    ap.add_argument("--modes", default=None,
                    help="stream modes, comma-separated (default: all the protos offer but delta-provisional)")
    ap.add_argument("--requests", type=int, default=None, help="requests per cell (default: 2 x concurrency, >= 8)")
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--kv-cache", default="dual", choices=("none", "prefix", "dual"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--simulate-step-ms", type=float, default=20.0, help="simulated GPU step (0: no simulation)")
    ap.add_argument("--sim-batch", type=int, default=32)
    ap.add_argument("--sim-gen-length", type=int, default=256)
    ap.add_argument("--sim-mode", default=None, help="the simulation's every-step stream mode (default: delta)")
    ap.add_argument("--sim-only", action="store_true", help="only the simulation (no cells, no engine rows)")
    ap.add_argument("--quick", action="store_true", help="smoke configuration: 1 repeat, small cells")
    ap.add_argument("--json", type=Path, default=None, help="also write the report here")
    a = ap.parse_args(argv)
    if a.quick:
        a.concurrency, a.gen_lengths, a.repeats, a.requests = [1, 4], [16], 1, 4
        a.simulate_step_ms, a.sim_batch, a.sim_gen_length, a.block_length = 5.0, 4, 32, 8
    a.threads = a.threads or serving_threads(available_cpus())
    return a


def main(argv: Optional[list[str]] = None) -> int:
    from celeris_client.stream_load import OPT_IN_MODES, stream_modes

    a = parse_args(argv)
    offered = [name for name, _ in stream_modes()]
    modes = a.modes.split(",") if a.modes else [m for m in offered if m not in OPT_IN_MODES]
    unknown = sorted(set(modes) - set(offered))
    if unknown:
        raise SystemExit(f"--modes: unknown {', '.join(unknown)} (offered: {', '.join(offered)})")
    if a.sim_mode is not None and (a.sim_mode not in offered or a.sim_mode.startswith(("block", "final"))):
        raise SystemExit(f"--sim-mode: {a.sim_mode!r} is not an every-step mode of {', '.join(offered)}")
    torch.set_num_threads(a.threads)
    TENSOR_THREAD.submit(torch.set_num_threads, a.threads).result()
    biggest = max(max(a.concurrency), a.sim_batch)
    llm = TENSOR_THREAD.submit(LLM.load, a.model, EngineConfig(
        max_batch=biggest, max_queue=4 * biggest, max_prompt_tokens=128,
        max_gen_length=max(*a.gen_lengths, a.sim_gen_length), kv_cache=a.kv_cache)).result()
    report: dict[str, Any] = {"conditions": {
        "model": llm.name, "dtype": "float32", "device": "cpu", "threads": a.threads, "cpus_available": available_cpus(),
        "cpu_count": os.cpu_count(), "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "python": platform.python_version(), "torch": torch.__version__, "commit": git_commit(),
        "decoder": f"threshold={a.threshold}, kv_cache={a.kv_cache}, steps=gen_length, block_length={a.block_length}, "
                   "no frequency or presence penalty (whatever the model defaults to)",
        "repeats": a.repeats, "modes": modes, "clients": "one process, one channel, asyncio streams"}}
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp, ClientProcess() as client:
        report["cells"] = {} if a.sim_only else run_matrix(a, llm, client, modes, Path(tmp))
        if a.simulate_step_ms > 0:
            report["simulation"] = run_simulation(a, llm, client, modes, Path(tmp))
    report["targets"] = targets(report)
    print(format_report(report))
    if a.json:
        a.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
