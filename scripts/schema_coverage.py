"""Structured-output coverage over a local copy of JSONSchemaBench-style schemas (issue 42).

    python scripts/schema_coverage.py /tmp/jsb [--model celeris-tiny] [--max-tokens 512]
        [--limit 0] [--generate 0 --seeds 2 --gen-length 512 --steps 0 --door engine|http]

PATH is a folder of JSON files: one schema a file (its subset: the first folder under PATH, as in
the benchmark's data/<subset>/*.json), or the maskbench layout (files holding {"schema": ...}, the
subset the file name before `---` or its trailing `_<n>`). Nothing is downloaded: the data set has
no license that lets it ship here, so it is read where it is.

Each schema is compiled through Celeris' path chooser (engine/structured/constraint.Compiler) on
the model's tokenizer at --max-tokens, and beside it through llguidance's own JSON-schema compiler
with its defaults (`grammar_from_json_schema` + `validate_grammar`). Printed per subset: schemas,
llguidance's compile %, Celeris accepted %, the share on each path (skeleton / document), and the
most common refusal reasons. --generate N decodes N accepted schemas (stratified over subsets) x
--seeds with the model (embedded name or folder), validates each output with jsonschema (the draft
the schema names, formats checked) and prints validity %, and how many ran out of max_tokens.
`multipleOf` is checked as JSON Schema defines it, in exact decimal arithmetic (jsonschema
divides floats: 4.6 is not a multiple of 0.01 there); outputs only jsonschema's own check rejects
are counted and printed apart. --door http sends the same requests to a server started in this
process (gRPC and HTTP on free ports, scripts/structured_doors.py) through the official openai
SDK: chat completions with `response_format` json_schema strict, max_tokens = --gen-length, 16 at
a time.
"""

from __future__ import annotations

import argparse
import collections
import decimal
import json
import re
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import llguidance

from celeris.engine.errors import InvalidRequest
from celeris.engine.llm import EMBEDDED_MODELS, LLM
from celeris.engine.requests import Request
from celeris.engine.structured.constraint import Compiler, StructureError, Structured


