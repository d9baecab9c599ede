"""Structured outputs: validity over 20 schemas and 10 regexes/choices x seeds x models x doors, and
the throughput cost of the constraint at concurrency 16, side by side in one run.

    python scripts/bench_structured.py [--seeds 5] [--models celeris-tiny,celeris-tiny-block,llada-vocab]
                                       [--door engine|grpc|http|all] [--throughput-model celeris-tiny]
                                       [--repeats 3]   (--repeats 0: validity only)
    python scripts/bench_structured.py --serving [--models celeris-tiny,celeris-tiny-block]
    python scripts/bench_structured.py --pace --models celeris-tiny,celeris-tiny-block --length 128

Validity: every output must parse (json.loads) and validate (jsonschema), or fullmatch its
regex / equal one of its choices. The same requests (prompt "Answer:", temperature 1, seeds
0..seeds-1, gen_length 128, steps 128, block 32) go through each door of --door (default all):
`engine`, the engine's offline API in batches of 16; `grpc`, the Python client; `http`, the
official openai SDK (schemas: chat + response_format json_schema strict; regexes/choices:
completions + vLLM's structured_outputs); gRPC and HTTP 16 at a time against one server started
in this process on free ports (scripts/structured_doors.py). One row per model x door. `llada-vocab`
is a random model with LLaDA-8B's vocabulary and tokenizer shape and small layers, built into a
temporary folder and loaded (and served) from it (`LLADA` below says exactly what is and is not
LLaDA-8B's).
Throughput: output tokens/s = generated tokens that are not special (EOS, pad fillers) / wall
time, and wall time per step, 16 requests submitted at once (max_batch 16), interleaved, median
of `repeats` each, for three workloads: `free` (unconstrained, ignore_eos: every position is
decoded, one token a step), `matched` (a regex of exactly gen_length printable characters: one
slot over the whole canvas, one token a row a step, the same forwards as `free`; this isolates
what the masks cost), and `schemas` (the schemas that fit the canvas, cycled: the skeleton is
free and slots fill in parallel, so fewer steps).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import jsonschema
import torch

from celeris.engine.config import EngineConfig
from celeris.engine.llm import EMBEDDED_MODELS, LLM
from celeris.engine.requests import Request
from celeris.engine.structured.constraint import Structured
from celeris.server.telemetry import configure_logging

from structured_doors import BLOCK, CONCURRENCY, DOORS, GEN_LENGTH, STEPS, TEMPERATURE, Job, Outcome, through_doors

S, I, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def obj(**props) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


SCHEMAS = [
    obj(name=S | {"maxLength": 12}),
    obj(age=I | {"minimum": 0, "maximum": 120}),
    obj(ok=B, n=I | {"minimum": -5, "maximum": 5}),
    obj(x=N | {"minimum": -1.5, "maximum": 9}, y=N | {"minimum": 0, "maximum": 1}),
    obj(color={"enum": ["red", "green", "blue"]}),
    obj(tags={"type": "array", "items": S | {"maxLength": 6}, "maxItems": 3}),
    obj(ids={"type": "array", "items": I | {"minimum": 1, "maximum": 999}, "minItems": 1, "maxItems": 4}),
    obj(zip=S | {"pattern": "^[0-9]{5}$"}, state=S | {"pattern": "^[A-Z]{2}$"}),
    obj(user=obj(name=S | {"maxLength": 8}, admin=B)),
    obj(a=obj(b=obj(c=obj(d=I | {"minimum": 0, "maximum": 9})))),
    obj(title=S | {"maxLength": 20, "minLength": 3}, year=I | {"minimum": 1900, "maximum": 2030}),
    obj(v={"const": "v1"}, n={"type": "null"}),
    obj(flags={"type": "array", "items": B, "maxItems": 5}),
    obj(level={"enum": [1, 2, 3, None, "max"]}, note=S | {"maxLength": 4}),
    obj(lat=N | {"minimum": -90, "maximum": 90}, lon=N | {"minimum": -180, "maximum": 180}),
    obj(sku=S | {"pattern": "^[A-Z]{3}-[0-9]{4}$"}, qty=I | {"minimum": 1, "maximum": 50}, price=N | {"minimum": 0, "maximum": 999}),
    obj(p=obj(x=I | {"minimum": 0, "maximum": 99}, y=I | {"minimum": 0, "maximum": 99}),
        q=obj(x=I | {"minimum": 0, "maximum": 99}, y=I | {"minimum": 0, "maximum": 99})),
    obj(words={"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "maxItems": 3}, count=I | {"minimum": 0, "maximum": 3}),
    obj(email=S | {"pattern": "^[a-z]{1,8}@[a-z]{2,6}\\.(com|org)$"}, verified=B),
    {"type": "object", "properties": {"k": S | {"maxLength": 5}, "m": obj(n=N | {"minimum": -1, "maximum": 1}, t=S | {"maxLength": 3})},
     "required": ["k", "m"]},
]
REGEXES = [("regex", r"[0-9]{3}-[0-9]{4}"), ("regex", r"[a-z]{1,8}@[a-z]{2,6}\.(com|org)"),
           ("regex", r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"), ("regex", r"(yes|no), because [a-z ]{1,20}\."),
           ("regex", r"#[0-9a-f]{6}"), ("regex", r"[A-Z][a-z]{1,10} [A-Z][a-z]{1,10}"),
           ("choice", ["yes", "no"]), ("choice", ["positive", "negative", "neutral"]),
           ("choice", ["not sure", "a/b", "x-y [z]"]), ("choice", ["Paris", "London", "Rome", "Berlin"])]


# LLaDA-8B-Instruct's shape where it touches structured outputs (its config.json and tokenizer):
# vocabulary and embedding size, special tokens at its ids (BOS <|startoftext|> 126080, EOS
# <|endoftext|> 126081, mask <|mdm_mask|> 126336, <|eot_id|> 126348, the rest of 126080-126463
# reserved special tokens), no pad token of its own (pad = EOS, so a JSON slot's filler is the
# space token), byte-level BPE, RoPE theta 500,000, 32 heads, MLP 3x d_model. Not its size:
# d_model 256 (not 4,096) and 2 layers (not 32), so a step runs on 2 CPU cores.
LLADA = {"vocab": 126_464, "bos": (126_080, "<|startoftext|>"), "eos": (126_081, "<|endoftext|>"),
         "mask": (126_336, "<|mdm_mask|>"), "eot": (126_348, "<|eot_id|>"),
         "header": ((126_346, "<|start_header_id|>"), (126_347, "<|end_header_id|>"))}
LLADA_TEMPLATE = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}"
                  "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>"
                  "\n\n{% endif %}")


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: the 256 characters that stand for the 256 bytes."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def llada_vocab_tokenizer(folder: Path) -> None:
    """celeris-tiny's BPE (its merges and normal tokens) renumbered from 0, synthetic byte-level
    tokens of 2 and 3 bytes (any byte: quotes, backslashes, control bytes, partial UTF-8, as real
    vocabularies have; reachable by decode, never produced by encode) up to id 126,079, and
    LLaDA's special tokens and reserved ones at 126,080-126,463."""
    import random
    src = EMBEDDED_MODELS["celeris-tiny"]
    tok = json.loads((src / "tokenizer.json").read_text())
    specials = {t["content"] for t in tok["added_tokens"]}
    normal = [t for t, _ in sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1]) if t not in specials]
    vocab = {t: i for i, t in enumerate(normal)}
    alphabet, rng = _byte_alphabet(), random.Random(0)
    while len(vocab) < LLADA["bos"][0]:
        t = "".join(rng.choice(alphabet) for _ in range(rng.choice((2, 3))))
        vocab.setdefault(t, len(vocab))
    named = {i: c for i, c in (LLADA["bos"], LLADA["eos"], LLADA["mask"], LLADA["eot"], *LLADA["header"])}
    added = []
    for i in range(LLADA["bos"][0], LLADA["vocab"]):
        content = named.get(i, f"<|reserved_token_{i}|>")
        vocab[content] = i
        added.append({"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": False, "special": True})
    tok["model"]["vocab"], tok["added_tokens"] = vocab, added
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": LLADA["bos"][1], "eos_token": LLADA["eos"][1], "pad_token": LLADA["eos"][1],
        "mask_token": LLADA["mask"][1], "add_bos_token": True, "chat_template": LLADA_TEMPLATE}))


