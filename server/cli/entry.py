"""The `celeris` command.

Engine-side subcommands: `run` here, train/eval/serve in server/cli/commands.py, flags in
server/cli/args.py (imports go one way: cli.entry -> cli.commands -> cli.args, app). Client
subcommands (generate, batch, bench) are implemented in `celeris_client.cli`, which never imports
torch; `run_client` below is the one place in `server` that imports `clients`, explicitly and
only when a client subcommand runs (tests/unit/test_imports.py holds it to that).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

from celeris.server.cli.args import add_model_args, add_sampling_args, engine_config_from_args, sampling_from_args

CLIENT_COMMANDS = ("generate", "batch", "bench")
_IMPORTED = time.perf_counter()


def run_client(argv: list[str]) -> int:
    """Dispatch a client subcommand to clients.cli (bench --in-process gets the engine backend)."""
    from celeris_client.cli import main as client_main

    extra = {}
    if argv[0] == "bench" and "--in-process" in argv:  # the engine-side backend, kept out of clients/
        from celeris.server.cli.bench_inprocess import InProcessBackend

        extra["in_process"] = InProcessBackend
        from celeris.engine.errors import EngineError

        try:
            return client_main(argv, **extra)
        except EngineError as e:  # the model or device --in-process names: one line, as serve says it
            print(f"celeris bench: error: {e}", file=sys.stderr)
            return 2
    return client_main(argv, **extra)


def process_age_s() -> float:
    """Seconds since this process started (the interpreter's own start-up and every import
    included), from /proc; since this module was imported where /proc is not there."""
    try:
        start_ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.perf_counter() - _IMPORTED


def cmd_run(a: argparse.Namespace) -> int:
    from celeris.engine.errors import ModelLoadError
    from celeris.engine.serving import LLM, configure_threads
    from celeris.server.cli.model import model_from_args

    t_imports, t0 = process_age_s(), time.perf_counter()
    threads = configure_threads(a.threads)  # default: the CPUs this process may use (affinity, cgroup quota)
    sampling_from_args(a)  # obviously bad flags fail before the model loads
    source = model_from_args(a)  # --device cuda without CUDA, a Hub id not in the cache: one line
    try:
        llm = LLM.load(source.path, engine_config_from_args(a, max_batch=1, max_gen_length=4096, max_prompt_tokens=4096))
    except ModelLoadError as e:
        raise ModelLoadError(f"--model: {e}") from None
    t1 = time.perf_counter()
    try:
        res = llm.generate_one(a.prompt, sampling_from_args(a, llm.defaults))
    finally:
        llm.close()  # tensor-parallel workers, if any
    t2 = time.perf_counter()
    timings = {"imports_s": round(t_imports, 3), "load_s": round(t1 - t0, 3), "generate_s": round(t2 - t1, 3),
               "threads": threads}
    if a.json:
        out = {"text": res.text, "token_ids": res.token_ids, "steps": res.steps,
               "finish_reason": res.finish_reason.value, "seed": res.seed, "kv_cache": llm.kv_cache}
        if res.logprobs:
            out["logprobs"] = [{"logprob": lp, "top": [[i, v] for i, v in top]} for lp, top in res.logprobs]
        print(json.dumps(out | ({"timings": timings} if a.timings else {})))
    else:
        print(res.text)
    if a.timings:
        print(f"celeris run: start-up {t_imports:.2f} s (interpreter and imports) + {t1 - t0:.2f} s (model build "
              f"and load) + {t2 - t1:.2f} s (generation, {res.steps} forward passes); {threads} torch threads",
              file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="celeris", description="Serve masked-diffusion language models.")
    sub = ap.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="one in-process generation, no server")
    add_model_args(run)
    run.add_argument("--prompt", required=True, help="prompt text")
    run.add_argument("--json", action="store_true", help="print one JSON object")
    run.add_argument("--timings", action="store_true",
                     help="print the start-up split to stderr (and as `timings` in --json): interpreter and "
                          "imports, model build and load, generation")
    add_sampling_args(run)
    run.set_defaults(func=cmd_run)

    from celeris.server.cli.commands import register

    register(sub)
    for name in CLIENT_COMMANDS:
        sub.add_parser(name, help=f"client: see `celeris {name} --help`", add_help=False)
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in CLIENT_COMMANDS:
        return run_client(argv)
    ap = build_parser()
    a = ap.parse_args(argv)
    from celeris.engine.errors import EngineError

    try:
        return a.func(a)
    except EngineError as e:  # bad parameters, missing model folder: one line, non-zero exit
        print(f"celeris {a.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `celeris run --json | head -c1`: end quietly, as clients.cli does
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