def load(root: Path, limit: int = 0) -> list[tuple[str, str, Any]]:
    """(subset, file name, schema) of every readable JSON file under root; `limit` per subset."""
    out, seen = [], collections.Counter()
    for f in sorted(root.rglob("*.json")):
        try:
            value = json.loads(f.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(value, dict) and "schema" in value and ("meta" in value or "tests" in value):
            subset, value = re.sub(r"_\d+$", "", f.stem.split("---")[0]), value["schema"]
        else:
            subset = f.relative_to(root).parts[0] if len(f.relative_to(root).parts) > 1 else root.name
        if limit and seen[subset] >= limit:
            continue
        seen[subset] += 1
        out.append((subset, f.name, value))
    return out


def llguidance_compiles(ll: llguidance.LLTokenizer, schema: Any) -> bool:
    """llguidance's own verdict with its default options (what its JSON compiler accepts)."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    except (ValueError, TypeError):
        return False
    return not llguidance.LLMatcher.validate_grammar(grammar, ll)


def reason_of(e: StructureError) -> str:
    """A refusal's reason without its quoted specifics, to count alike ones together."""
    text = re.sub(r'"[^"]*"|\'[^\']*\'|\d+', "_", e.reason)
    return text.split(":")[0][:60] if "refuses" not in text else "llguidance: " + text.split(": ", 1)[-1][:50]


def measure(compiler: Compiler, ll: llguidance.LLTokenizer, rows, max_tokens: int) -> list[dict]:
    results, start = [], time.perf_counter()
    for i, (subset, name, schema) in enumerate(rows):
        if i and i % 500 == 0:  # progress on stderr: a full run takes minutes on a few cores
            print(f"  compiled {i}/{len(rows)} in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            path, reason = compiler.compile(Structured("json_schema", schema, "schema"), max_tokens).path, ""
        except StructureError as e:
            path, reason = "", reason_of(e)
        ms = (time.perf_counter() - t0) * 1e3
        results.append(dict(subset=subset, name=name, path=path, reason=reason, ms=ms,
                            llg=llguidance_compiles(ll, schema), schema=schema))
    return results


def report(results: list[dict]) -> None:
    by = collections.defaultdict(list)
    for r in results:
        by[r["subset"]].append(r)
    print(f"{'subset':<16} {'n':>5} {'llguidance%':>11} {'celeris%':>9} {'skeleton%':>9} {'document%':>9}")
    for subset, rs in sorted(by.items()) + [("ALL", results)]:
        n = len(rs)
        pct = lambda k: 100.0 * sum(1 for r in rs if k(r)) / n  # noqa: E731
        print(f"{subset:<16} {n:>5} {pct(lambda r: r['llg']):>11.1f} {pct(lambda r: r['path']):>9.1f} "
              f"{pct(lambda r: r['path'] == 'skeleton'):>9.1f} {pct(lambda r: r['path'] == 'document'):>9.1f}")
    ms = sorted(r["ms"] for r in results)
    print(f"compile ms: median {ms[len(ms) // 2]:.1f}, p99 {ms[int(len(ms) * 0.99)]:.1f}, max {ms[-1]:.1f}")
    print("refusals (first reason):")
    for reason, k in collections.Counter(r["reason"] for r in results if r["reason"]).most_common(12):
        print(f"  {k:>5}  {reason}")


def exact_multiple_of(validator, divisor, instance, schema):
    """`multipleOf` as JSON Schema defines it: the division's result is an integer, in exact
    decimal arithmetic on the numbers as written. jsonschema divides floats, so 4.6 is not a
    multiple of 0.01 there (4.6 / 0.01 = 459.99999999999994)."""
    import jsonschema

    if not validator.is_type(instance, "number"):
        return
    with decimal.localcontext() as ctx:
        ctx.prec = 2000  # exact for any exponents JSON numbers that parse to finite floats have
        try:
            whole = decimal.Decimal(repr(instance)) % decimal.Decimal(repr(divisor)) == 0
        except decimal.InvalidOperation:  # an infinite instance (1e400 parses to inf)
            whole = False
    if not whole:
        yield jsonschema.ValidationError(f"{instance!r} is not a multiple of {divisor!r}")


def validates(schema: Any, text: str, exact: bool = True) -> Optional[str]:
    """None if the text is JSON valid under the schema (its own draft, formats checked), with
    `multipleOf` in exact decimal arithmetic (`exact_multiple_of`), or as jsonschema has it."""
    import jsonschema

    try:
        value = json.loads(text)
        cls = jsonschema.validators.validator_for(schema)
        if exact:
            cls = jsonschema.validators.extend(cls, {"multipleOf": exact_multiple_of})
        cls(schema, format_checker=cls.FORMAT_CHECKER).validate(value)
    except Exception as e:  # noqa: BLE001 (any failure is an invalid output, printed)
        return f"{type(e).__name__}: {str(e)[:100]}"
    return None


def engine_outcomes(llm: LLM, jobs: list, params, batch: int = 16) -> list[tuple[Optional[str], str, Optional[str]]]:
    """(text, finish_reason, error) of each (result, seed) job through the engine's offline API,
    `batch` requests at a time ("refused": not accepted at --gen-length)."""
    out = []
    for k in range(0, len(jobs), batch):
        built = []
        for r, s in jobs[k:k + batch]:
            try:  # accepted at --max-tokens; a shorter --gen-length may not hold its skeleton
                built.append(llm.build(Request(prompt="JSON:", params=replace(params, seed=s),
                                               structured=Structured("json_schema", r["schema"]))))
            except InvalidRequest as e:
                built.append(str(e)[:160])
        ran = iter(llm.run([b for b in built if not isinstance(b, str)]))
        for b in built:
            if isinstance(b, str):
                out.append((None, "refused", b))
            else:
                res = next(ran)
                out.append((res.text, res.finish_reason.value, None if res.error is None else str(res.error)))
    return out


def http_outcomes(llm: LLM, jobs: list, params) -> list[tuple[Optional[str], str, Optional[str]]]:
    """(text, finish_reason, error) of each (result, seed) job through the HTTP door: the
    official openai SDK against a server on this LLM (a 400 is a refusal at --gen-length)."""
    import openai
    from concurrent.futures import ThreadPoolExecutor

    from structured_doors import in_process_server

    with in_process_server(llm) as (_, base_url), openai.OpenAI(base_url=base_url + "/v1", api_key="unused",
                                                                  max_retries=0, timeout=3600) as sdk:
        model = sdk.models.list().data[0].id

        def one(job):
            r, seed = job
            rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": r["schema"], "strict": True}}
            try:
                c = sdk.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "JSON:"}], response_format=rf,
                    max_tokens=params.gen_length, temperature=params.temperature, seed=seed,
                    extra_body={"steps": params.steps, "block_length": params.block_length}).choices[0]
            except openai.BadRequestError as e:
                return None, "refused", str(e)[:160]
            return c.message.content, c.finish_reason, None

        done, good, lock, t0 = [0], [0], threading.Lock(), time.perf_counter()

        def counted(job):  # progress with the running validity, so a run cut short still tells
            out = one(job)
            ok = out[1] != "refused" and validates(job[0]["schema"], out[0] or "") is None
            with lock:
                done[0], good[0] = done[0] + 1, good[0] + ok
                if done[0] % 50 == 0 or done[0] == len(jobs):
                    print(f"  {done[0]}/{len(jobs)} answered, {good[0]} valid, {time.perf_counter() - t0:.0f} s",
                          flush=True)
            return out

        with ThreadPoolExecutor(16) as pool:
            return list(pool.map(counted, jobs))


