"""`celeris train`, `celeris eval` and `celeris serve`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def cmd_train(a: argparse.Namespace) -> int:
    from engine.training.train import train

    train(a.out, a.steps, seed=a.seed, small=a.small, cache_dir=a.cache_dir, threads=a.threads)
    return 0


def cmd_eval(a: argparse.Namespace) -> int:
    import dataclasses

    import torch

    from engine.llm import LLM
    from engine.training.evaluate import evaluate, format_report
    from server.cli import engine_config_from_args

    if a.threads:
        torch.set_num_threads(a.threads)
    llm = LLM.load(a.model, engine_config_from_args(a, max_batch=64, max_queue=4096))
    report = evaluate(llm, a.cache_dir, limit=a.limit)
    if a.json:
        report["scores"] = [dataclasses.asdict(s) for s in report["scores"]]
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    from server.app import serve_from_args

    return serve_from_args(a)


def register(sub: argparse._SubParsersAction) -> None:
    from server.cli import add_model_args

    cache = Path.home() / ".cache" / "celeris"

    from engine.training.train import add_train_args

    tr = sub.add_parser("train", help="train celeris-tiny from scratch (2 CPU cores, ~45 min)")
    add_train_args(tr)
    tr.set_defaults(func=cmd_train)

    ev = sub.add_parser("eval", help="held-out loss and skill accuracy under several decoders")
    add_model_args(ev)
    ev.add_argument("--limit", type=int, default=None, help="evaluate only the first N held-out problems")
    ev.add_argument("--cache-dir", type=Path, default=cache)
    ev.add_argument("--json", action="store_true")
    ev.set_defaults(func=cmd_eval)

    sv = sub.add_parser("serve", help="run the gRPC server (and optionally the HTTP gateway)")
    add_model_args(sv)
    from server.app import add_serve_args

    add_serve_args(sv)
    sv.set_defaults(func=cmd_serve)
