"""`celeris generate | batch | bench`: the client commands (dispatched here by server/cli/entry.py).

    celeris generate --server localhost:50051 "Once upon a time" --steps 32
    celeris generate --chat --tools tools.json --tool-choice required "Weather in Paris?"
    celeris batch prompts.jsonl results.jsonl --concurrency 8
    celeris bench --server localhost:50051 --concurrency 8 --requests 64 --gen-length 64 --steps 32

Never imports engine or torch. `celeris bench --in-process` needs an engine-side backend, which
the `celeris` dispatcher passes in as `in_process` (see server/cli/bench_inprocess.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Union

import grpc

from celeris_client import batch, bench
from celeris_client.client import DEFAULT_TARGET, AsyncCelerisClient, CelerisClient
from celeris_client.errors import CelerisError, RetryPolicy
from celeris_client.types import REMASKING, TOOL_CHOICES, Result, Snapshot
from celeris_client.view import LiveView, snapshot_json

def _ids(text: str) -> tuple[int, ...]:
    return tuple(int(i) for i in text.split(",") if i.strip())


KNOB_FLAGS = (("gen_length", int, "tokens to generate (the canvas)"),
              ("steps", int, "denoising steps over the whole canvas"),
              ("block_length", int, "semi-autoregressive block length; must divide --gen-length"),
              ("temperature", float, "0 = greedy"),
              ("remasking", str, f"one of {', '.join(REMASKING)}"),
              ("threshold", float, "confidence-threshold parallel decoding, in (0, 1]"),
              ("factor", float, "Fast-dLLM factor rule (> 0)"),
              ("editing_threshold", float, "LLaDA2.1 token editing: replace a written token whose new pick is "
                                           "this likely, [0, 1]; 1: off"),
              ("max_post_steps", int, "LLaDA2.1 token editing: most extra steps per block once it has no mask"),
              ("factor_rule", str, "fast_dllm (Fast-dLLM's code, default) or paper"),
              ("schedule", str, "llada or dream (Dream's timestep schedule)"),
              ("decoding", str, "Nemotron-Labs-Diffusion: ar, diffusion or linear_spec (self-speculation)"),
              ("eps", float, "final timestep of the dream schedule"),
              ("kv_cache", str, "none, prefix or dual (Fast-dLLM's approximate caches; full-canvas models)"),
              ("top_k", int, "draw only among the k most likely tokens"),
              ("top_p", float, "nucleus: draw among the most likely tokens up to this mass"),
              ("min_p", float, "draw only among tokens at least this fraction as likely as the top one"),
              ("stop_token_ids", _ids, "comma-separated token ids that end the output like EOS"),
              ("min_tokens", int, "no stop token in the first N positions"),
              ("frequency_penalty", float, "lower a token's logit by this per use in the response so far, [-2, 2]"),
              ("presence_penalty", float, "lower a token's logit by this once it is in the response, [-2, 2]"),
              ("logprobs", int, "report each token's log-probability and N alternatives (--json)"),
              ("n", int, "samples of the prompt, decoded together (sample j: seed + j); one text each"),
              ("cfg_scale", float, "classifier-free guidance scale"),
              ("max_denoising_steps", int, "revising models (DiffusionGemma): most denoising steps per canvas"),
              ("entropy_bound", float, "revising models: entropy bound of the positions accepted per step"),
              ("t_min", float, "revising models: temperature at a canvas's last step"),
              ("t_max", float, "revising models: temperature at a canvas's first step"),
              ("stability_threshold", int, "revising models: steps the argmax must hold before a canvas stops"),
              ("confidence_threshold", float, "revising models: mean entropy below which a stable canvas stops"),
              ("seed", int, "random seed (default: the server picks and reports one)"))


def add_connection_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("connection")
    g.add_argument("--server", default=os.environ.get("CELERIS_SERVER", DEFAULT_TARGET),
                   help="HOST:PORT of the gRPC server (default: $CELERIS_SERVER or %(default)s)")
    g.add_argument("--token", default=os.environ.get("CELERIS_API_TOKEN"),
                   help="bearer token (default: $CELERIS_API_TOKEN)")
    tls = g.add_mutually_exclusive_group()
    tls.add_argument("--tls", action="store_true", help="use TLS (default: plaintext for localhost, TLS otherwise)")
    tls.add_argument("--insecure", action="store_true", help="plaintext, even to a remote host")
    g.add_argument("--root-certs", type=Path, help="PEM file of root certificates for TLS (implies --tls)")
    g.add_argument("--timeout", type=float, default=None, help="deadline per request in seconds, retries included")
    g.add_argument("--retries", type=int, default=4, help="retries on UNAVAILABLE / RESOURCE_EXHAUSTED / CANCELLED (default 4)")
    g.add_argument("--retry-budget", type=float, default=10.0, metavar="TOKENS",
                   help="retry throttling: failures take a token, retries only while over half are left "
                        "(default %(default)s)")
    g.add_argument("--retry-ratio", type=float, default=0.1,
                   help="retry throttling: tokens a success gives back (default %(default)s)")


def add_knob_args(ap: argparse.ArgumentParser, title: str = "sampling (unset: the server's defaults)") -> None:
    g = ap.add_argument_group(title)
    for name, typ, help_ in KNOB_FLAGS:
        g.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, default=None, help=help_)
    g.add_argument("--ignore-eos", dest="ignore_eos", action="store_const", const=True, default=None,
                   help="EOS and end-of-turn do not stop the output")
    g.add_argument("--stop", dest="stop", action="append", default=None,
                   help="a string that ends the output (repeat for several)")


def knobs_from_args(a: argparse.Namespace) -> dict[str, Any]:
    names = [name for name, _, _ in KNOB_FLAGS] + ["ignore_eos", "stop"]
    return {name: getattr(a, name) for name in names if getattr(a, name, None) is not None}


def client_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    insecure = True if a.insecure else False if (a.tls or a.root_certs) else None
    return {"token": a.token, "insecure": insecure, "timeout": a.timeout,
            "root_certificates": a.root_certs.read_bytes() if a.root_certs else None,
            "retry": RetryPolicy(max_attempts=1 + max(0, a.retries), max_tokens=a.retry_budget,
                                 token_ratio=a.retry_ratio)}


def read_tools(path: Path) -> list[dict[str, Any]]:
    """--tools FILE: OpenAI's tools list ([{"type": "function", "function": {...}}, ...])."""
    tools = json.loads(path.read_text())
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError(f"--tools {path}: must hold a JSON list of tools ({{\"type\": \"function\", "
                         f"\"function\": {{\"name\", \"parameters\"...}}}})")
    return tools