def generate(llm: LLM, results: list[dict], n: int, seeds: int, gen_length: int, door: str = "engine",
             steps: int = 0) -> None:
    by = collections.defaultdict(list)
    for r in results:
        if r["path"]:
            by[r["subset"]].append(r)
    pool = [rs[i] for i in range(max(map(len, by.values()), default=0)) for rs in by.values() if i < len(rs)][:n]
    jobs = [(r, s) for r in pool for s in range(seeds)]
    valid, length, failed, floats = collections.Counter(), 0, [], []
    steps = steps or gen_length  # fewer: each slot chains several positions a step (families.selection.chained)
    params = replace(llm.defaults, gen_length=gen_length, steps=steps, block_length=32, temperature=1.0)
    t0 = time.perf_counter()
    outcomes = (http_outcomes if door == "http" else engine_outcomes)(llm, jobs, params)
    for (r, s), (text, finish, err) in zip(jobs, outcomes):
        if finish == "refused":
            valid["refused at gen_length", False] += 1
            failed.append((r["subset"], r["name"], s, finish, err))
            continue
        why = f"failed: {err}"[:160] if err else validates(r["schema"], text or "")
        valid[r["path"], why is None] += 1
        if why is None and (float_only := validates(r["schema"], text or "", exact=False)):
            floats.append((r["subset"], r["name"], s, float_only))
        length += finish == "length"
        if why:
            failed.append((r["subset"], r["name"], s, finish, why))
    total = len(jobs)
    ok = sum(v for (_, good), v in valid.items() if good)
    print(f"generated {total} ({len(pool)} schemas x {seeds} seeds, gen_length {gen_length}, steps {steps}, "
          f"door {door}) in "
          f"{time.perf_counter() - t0:.0f} s: valid {ok}/{total} ({100.0 * ok / max(total, 1):.1f}%), "
          f"ran out of max_tokens {length}")
    for path in ("skeleton", "document", "refused at gen_length"):
        good, bad = valid[path, True], valid[path, False]
        print(f"  {path}: {good}/{good + bad} valid")
    for f in failed[:20]:
        print("  invalid:", *f)
    print(f"  of the valid, jsonschema's own (float) multipleOf rejects {len(floats)}")
    for f in floats[:20]:
        print("  float multipleOf only:", *f)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", type=Path)
    ap.add_argument("--model", default="celeris-tiny", help="an embedded model's name or a checkpoint folder")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--limit", type=int, default=0, help="schemas per subset (0: all)")
    ap.add_argument("--generate", type=int, default=0, help="decode this many accepted schemas")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--gen-length", type=int, default=512)
    ap.add_argument("--steps", type=int, default=0, help="denoising steps of each generated request (0: gen-length)")
    ap.add_argument("--door", choices=("engine", "http"), default="engine",
                    help="decode through the engine's offline API or over HTTP with the openai SDK")
    a = ap.parse_args(argv)
    llm = LLM.load(EMBEDDED_MODELS.get(a.model, a.model))
    compiler = Compiler(llm.tokenizer, llm.requests.family_vocab)
    rows = load(a.path, a.limit)
    print(f"{len(rows)} schemas from {a.path}; model {a.model}; max_tokens {a.max_tokens}", flush=True)
    results = measure(compiler, compiler.ll, rows, a.max_tokens)
    report(results)
    if a.generate:
        generate(llm, results, a.generate, a.seeds, a.gen_length, door=a.door, steps=a.steps)


if __name__ == "__main__":
    sys.exit(main())