def llada_vocab_model(folder: Path) -> Path:
    """A random model with LLaDA-8B's vocabulary and tokenizer shape and small layers (LLADA)."""
    from celeris.engine.families.checkpoint import parse_config, save_model
    from celeris.engine.models.transformer import MaskPredictor
    folder.mkdir(parents=True, exist_ok=True)
    llada_vocab_tokenizer(folder)
    cfg = json.loads((EMBEDDED_MODELS["celeris-tiny"] / "config.json").read_text()) | {
        "vocab_size": LLADA["vocab"], "embedding_size": LLADA["vocab"], "mask_token_id": LLADA["mask"][0],
        "eos_token_id": LLADA["eos"][0], "rope_theta": 500000.0, "d_model": 256, "n_heads": 32, "n_kv_heads": 32,
        "mlp_hidden_size": 768, "n_layers": 2, "max_sequence_length": 4096, "name": "llada-vocab-random"}
    torch.manual_seed(0)
    save_model(MaskPredictor(parse_config(cfg)).eval(), folder)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def model_dir(name: str, tmp: Path) -> Path:
    """An embedded model's folder, or llada-vocab's, built under tmp the first time."""
    if name != "llada-vocab":
        return EMBEDDED_MODELS[name]
    return tmp / name if (tmp / name / "config.json").exists() else llada_vocab_model(tmp / name)


