"""vLLM's `serve` flags under vLLM's names and meanings, where Celeris has the same thing:
`--max-num-seqs` (= --max-batch), `--dtype auto` (the checkpoint's dtype), `--chat-template`,
`--generation-config`, `--tool-call-parser` / `--reasoning-parser` (and `--enable-auto-tool-choice`,
accepted: auto tool choice is on whenever a parser is known), `--allowed-origins '["*"]'` (vLLM's JSON-list form) and
`--ssl-keyfile/--ssl-certfile` (TLS on both doors), `--max-model-len` (prompt + generated tokens,
mapped onto the prompt and canvas limits) and `--seed` (the seeds of requests that give none are
drawn from a generator seeded with it), `--enforce-eager` (no CUDA graphs), `--gpu-memory-utilization`
(a cap on this process's share of the GPU), `--kv-cache-dtype auto`, `--uvicorn-log-level` (the log
level), and two that ask for what Celeris always does (`--trust-remote-code`: no checkpoint code is
ever run; `--disable-log-requests`: no prompt text is logged). Flags of vLLM's that have no meaning
here are refused by `Refused`, one line saying why and what to use instead. What is left out, and
why, is the "coming from vLLM" table of docs/http.md."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any, Optional, Sequence

from celeris.engine.errors import EngineError

_DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16", "half": "float16"}


def add_vllm_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--max-num-seqs", dest="max_batch", type=int, help="vLLM's name for --max-batch")
    ap.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                    help="a Jinja chat template (a file, or the template itself) instead of the tokenizer's")
    ap.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                    help="sampling defaults: auto = the model's generation_config.json, vllm = the family's own "
                         "defaults, ignoring the file; FOLDER = that folder's generation_config.json")
    ap.add_argument("--ssl-keyfile", default=None, help="TLS private key (PEM) for both doors, with --ssl-certfile")
    ap.add_argument("--ssl-certfile", default=None, help="TLS certificate chain (PEM) for both doors")
    ap.add_argument("--max-model-len", type=int, default=None, metavar="N",
                    help="most prompt + generated tokens of a request: sets --max-gen-length to at most N/2 and "
                         "--max-prompt-tokens to the rest; at most the model's own limit")
    ap.add_argument("--tool-call-parser", default=None, metavar="NAME",
                    help="how tool calls are read from the model's answers (vLLM's names, e.g. hermes; none = off; "
                         "default: detected from the chat template; docs/tools.md)")
    ap.add_argument("--reasoning-parser", default=None, metavar="NAME",
                    help="how a thinking channel is split out as reasoning_content (vLLM's names; none = off; "
                         "default: detected from the chat template)")
    ap.add_argument("--enable-auto-tool-choice", action="store_true",
                    help="accepted for vLLM's command lines: tool_choice \"auto\" is on whenever a tool-call "
                         "parser is known")
    add_vllm_engine_args(ap)
    ap.add_argument("--seed", type=int, default=None,
                    help="requests without a seed get theirs from a generator seeded with this, so a restarted "
                         "server answers the same requests in the same order the same way (default: the OS's)")


# vLLM's log levels (uvicorn's) as Celeris' --log-level choices.
_LOG_LEVELS = {"trace": "debug", "debug": "debug", "info": "info", "warning": "warning", "error": "error",
               "critical": "error"}
# vLLM flags with no meaning in Celeris: the reason, and what to use instead.
REFUSED = {
    "--pipeline-parallel-size": "Celeris splits a model by tensor parallelism only; use --tensor-parallel-size",
    "--swap-space": "Celeris keeps no paged KV blocks to swap to the CPU; bound memory with --max-num-seqs and "
                    "--max-model-len",
    "--block-size": "Celeris keeps no paged KV blocks; a block model's block length is the checkpoint's own",
    "--cpu-offload-gb": "Celeris does not offload weights; use --quantization fp8 or --tensor-parallel-size",
    "--tokenizer": "the tokenizer is the checkpoint folder's own; give a folder that holds the one you want",
}


class Refused(argparse.Action):
    """A vLLM flag Celeris has no use for: exit 2 with one line (the reason and what to use
    instead), never argparse's "unrecognized arguments"."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.exit(2, f"celeris serve: error: {option_string}: {REFUSED[option_string]}\n")


class KvCacheDtype(argparse.Action):
    """`--kv-cache-dtype auto` (the model's dtype, vLLM's default) is what Celeris does; any other
    is refused in one line."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if values != "auto":
            parser.exit(2, f"celeris serve: error: --kv-cache-dtype {values}: the KV cache is kept in the model's "
                           "dtype (--dtype); only auto is served\n")
        setattr(namespace, self.dest, values)


def add_vllm_engine_args(ap: argparse.ArgumentParser) -> None:
    """vLLM's engine flags honoured under their own meaning, or refused with the reason."""
    ap.add_argument("--enforce-eager", action="store_true",
                    help="CUDA: run every step eagerly, no CUDA graphs (vLLM's flag; moot on the CPU)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                    help="CUDA: the most of the GPU's memory this server may allocate, 0-1 (torch's per-process "
                         "cap; Celeris reserves no KV pool, so this is a ceiling, not a reservation; moot on the CPU)")
    ap.add_argument("--kv-cache-dtype", action=KvCacheDtype, default="auto", metavar="auto",
                    help="auto only: the KV cache is kept in the model's dtype")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="accepted for vLLM's command lines: Celeris runs no code from a checkpoint (its own "
                         "implementation of each architecture it knows loads the weights)")
    ap.add_argument("--uvicorn-log-level", choices=tuple(_LOG_LEVELS), default=None,
                    help="vLLM's name for the log level: sets --log-level (trace = debug, critical = error)")
    ap.add_argument("--disable-log-requests", action="store_true",
                    help="accepted for vLLM's command lines: request log lines never carry prompt text unless "
                         "--log-prompts asks (the two conflict)")
    for flag, why in REFUSED.items():
        ap.add_argument(flag, action=Refused, metavar="VALUE", help=f"refused: {why}")


