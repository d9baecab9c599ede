"""The `celeris` command.

Engine-side subcommands (run, eval, train, serve) live here; client subcommands (generate,
batch, bench) are implemented in `clients.cli`, which never imports torch, and are only
dispatched from here. This dispatcher is the one module that sees both sides.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

CLIENT_COMMANDS = ("generate", "batch", "bench")


def add_sampling_args(ap: argparse.ArgumentParser) -> None:
    """Every knob defaults to None: unset means the model's own default (generation_config.json)."""
    from engine.params import FACTOR_RULES, REMASKING, SCHEDULES

    g = ap.add_argument_group("sampling (unset: the model's defaults)")
    g.add_argument("--gen-length", type=int, help="tokens to generate")
    g.add_argument("--steps", type=int, help="denoising steps over the whole canvas, split evenly over blocks")
    g.add_argument("--block-length", type=int, help="semi-autoregressive block length; must divide --gen-length")
    g.add_argument("--temperature", type=float, help="0 = greedy")
    g.add_argument("--remasking", help=f"one of {', '.join(REMASKING)}")
    g.add_argument("--threshold", type=float, help="confidence-threshold parallel decoding, in (0, 1]")
    g.add_argument("--factor", type=float, help="Fast-dLLM factor rule (> 0)")
    g.add_argument("--factor-rule", choices=FACTOR_RULES,
                   help="fast_dllm: as Fast-dLLM's published code (default); paper: the paper's strict formula")
    g.add_argument("--schedule", choices=SCHEDULES,
                   help="tokens per step of the fixed schedule: llada (even split per block) or dream "
                        "(Dream's timesteps linspace(1, eps, steps+1); use --block-length = --gen-length for Dream's own loop)")
    g.add_argument("--eps", type=float, help="Dream schedule's final timestep, in (0, 1) (default 1e-3)")
    g.add_argument("--cfg-scale", type=float, help="classifier-free guidance scale")
    g.add_argument("--seed", type=int, help="random seed (default: chosen and reported)")


SAMPLING_FIELDS = ("gen_length", "steps", "block_length", "temperature", "remasking", "threshold", "factor",
                   "factor_rule", "schedule", "eps", "cfg_scale", "seed")


def sampling_from_args(a: argparse.Namespace, defaults=None):
    """The given flags over `defaults`, validated; errors name the flag (--block-length)."""
    import dataclasses

    from engine.errors import FieldViolation, InvalidRequest
    from engine.params import SamplingParams

    given = {f: getattr(a, f) for f in SAMPLING_FIELDS if getattr(a, f, None) is not None}
    params = dataclasses.replace(defaults or SamplingParams(), **given)
    try:
        return params.validate()
    except InvalidRequest as e:
        raise InvalidRequest([FieldViolation("--" + v.field.replace("_", "-"), v.description)
                              for v in e.violations]) from None


def add_model_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", type=Path, default=None, help="checkpoint folder (default: embedded celeris-tiny)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N (default %(default)s)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--kv-cache", default="none", choices=("none", "prefix", "dual"),
                    help="Fast-dLLM approximate KV cache for requests that do not choose one (default %(default)s)")


def engine_config_from_args(a: argparse.Namespace, **kw):
    from engine.config import EngineConfig

    return EngineConfig(device=a.device, dtype=a.dtype, kv_cache=a.kv_cache, **kw)


def cmd_run(a: argparse.Namespace) -> int:
    import torch

    from engine.errors import ModelLoadError
    from engine.llm import LLM

    if a.threads:
        torch.set_num_threads(a.threads)
    sampling_from_args(a)  # obviously bad flags fail before the model loads
    try:
        llm = LLM.load(a.model, engine_config_from_args(a, max_batch=1, max_gen_length=4096, max_prompt_tokens=4096))
    except ModelLoadError as e:
        raise ModelLoadError(f"--model: {e}") from None
    res = llm.generate_one(a.prompt, sampling_from_args(a, llm.defaults))
    if a.json:
        print(json.dumps({"text": res.text, "token_ids": res.token_ids, "steps": res.steps,
                          "finish_reason": res.finish_reason.value, "seed": res.seed,
                          "kv_cache": llm.kv_cache}))
    else:
        print(res.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="celeris", description="Serve masked-diffusion language models.")
    sub = ap.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="one in-process generation, no server")
    add_model_args(run)
    run.add_argument("--prompt", required=True, help="prompt text")
    run.add_argument("--json", action="store_true", help="print one JSON object")
    add_sampling_args(run)
    run.set_defaults(func=cmd_run)

    from server import cli_commands

    cli_commands.register(sub)
    for name in CLIENT_COMMANDS:
        sub.add_parser(name, help=f"client: see `celeris {name} --help`", add_help=False)
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in CLIENT_COMMANDS:
        import importlib

        extra = {}
        if argv[0] == "bench" and "--in-process" in argv:  # the engine-side backend, kept out of clients/
            extra["in_process"] = importlib.import_module("server.bench_inprocess").InProcessBackend
        return importlib.import_module("clients.cli").main(argv, **extra)
    ap = build_parser()
    a = ap.parse_args(argv)
    from engine.errors import EngineError

    try:
        return a.func(a)
    except EngineError as e:  # bad parameters, missing model folder: one line, non-zero exit
        print(f"celeris {a.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