def load(name: str, tmp: Path) -> LLM:
    return LLM.load(model_dir(name, tmp), EngineConfig(max_batch=16, max_queue=64))


def check(kind: str, value, text: str) -> bool:
    try:
        if kind == "json_schema":
            jsonschema.validate(json.loads(text), value)
            return True
        return re.fullmatch(value, text) is not None if kind == "regex" else text in value
    except (ValueError, jsonschema.ValidationError):
        return False


def sweep_jobs(seeds: int) -> list[Job]:
    """Every schema and regex/choice, each with seeds 0..seeds-1."""
    return [(kind, value, seed) for kind, value in [("json_schema", s) for s in SCHEMAS] + REGEXES
            for seed in range(seeds)]


def tally(jobs: list[Job], outcomes: list[Outcome]) -> tuple[int, int, int, int, list[str]]:
    """(valid schema outputs, schema jobs, valid regex/choice outputs, regex/choice jobs, what failed)."""
    ok = {True: 0, False: 0}
    bad: list[str] = []
    for (kind, value, seed), out in zip(jobs, outcomes, strict=True):
        good = isinstance(out, str) and check(kind, value, out)
        ok[kind == "json_schema"] += good
        if not good:
            what = f"{type(out).__name__}: {out}" if isinstance(out, Exception) else repr(out)
            bad.append(f"{kind} {str(value)[:60]} seed {seed}: {what[:300]}")
    n_s = sum(kind == "json_schema" for kind, _, _ in jobs)
    return ok[True], n_s, ok[False], len(jobs) - n_s, bad


def validity(a: argparse.Namespace, tmp: Path) -> None:
    """The sweep through each door asked, per model: one table row per model x door."""
    doors = list(DOORS) if a.door == "all" else [a.door]
    jobs = sweep_jobs(a.seeds)
    configure_logging(level="WARNING", stream=sys.stderr)  # the server's warnings, not a line per request
    print(f"validity: {len(SCHEMAS)} schemas, {len(REGEXES)} regexes/choices, seeds 0-{a.seeds - 1}, "
          f"gen_length {GEN_LENGTH}, steps {STEPS}, block {BLOCK}, temperature {TEMPERATURE:g}, "
          f"{CONCURRENCY} at a time", flush=True)
    print(f"  {'model':20s} {'door':6s} {'schemas':>9s} {'regex/choice':>12s} {'seeds':>5s} {'seconds':>8s}",
          flush=True)
    for name in filter(None, a.models.split(",")):
        for door, outcomes, seconds in through_doors(partial(load, name, tmp), doors, jobs):
            ok_s, n_s, ok_r, n_r, bad = tally(jobs, outcomes)
            print(f"  {name:20s} {door:6s} {f'{ok_s}/{n_s}':>9s} {f'{ok_r}/{n_r}':>12s} {a.seeds:5d} {seconds:8.0f}",
                  flush=True)
            for line in bad[:10]:
                print("    INVALID", line, flush=True)


