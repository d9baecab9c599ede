"""Argument helpers shared by the engine-side subcommands (run, eval, serve): model, sampling and
engine-config flags. Imports nothing else of `server`, so the command modules form no circle."""

from __future__ import annotations

import argparse


def add_sampling_args(ap: argparse.ArgumentParser) -> None:
    """A flag for every knob of the table (engine/sampling/knobs.py). Every knob defaults to None: unset
    means the model's own default (generation_config.json)."""
    from celeris.engine.requests import BOOL, IDS, STRINGS, on

    g = ap.add_argument_group("sampling (unset: the model's defaults)")
    for k in on("cli"):
        help = k.help + (f" (one of {', '.join(k.choices)})" if k.choices else "")
        dest = {"dest": k.name}
        if k.kind == BOOL:
            g.add_argument(k.cli, action="store_const", const=True, help=help, **dest)
        elif k.kind == STRINGS:
            g.add_argument(k.cli, action="append", type=str, help=help + " (repeat for several)", **dest)
        elif k.kind == IDS:
            g.add_argument(k.cli, type=_id_list, help=help + " (comma-separated)", **dest)
        else:
            g.add_argument(k.cli, type=k.python_type, help=help, **dest)


def _id_list(text: str) -> tuple[int, ...]:
    return tuple(int(i) for i in text.split(",") if i)


def sampling_from_args(a: argparse.Namespace, defaults=None):
    """The given flags over `defaults`, steps and block length fitted to a --gen-length given
    alone, validated; errors name the flag (--block-length)."""
    from celeris.engine.errors import FieldViolation, InvalidRequest
    from celeris.engine.requests import SamplingParams, fit_lengths, on

    given = {k.name: getattr(a, k.name) for k in on("cli") if getattr(a, k.name, None) is not None}
    if "stop" in given:
        given["stop"] = tuple(given["stop"])
    params = fit_lengths(defaults or SamplingParams(), given)
    try:
        return params.validate()
    except InvalidRequest as e:
        raise InvalidRequest([FieldViolation("--" + v.field.replace("_", "-"), v.description)
                              for v in e.violations]) from None


def add_model_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None,
                    help="checkpoint folder, Hugging Face id (org/name, through the Hugging Face cache; offline with "
                         "HF_HUB_OFFLINE=1), or an embedded model by name: celeris-tiny (the default), celeris-tiny-block")
    ap.add_argument("--revision", default=None, help="Hugging Face id: branch, tag or commit (default main)")
    ap.add_argument("--download-dir", default=None, metavar="DIR",
                    help="Hugging Face id: the cache folder to read and download into (default huggingface_hub's)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N (default %(default)s)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "auto"),
                    help="auto = the checkpoint's (config.json torch_dtype), as vLLM (default %(default)s)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: the CPUs this process may use: affinity mask and cgroup CPU quota)")
    ap.add_argument("--kv-cache", default="none", choices=("none", "prefix", "dual"),
                    help="Fast-dLLM approximate KV cache for requests that do not choose one (default %(default)s)")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                    help="block models: reuse cached prompt blocks across requests, exactly (default: on on the CPU; "
                         "docs/prefix-cache.md)")
    ap.add_argument("--prefix-cache-gb", type=float, default=None, metavar="GB",
                    help="the prefix cache's memory budget in GiB (default 1; 0 turns it off)")
    ap.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                    help="block models: prefill a long prompt in chunks between the running requests' steps (default on)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                    help="the most tokens one forward computes (rows x length, vLLM's name): a larger batch steps "
                         "its rows in turns, so a short request never waits behind one long forward "
                         "(default: 2048 on the CPU, no limit on CUDA; 0 = no limit)")
    ap.add_argument("--quantization", "-q", default=None, metavar="METHOD",
                    help="pack the weights after they load (vLLM's flag): fp8 = E4M3 weights with per-channel scales "
                         "and W8A8 matmuls, on a GPU with FP8 matmuls (compute capability 8.9+); embeddings, the LM "
                         "head and MoE routers stay in --dtype (default: none; docs/models.md)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                    help="split the model over N processes, one per device (docs/parallel.md; default 1)")
    ap.add_argument("--expert-parallel", action="store_true",
                    help="MoE models: whole experts per rank instead of slices of every expert")
    ap.add_argument("--collective-timeout", type=float, default=120.0, metavar="S",
                    help="tensor parallel: a rank that does not join a collective within S seconds counts as hung")
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
                    help="a request decodes the same tokens alone and in any batch (default on); off lets "
                         "DiffusionGemma's rows share one forward on CUDA, where cuBLAS rounds a row by the "
                         "batch's shapes (on the CPU its rows share one forward either way; docs/revising-models.md)")


def engine_config_from_args(a: argparse.Namespace, **kw):
    from celeris.engine.serving import EngineConfig

    return EngineConfig(device=a.device, dtype=a.dtype, kv_cache=a.kv_cache,
                        tensor_parallel_size=getattr(a, "tensor_parallel_size", 1),
                        expert_parallel=getattr(a, "expert_parallel", False),
                        collective_timeout_s=getattr(a, "collective_timeout", 120.0),
                        quantization=getattr(a, "quantization", None),
                        cuda_graphs=not getattr(a, "enforce_eager", False),
                        batch_invariant=getattr(a, "batch_invariant", True), **prefill_config(a, kw), **kw)


def prefill_config(a: argparse.Namespace, kw: dict) -> dict:
    """EngineConfig fields of the prefix cache, chunked prefill and batched-token flags (vLLM's names)."""
    from celeris.engine.serving import DEFAULT_PREFIX_CACHE_BYTES, EngineConfig, budget_from_gb

    enable, gb = getattr(a, "enable_prefix_caching", None), getattr(a, "prefix_cache_gb", None)
    budget = 0 if enable is False else budget_from_gb(gb) if gb is not None else (
        DEFAULT_PREFIX_CACHE_BYTES if enable else None)
    out: dict = {"prefix_cache_bytes": budget}
    tokens = getattr(a, "max_num_batched_tokens", None)
    if tokens is not None:
        if tokens < 0:
            from celeris.engine.errors import EngineError

            raise EngineError(f"--max-num-batched-tokens {tokens}: at least 1 (0 = no limit)")
        out["max_forward_tokens"] = tokens
    if not getattr(a, "enable_chunked_prefill", True):  # a prompt's whole blocks in one forward
        out.update(chunked_prefill=False, prefill_chunk=kw.get("max_prompt_tokens", EngineConfig.max_prompt_tokens))
    return out