def tool_knobs(a: argparse.Namespace) -> dict[str, Any]:
    """--tools, --tool-choice (none | auto | required | a function's name), --no-parallel-tool-calls."""
    out: dict[str, Any] = {}
    if a.tools is not None:
        out["tools"] = read_tools(a.tools)
    if a.tool_choice is not None:
        out["tool_choice"] = a.tool_choice if a.tool_choice in TOOL_CHOICES else {"name": a.tool_choice}
    if a.parallel_tool_calls is not None:
        out["parallel_tool_calls"] = a.parallel_tool_calls
    return out


def answer_lines(r: Union[Result, Snapshot]) -> list[str]:
    """What the server read from a chat answer: reasoning, content, then one line per tool call."""
    lines = [f"reasoning: {r.reasoning}"] if r.reasoning else []
    if r.content:
        lines.append(r.content)
    lines += [f"tool call {c.id}: {c.name}({c.arguments})" for c in r.tool_calls]
    return lines


def print_result(r: Result) -> None:
    read = r.tool_calls or r.reasoning is not None or r.content is not None
    print("\n".join(answer_lines(r)) if read else r.text)


def cmd_generate(a: argparse.Namespace) -> int:
    tools = tool_knobs(a)
    chat = a.chat or bool(tools)  # tools go with a chat prompt
    prompt: Any = [{"role": "user", "content": a.prompt}] if chat else a.prompt
    knobs = knobs_from_args(a) | tools
    if a.provisional and (a.plain or ((knobs.get("n") or 1) > 1 and not a.json)):
        raise ValueError("--provisional shows in streamed snapshots: use it with the live view or --json")
    stream_knobs = knobs | ({"provisional": True} if a.provisional else {})
    with CelerisClient(a.server, **client_kwargs(a)) as client:
        if a.json:
            for snap in client.stream(prompt, **stream_knobs):
                print(snapshot_json(snap), flush=True)
        elif (knobs.get("n") or 1) > 1:  # several samples: their final texts, one per line
            for res in client.sample(prompt, knobs.pop("n"), **knobs):
                print_result(res)
        elif sys.stdout.isatty() and not a.plain:
            eos = client.model_info().eos_token_id
            view = LiveView(sys.stdout, color=not os.environ.get("NO_COLOR"), stop_ids=frozenset({eos}))
            last = None
            try:
                for last in client.stream(prompt, **stream_knobs):
                    view.draw(last)
            finally:
                view.close()
            if last is not None and (last.tool_calls or last.reasoning):  # the canvas shows the raw answer
                print("\n".join(answer_lines(last)))
        else:
            print_result(client.generate(prompt, **knobs))
    return 0


def cmd_batch(a: argparse.Namespace) -> int:
    async def go() -> batch.Summary:
        async with AsyncCelerisClient(a.server, options=batch.RECONNECT_OPTIONS, **client_kwargs(a)) as client:
            return await batch.run_batch(client, a.input, a.output, concurrency=a.concurrency,
                                         defaults=knobs_from_args(a), timeout=a.timeout,
                                         retry_window_s=a.retry_window)

    summary = asyncio.run(go())
    print(summary.describe(), file=sys.stderr)
    return 0 if summary.failed == 0 and summary.bad_lines == 0 else 1