def log_level(a: argparse.Namespace) -> str:
    """--log-level, else --uvicorn-log-level's, else info."""
    if a.log_level is None and a.uvicorn_log_level is not None:
        return _LOG_LEVELS[a.uvicorn_log_level]
    return a.log_level or "info"


def check_engine_flags(a: argparse.Namespace) -> None:
    """The vLLM engine flags that can be wrong together or out of range, before the model loads;
    and --gpu-memory-utilization's cap, set before the first allocation on the device."""
    if a.disable_log_requests and a.log_prompts:
        raise EngineError("--disable-log-requests and --log-prompts (--enable-log-requests) conflict: give one")
    f = a.gpu_memory_utilization
    if f is None:
        return
    if not 0 < f <= 1:
        raise EngineError(f"--gpu-memory-utilization {f}: a fraction of the GPU's memory, above 0 and at most 1")
    if str(a.device).startswith("cuda"):
        if getattr(a, "tensor_parallel_size", 1) > 1:
            raise EngineError("--gpu-memory-utilization with --tensor-parallel-size above 1: not yet (the cap is "
                              "per process, and the workers are other processes); leave it out")
        import torch

        torch.cuda.set_per_process_memory_fraction(f, torch.device(a.device))


def apply_model_len(a: argparse.Namespace) -> None:
    """--max-model-len N as the prompt and canvas limits (in place, before the engine config is
    built): the canvas keeps --max-gen-length up to N // 2, the prompt gets the rest, so the
    limits' sum, what /v1/models reports as max_model_len, is N."""
    n = getattr(a, "max_model_len", None)
    if n is None:
        return
    if n < 2:
        raise EngineError(f"--max-model-len {n}: at least 2 (one prompt token and one generated)")
    a.max_gen_length = min(a.max_gen_length, n // 2)
    a.max_prompt_tokens = n - a.max_gen_length


def check_model_len(llm: Any, a: argparse.Namespace) -> None:
    """--max-model-len past the model's own limit (its config's max_position_embeddings) is a
    start-up error, as in vLLM."""
    n, own = getattr(a, "max_model_len", None), getattr(llm.model_config, "max_sequence_length", None)
    if n is not None and own is not None and n > own:
        raise EngineError(f"--max-model-len {n} is more than {llm.name}'s own limit of {own} tokens "
                          f"(max_position_embeddings in its config.json); give at most {own}")


def origins(given: Optional[Sequence[str]]) -> tuple[str, ...]:
    """--allowed-origins as Celeris takes it (several words) or as vLLM does (one JSON list,
    `'["*"]'`): a word that parses as a JSON list of strings stands for its items."""
    out: list[str] = []
    for word in given or ():
        if word.lstrip().startswith("["):
            try:
                items = json.loads(word)
            except ValueError:
                raise EngineError(f"--allowed-origins {word!r}: not a JSON list of origins") from None
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise EngineError(f"--allowed-origins {word!r}: not a JSON list of origins")
            out += items
        else:
            out.append(word)
    return tuple(dict.fromkeys(out))


def checkpoint_dtype(folder: Path) -> str:
    """The dtype a checkpoint's config.json names (`torch_dtype`, or `dtype` in newer
    transformers), float32 when it names none or one Celeris cannot run."""
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    name = str(raw.get("torch_dtype") or raw.get("dtype") or "float32").removeprefix("torch.")
    return _DTYPES.get(name, "float32")


def resolve_dtype(a: argparse.Namespace, path: Optional[str]) -> None:
    """`--dtype auto` becomes the checkpoint's dtype (in place, before the engine config is built)."""
    if getattr(a, "dtype", None) == "auto":
        from celeris.engine.serving import model_folder

        a.dtype = checkpoint_dtype(model_folder(path))


def tls_files(a: argparse.Namespace) -> Optional[tuple[bytes, bytes]]:
    """(key, certificate chain) PEM bytes, or None for plaintext; both or neither."""
    if (a.ssl_keyfile is None) != (a.ssl_certfile is None):
        raise EngineError("--ssl-keyfile and --ssl-certfile go together")
    if a.ssl_keyfile is None:
        return None
    try:
        return Path(a.ssl_keyfile).read_bytes(), Path(a.ssl_certfile).read_bytes()
    except OSError as e:
        raise EngineError(f"TLS: cannot read {e.filename}: {e.strerror}") from None


def apply_to_model(llm: Any, a: argparse.Namespace) -> None:
    """--max-model-len's check, --seed, --chat-template and --generation-config on a loaded model."""
    check_model_len(llm, a)
    if getattr(a, "seed", None) is not None:
        llm.requests.seeds = random.Random(a.seed)
    if a.chat_template is not None:
        path = Path(a.chat_template)
        llm.tokenizer.chat_template = path.read_text() if path.is_file() else a.chat_template
    if a.generation_config == "vllm":
        llm.requests.defaults = llm.family.base_params().validate()
    elif a.generation_config != "auto":
        from celeris.engine.serving import model_defaults

        folder = Path(a.generation_config)
        if not (folder / "generation_config.json").is_file():
            raise EngineError(f"--generation-config {folder}: no generation_config.json there")
        llm.requests.defaults = model_defaults(folder, llm.model_config)