def fitting(llm: LLM, G: int) -> list[dict]:
    """The schemas whose layout fits a canvas of G tokens."""
    p = replace(llm.defaults, gen_length=G, steps=G, block_length=32)
    out = []
    for s in SCHEMAS:
        try:
            llm.build(Request(prompt="x", params=p, structured=Structured("json_schema", s)))
            out.append(s)
        except Exception:
            pass
    return out


def spec(workload: str, i: int, G: int, schemas: list[dict]):
    """The i-th request's constraint: None (free text), a schema (cycled), or `matched`: one
    regex slot over the whole canvas, so rows commit one token a step like the free rows."""
    if workload == "free":
        return None
    if workload == "schemas":
        return Structured("json_schema", schemas[i % len(schemas)])
    return Structured("regex", f"[ -~]{{{G}}}")


def tokens_per_s(llm: LLM, workload: str, G: int, schemas: list[dict]) -> tuple[float, float]:
    """(output tokens/s, seconds per step) of 16 requests run together."""
    base = replace(llm.defaults, gen_length=G, steps=G, block_length=32, temperature=1.0,
                   ignore_eos=workload == "free")
    reqs = [Request(prompt="Answer:", params=replace(base, seed=i), structured=spec(workload, i, G, schemas))
            for i in range(16)]
    seqs = [llm.build(q) for q in reqs]
    steps0 = llm.loop.steps
    t0 = time.perf_counter()
    results = llm.run(seqs)
    wall = time.perf_counter() - t0
    special = llm.tokenizer.special_ids
    return (sum(sum(1 for t in r.token_ids if t not in special) for r in results) / wall,
            wall / max(1, llm.loop.steps - steps0))


SERVING_WORKLOADS = ("free", "schema", "matched")


def serving_specs(workload: str, n: int, G: int, schemas: list[dict], a: argparse.Namespace) -> list[dict]:
    """The serving benchmark's requests (bench_serving.request_specs: threshold decoding, steps =
    gen_length, block 32, its prompts) and, but for `free`, a structured_output on each:
    `schema` cycles the schemas that fit G tokens, `matched` is one regex slot of exactly G
    printable characters (so both constrained and free rows decode the whole canvas)."""
    from bench_serving import params_for, request_specs
    from benchmark import TEXT_PROMPTS
    specs = request_specs((TEXT_PROMPTS * (n // len(TEXT_PROMPTS) + 1))[:n], params_for(G, a))
    for i, sp in enumerate(specs):
        if workload == "schema":
            sp["structured_output"] = {"json_schema": schemas[i % len(schemas)]}
        elif workload == "matched":
            sp["structured_output"] = {"regex": f"[ -~]{{{G}}}"}
    return specs


# Schemas only the whole-document path serves (unbounded strings and arrays, optional keys, $ref, anyOf).
DOCUMENTS = [
    {"type": "object", "required": ["name", "n"], "properties": {
        "name": {"type": "string"}, "n": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}}},
    {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "required": ["v"], "properties": {
        "v": {"type": "integer", "minimum": 0, "maximum": 99},
        "kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/node"}}}}}},
    {"type": "array", "items": {"type": "object", "required": ["k", "on"], "additionalProperties": False,
                                "properties": {"k": {"type": "string"}, "on": {"type": "boolean"}}}},
    {"type": "object", "required": ["x"], "properties": {"x": {"anyOf": [
        {"type": "integer", "minimum": 10}, {"type": "string", "enum": ["none", "some"]}]}}},
]