def cmd_bench(a: argparse.Namespace, in_process: Optional[Callable[[argparse.Namespace], Any]] = None) -> int:
    if a.in_process:
        if in_process is None:
            print("celeris bench: --in-process needs the engine; run it through the `celeris` command",
                  file=sys.stderr)
            return 2
        backend = in_process(a)
    else:
        backend = bench.GrpcBackend(a.server, **client_kwargs(a))
    report = asyncio.run(bench.run_bench(backend, concurrency=a.concurrency, requests=a.requests,
                                         prompt_len=a.prompt_len, knobs=knobs_from_args(a), warmup=a.warmup,
                                         show_progress=not a.quiet))
    print(bench.describe(report))
    if a.report:
        a.report.write_text(json.dumps(report, indent=2) + "\n")
        print(f"report written to {a.report}")
    return 0 if report["results"]["failed"] == 0 else 1


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="celeris", description="Celeris client commands.")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="one generation, the canvas redrawn live as it refines")
    g.add_argument("prompt", help="prompt text")
    g.add_argument("--chat", action="store_true", help="send the prompt as one user message (chat template)")
    g.add_argument("--json", action="store_true", help="print every snapshot as one JSON line")
    g.add_argument("--plain", action="store_true", help="print only the final text, even on a terminal")
    g.add_argument("--provisional", action="store_true",
                   help="also stream the current block's top predictions (shown dim in place of masks)")
    t = g.add_argument_group("tools (docs/tools.md; imply --chat)")
    t.add_argument("--tools", type=Path, default=None, metavar="FILE.json",
                   help="OpenAI-shaped tools list the model may call; its calls are printed one a line")
    t.add_argument("--tool-choice", default=None, metavar="CHOICE",
                   help=f"{' | '.join(TOOL_CHOICES)} | a function's name (required and named calls are "
                        "decoded under the function's schema); default auto with --tools")
    t.add_argument("--no-parallel-tool-calls", dest="parallel_tool_calls", action="store_const", const=False,
                   default=None, help="at most one call per answer")
    add_connection_args(g)
    add_knob_args(g)

    b = sub.add_parser("batch", help="one generation per JSONL line, resumable")
    b.add_argument("input", type=Path, help="input JSONL: {\"id\", \"prompt\" | \"messages\" | \"token_ids\", knobs}")
    b.add_argument("output", type=Path, help="output JSONL (appended; ids already ok are skipped); - for stdout")
    b.add_argument("--concurrency", type=int, default=4, help="requests in flight (default %(default)s)")
    b.add_argument("--retry-window", type=float, default=batch.RETRY_WINDOW_S, metavar="SECONDS",
                   help="how long an item keeps trying while the server restarts or is full (default %(default)s)")
    add_connection_args(b)
    add_knob_args(b, "default knobs for lines that do not set them")

    bn = sub.add_parser("bench", help="throughput and latency under load")
    bn.add_argument("--concurrency", type=int, default=4, help="requests in flight (default %(default)s)")
    bn.add_argument("--requests", type=int, default=32, help="measured requests (default %(default)s)")
    bn.add_argument("--warmup", type=int, default=1, help="unmeasured requests first (default %(default)s)")
    bn.add_argument("--prompt-len", type=int, default=32, help="prompt length in tokens (default %(default)s)")
    bn.add_argument("--report", type=Path, default=Path("bench-report.json"), help="JSON report (default %(default)s)")
    bn.add_argument("--quiet", action="store_true", help="no progress bar")
    ip = bn.add_argument_group("in-process (no server: the engine in this process)")
    ip.add_argument("--in-process", action="store_true", help="drive the engine directly instead of --server")
    ip.add_argument("--model", default=None, help="checkpoint folder, Hugging Face id (through the Hugging Face cache, "
                                                  "as celeris serve) or embedded model (default: celeris-tiny)")
    ip.add_argument("--revision", default=None, help="Hugging Face id: branch, tag or commit (default main)")
    ip.add_argument("--download-dir", default=None, metavar="DIR", help="Hugging Face id: the cache folder")
    ip.add_argument("--device", default="cpu")
    ip.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "auto"))
    ip.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ip.add_argument("--max-batch", type=int, default=None, help="engine batch size (default: --concurrency)")
    ip.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N", help="split the model over N processes")
    ip.add_argument("--expert-parallel", action="store_true", help="MoE: whole experts per rank")
    add_connection_args(bn)
    add_knob_args(bn)
    return ap


def closed_pipe() -> int:
    """The reader of stdout went away (`| head`): stop quietly, as cat or grep do. stdout is
    pointed at /dev/null so the interpreter's last flush has nowhere to fail."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real file descriptor (a test's captured stdout)
        pass
    return 0


def main(argv: Optional[list[str]] = None, in_process: Optional[Callable[[argparse.Namespace], Any]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = build_parser().parse_args(argv)
    try:
        if a.command == "generate":
            return cmd_generate(a)
        if a.command == "batch":
            return cmd_batch(a)
        return cmd_bench(a, in_process)
    except CelerisError as e:
        print(f"celeris {a.command}: error: {e.describe()}", file=sys.stderr)
        return 2 if e.code == grpc.StatusCode.INVALID_ARGUMENT else 1
    except BrokenPipeError:
        return closed_pipe()
    except (ValueError, OSError) as e:  # out-of-range knob values, unreadable files
        print(f"celeris {a.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
