"""Argument helpers shared by the engine-side subcommands (run, eval, serve): model, sampling and
engine-config flags. Imports nothing else of `server`, so the command modules form no circle."""

from __future__ import annotations

import argparse
from pathlib import Path


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
    g.add_argument("--top-k", type=int, help="draw only among the k most likely tokens (0: all)")
    g.add_argument("--top-p", type=float, help="nucleus: draw among the most likely tokens up to this mass, in (0, 1]")
    g.add_argument("--stop-token-ids", type=lambda x: tuple(int(i) for i in x.split(",") if i),
                   help="comma-separated token ids that end the output like EOS")
    g.add_argument("--ignore-eos", action="store_const", const=True, help="EOS and end-of-turn do not stop")
    g.add_argument("--stop", action="append", type=str, help="a string that ends the output (repeat for several)")
    g.add_argument("--min-tokens", type=int, help="no stop token in the first N positions")
    g.add_argument("--frequency-penalty", type=float,
                   help="OpenAI's: lower a token's logit by this per use in the response so far, in [-2, 2]")
    g.add_argument("--presence-penalty", type=float,
                   help="OpenAI's: lower a token's logit by this once it is in the response, in [-2, 2]")
    g.add_argument("--logprobs", type=int, help="with --json: each token's log-probability and N alternatives")
    g.add_argument("--cfg-scale", type=float, help="classifier-free guidance scale")
    g.add_argument("--seed", type=int, help="random seed (default: chosen and reported)")


SAMPLING_FIELDS = ("gen_length", "steps", "block_length", "temperature", "remasking", "threshold", "factor",
                   "factor_rule", "schedule", "eps", "top_k", "top_p", "stop_token_ids", "ignore_eos", "min_tokens",
                   "logprobs", "stop", "frequency_penalty", "presence_penalty",
                   "cfg_scale", "seed")


def sampling_from_args(a: argparse.Namespace, defaults=None):
    """The given flags over `defaults`, steps and block length fitted to a --gen-length given
    alone, validated; errors name the flag (--block-length)."""
    from engine.errors import FieldViolation, InvalidRequest
    from engine.params import SamplingParams, fit_lengths

    given = {f: getattr(a, f) for f in SAMPLING_FIELDS if getattr(a, f, None) is not None}
    if "stop" in given:
        given["stop"] = tuple(given["stop"])
    params = fit_lengths(defaults or SamplingParams(), given)
    try:
        return params.validate()
    except InvalidRequest as e:
        raise InvalidRequest([FieldViolation("--" + v.field.replace("_", "-"), v.description)
                              for v in e.violations]) from None


def add_model_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", type=Path, default=None,
                    help="checkpoint folder, or an embedded model by name: celeris-tiny (the default), celeris-tiny-block")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N (default %(default)s)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: the CPUs this process may use: affinity mask and cgroup CPU quota)")
    ap.add_argument("--kv-cache", default="none", choices=("none", "prefix", "dual"),
                    help="Fast-dLLM approximate KV cache for requests that do not choose one (default %(default)s)")


def engine_config_from_args(a: argparse.Namespace, **kw):
    from engine.config import EngineConfig

    return EngineConfig(device=a.device, dtype=a.dtype, kv_cache=a.kv_cache, **kw)
