"""Structured outputs: validity over 20 schemas and 10 regexes/choices x seeds x models, and the
throughput cost of the constraint at concurrency 16, side by side in one run.

    PYTHONPATH=. python scripts/bench_structured.py [--seeds 5] [--models celeris-tiny,celeris-tiny-block,bigvocab]
                                                    [--throughput-model celeris-tiny] [--repeats 3]

Validity: every output must parse (json.loads) and validate (jsonschema), or fullmatch its
regex / equal one of its choices. Requests go through the engine in batches of up to 16 (the
doors are covered by tests/integration/test_structured_outputs.py). `bigvocab` is a random
model with LLaDA-8B's vocabulary size (126,464: celeris-tiny's tokenizer extended with
synthetic byte-level tokens, so masks cover a real-size vocabulary) and tiny layers.
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
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import jsonschema
import torch

from celeris.engine.config import EngineConfig
from celeris.engine.llm import EMBEDDED_MODELS, LLM
from celeris.engine.requests import Request
from celeris.engine.structured.constraint import Structured

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


def big_vocab_model(folder: Path, vocab: int = 126_464) -> Path:
    """A random model with LLaDA-8B's vocabulary size and tiny layers (see the module doc)."""
    from celeris.engine.config import ModelConfig
    from celeris.engine.weights import save_model
    from celeris.engine.model import MaskPredictor
    src = EMBEDDED_MODELS["celeris-tiny"]
    tok = json.loads((src / "tokenizer.json").read_text())
    words = tok["model"]["vocab"]
    alphabet = [c for c in map(chr, range(33, 127)) if c not in "\"\\"] + ["Ġ"]
    i = 0
    while len(words) < vocab:  # synthetic 3-character byte-level tokens, never merged into by encode
        t = alphabet[i % 93] + alphabet[(i // 93) % 93] + alphabet[(i // 93 // 93) % 93]
        words.setdefault(t, len(words))
        i += 1
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    (folder / "tokenizer_config.json").write_text((src / "tokenizer_config.json").read_text())
    cfg = json.loads((src / "config.json").read_text()) | {"vocab_size": vocab, "embedding_size": vocab,
                                                          "n_layers": 1, "name": "bigvocab-random"}
    mc = ModelConfig.from_json(cfg) if hasattr(ModelConfig, "from_json") else ModelConfig(**cfg)
    torch.manual_seed(0)
    save_model(MaskPredictor(mc).eval(), folder)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def load(name: str, tmp: Path) -> LLM:
    folder = big_vocab_model(tmp / "bigvocab") if name == "bigvocab" else EMBEDDED_MODELS[name]
    return LLM.load(folder, EngineConfig(max_batch=16, max_queue=64))


def check(kind: str, value, text: str) -> bool:
    try:
        if kind == "json_schema":
            jsonschema.validate(json.loads(text), value)
            return True
        return re.fullmatch(value, text) is not None if kind == "regex" else text in value
    except (ValueError, jsonschema.ValidationError):
        return False


def validity(llm: LLM, seeds: int) -> tuple[int, int, int, int, list[str]]:
    jobs = [("json_schema", s) for s in SCHEMAS] + REGEXES
    base = replace(llm.defaults, gen_length=128, steps=128, block_length=32, temperature=1.0)
    reqs = [(kind, value, Request(prompt="Answer:", params=replace(base, seed=seed),
                                  structured=Structured(kind, value))) for kind, value in jobs for seed in range(seeds)]
    ok_s = ok_r = 0
    bad: list[str] = []
    for i in range(0, len(reqs), 16):
        chunk = reqs[i:i + 16]
        for (kind, value, _), r in zip(chunk, llm.run([llm.build(q) for _, _, q in chunk])):
            good = check(kind, value, r.text)
            if kind == "json_schema":
                ok_s += good
            else:
                ok_r += good
            if not good:
                bad.append(f"{kind} {str(value)[:60]}: {r.text!r}")
    return ok_s, len(SCHEMAS) * seeds, ok_r, len(REGEXES) * seeds, bad


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--models", default="celeris-tiny,celeris-tiny-block,bigvocab")
    ap.add_argument("--throughput-model", default="celeris-tiny")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--length", type=int, default=64, help="gen_length of the throughput runs")
    a = ap.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        for name in filter(None, a.models.split(",")):
            llm = load(name, Path(tmp))
            t0 = time.perf_counter()
            ok_s, n_s, ok_r, n_r, bad = validity(llm, a.seeds)
            print(f"{name}: schemas {ok_s}/{n_s} valid, regex/choice {ok_r}/{n_r} valid "
                  f"({a.seeds} seeds, {time.perf_counter() - t0:.0f} s)", flush=True)
            for line in bad[:10]:
                print("  INVALID", line)
        if a.repeats:
            llm = load(a.throughput_model, Path(tmp))
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


if __name__ == "__main__":
    main()