def pace(a: argparse.Namespace, tmp: Path) -> None:
    """Whole-document requests at fewer steps than tokens (families.selection.chained), beside free ones:
    per model and `steps` (G, G/4, G/8 for G = --length), 8 document requests (the DOCUMENTS
    cycled, seeds 0-7) and 8 free ones (ignore_eos: all G tokens) in one batch, temperature 1, one
    block of G (full canvas) or block 32: median steps a request of each, the ratio, validity,
    the batch's wall time."""
    G = a.length
    print(f"pace: gen_length {G}, temperature 1, 8 document + 8 free requests a batch, CPU float32")
    for name in filter(None, a.models.split(",")):
        llm = load(name, tmp)
        block = G if name == "celeris-tiny" else 32
        for steps in (G, G // 4, G // 8):
            p = replace(llm.defaults, gen_length=G, steps=steps, block_length=block, temperature=1.0)
            docs = [llm.build(Request(prompt="JSON:", params=replace(p, seed=i),
                                      structured=Structured("json_schema", DOCUMENTS[i % len(DOCUMENTS)])))
                    for i in range(8)]
            free = [llm.build(Request(prompt="Once upon a time", params=replace(p, seed=100 + i, ignore_eos=True)))
                    for i in range(8)]  # the whole canvas, as the serving benchmark's free rows
            t0 = time.perf_counter()
            outs = llm.run(docs + free)
            wall = time.perf_counter() - t0
            ok = sum(check("json_schema", DOCUMENTS[i % len(DOCUMENTS)], o.text) for i, o in enumerate(outs[:8]))
            d, f = statistics.median(s.nfe for s in docs), statistics.median(s.nfe for s in free)
            print(f"  {name:18s} steps {steps:4d}: document {d:6.1f} steps, free {f:6.1f} ({d / f:.2f}x), "
                  f"valid {ok}/8, {wall:.1f} s", flush=True)


def serving(a: argparse.Namespace, tmp: Path) -> None:
    """`celeris serve` in its own process and the clients in another (bench_serving's), per model:
    concurrency 16, the workloads interleaved in each repeat, medians of --repeats, and each
    constrained workload's ratio to `free` (of the medians, and the median of per-repeat ratios)."""
    from bench_serving import cell
    from serving_process import ClientProcess, ServeProcess
    a.block_length, a.threshold = 32, 0.9
    n, G = a.requests, a.length
    for name in filter(None, a.models.split(",")):
        llm = load(name, tmp)
        folder = model_dir(name, tmp)
        schemas = fitting(llm, G)
        special = tuple(sorted(llm.tokenizer.special_ids))  # pad fillers, stop ids: not counted as text
        specs = {w: serving_specs(w, n, G, schemas, a) for w in SERVING_WORKLOADS}
        runs: dict[str, list] = {w: [] for w in SERVING_WORKLOADS}
        with ServeProcess(folder, a.threads, 16, a.kv_cache, tmp / f"{name}.log", max_gen_length=G) as server, \
                ClientProcess() as client:
            for w in SERVING_WORKLOADS:  # warm-up: first calls pay allocation and compilation
                client.run({"target": server.target, "concurrency": 4, "mode": a.stream_mode, "requests": specs[w][:4]})
            for rep in range(a.repeats):
                for w in SERVING_WORKLOADS:
                    runs[w].append(cell(server, client, a.stream_mode, 16, specs[w], 1.0, special))
                    if runs[w][-1]["failed"]:
                        raise SystemExit(f"{name} {w}: {runs[w][-1]['failed']} failed: {runs[w][-1]['errors']}")
                print(f"  {name} repeat {rep + 1}/{a.repeats}: " + ", ".join(
                    f"{w} {runs[w][-1]['text_tokens_per_s']:.1f}" for w in SERVING_WORKLOADS) + " text tok/s", flush=True)
        print(serving_table(name, runs, schemas, a))


def serving_table(name: str, runs: dict[str, list], schemas: list[dict], a: argparse.Namespace) -> str:
    keys = ("tokens_per_s", "text_tokens_per_s", "requests_per_s", "forward_ms")
    med = {w: {k: statistics.median(r[k] for r in rs) for k in keys} for w, rs in runs.items()}
    steps = {w: statistics.median(r["steps"] for r in rs) for w, rs in runs.items()}
    lines = [f"serving {name}: celeris serve, concurrency 16, {a.requests} requests a run, gen_length {a.length}, "
             f"steps {a.length}, block 32, threshold 0.9, kv_cache {a.kv_cache}, stream mode {a.stream_mode}, "
             f"{a.threads} threads, CPU float32, medians of {a.repeats} interleaved runs "
             f"(schema: {len(schemas)} schemas cycled)",
             f"  {'workload':8s} {'usage tok/s':>11s} {'text tok/s':>10s} {'ratio':>6s} {'paired':>6s} {'req/s':>6s} "
             f"{'ms/step':>7s} {'ratio':>6s} {'steps':>6s}  text tok/s per run"]
    for w, m in med.items():
        paired = statistics.median(r["text_tokens_per_s"] / f["text_tokens_per_s"] for r, f in zip(runs[w], runs["free"]))
        lines.append(f"  {w:8s} {m['tokens_per_s']:11.1f} {m['text_tokens_per_s']:10.1f} "
                     f"{m['text_tokens_per_s'] / med['free']['text_tokens_per_s']:6.3f} {paired:6.3f} "
                     f"{m['requests_per_s']:6.2f} {m['forward_ms']:7.1f} {m['forward_ms'] / med['free']['forward_ms']:6.3f} "
                     f"{steps[w]:6.0f}  {[round(r['text_tokens_per_s'], 1) for r in runs[w]]}")
    return "\n".join(lines)


def throughput(a: argparse.Namespace, tmp: Path) -> None:
    """The engine's tokens/s and step time, free vs constrained, 16 requests together (tokens_per_s)."""
    llm = load(a.throughput_model, tmp)
    schemas = fitting(llm, a.length)
    runs: dict[str, list] = {"free": [], "matched": [], "schemas": []}
    for w in runs:
        tokens_per_s(llm, w, a.length, schemas)  # warm-up
    for _ in range(a.repeats):  # interleaved, so drift in machine load hits every workload
        for w in runs:
            runs[w].append(tokens_per_s(llm, w, a.length, schemas))
    med = {w: (statistics.median(x[0] for x in r), statistics.median(x[1] for x in r)) for w, r in runs.items()}
    print(f"throughput {a.throughput_model}, 16 concurrent, gen_length {a.length}, steps {a.length}, block 32, "
          f"temperature 1, CPU float32, medians of {a.repeats}:")
    for w, (tps, sps) in med.items():
        print(f"  {w:8s} {tps:8.1f} tok/s ({tps / med['free'][0]:.3f} of free)  {sps * 1e3:7.1f} ms/step "
              f"({sps / med['free'][1]:.3f} of free)  runs {[round(x[0], 1) for x in runs[w]]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--models", default="celeris-tiny,celeris-tiny-block,llada-vocab")
    ap.add_argument("--door", default="all", choices=(*DOORS, "all"),
                    help="validity: the engine's offline API, gRPC (celeris_client), HTTP (openai SDK), or all three")
    ap.add_argument("--throughput-model", default="celeris-tiny")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--length", type=int, default=64, help="gen_length of the throughput runs")
    ap.add_argument("--serving", action="store_true",
                    help="only the serving cost: `celeris serve` per model in --models, concurrency 16, "
                         "free vs constrained side by side (see serving())")
    ap.add_argument("--pace", action="store_true",
                    help="only the document path's steps at fewer steps than tokens, beside free requests (pace())")
    ap.add_argument("--requests", type=int, default=32, help="--serving: requests a run")
    ap.add_argument("--threads", type=int, default=2, help="--serving: the server's torch threads")
    ap.add_argument("--kv-cache", default="dual", choices=("none", "prefix", "dual"))
    ap.add_argument("--stream-mode", default="full", help="--serving: stream mode (full: the last message's "
                                                          "tokens give the text-bearing count)")
    a = ap.parse_args()
    torch.set_num_threads(2)
    if a.serving or a.pace:
        with tempfile.TemporaryDirectory() as tmp:
            (serving if a.serving else pace)(a, Path(tmp))
        return
    with tempfile.TemporaryDirectory() as tmp:  # not under inference_mode: a served LLM's tensors must be normal
        validity(a, Path(tmp))
        if a.repeats:
            throughput(a, Path(tmp))


if __name__ == "__main__":
    main()
