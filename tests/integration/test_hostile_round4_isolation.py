"""Hostile clients, round four (issue 40, item 1): one request never breaks another's.

Each bad shape the issue saw (regexes and schema patterns whose language is empty within what a
slot may hold) and a row whose logits turn NaN are sent beside 12 running requests of other
clients, on both runners (celeris-tiny: full canvas; celeris-tiny-block: block diffusion) and
through both doors (gRPC; HTTP /v1/completions). The 12 complete with exactly the output of a
round without the bad ones; each bad one gets 400 / INVALID_ARGUMENT naming its own field (the
NaN row: its own error), and no error text holds another request's input. Twice: as served
(empty languages refused at compile) and with the compile-time check switched off, so the same
shapes reach the batched step and must fail there alone. Behavioural only: no clock bounds.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
from typing import Callable, Optional

import grpc
import pytest

from celeris.engine.llm import EMBEDDED_MODELS, LLM
from celeris.engine.structured import constraint
from celeris.v1 import generation_pb2 as pb
from celeris.v1 import generation_pb2_grpc as pb_grpc
from tests.integration.live_server import LiveServer, live_server

pytestmark = pytest.mark.slow

GOOD = 12
NAN_SEED = 987_654_321  # the poisoned selection below writes NaN into this request's logits
SECRET = "victim-secret-"  # every good prompt holds it: no error text may


def _string(pattern: str) -> dict:
    return {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}}


# (kind, value): regex, or a JSON schema whose slot at properties.a is empty within printable ASCII
BAD = [("regex", r"[^\s\S]"), ("regex", r"[^\x00-\x7f]{1,5}"), ("json", _string('"')), ("json", _string("\\\\")),
       ("json", _string("^[À-ÿ]{1,20}$"))]


@pytest.fixture(scope="module", params=["celeris-tiny", "celeris-tiny-block"])
def served(request):
    llm = LLM.load(EMBEDDED_MODELS[request.param])
    with live_server(llm) as live:
        yield request.param, llm, live


@pytest.fixture
def nan_row(served, monkeypatch):
    """The runner's selection, with NaN in the logits of the row whose seed is NAN_SEED (a model
    overflowing on one input would look the same)."""
    runner = type(served[1].runner)
    select = runner._select

    def poisoned(self, *args, **kwargs):
        block = isinstance(args[0], list)  # BlockRunner._select(rows, logits, ...); Runner._select(packed, logits)
        rows, logits = (args[0], args[1]) if block else (args[0].group, args[1])
        for i, s in enumerate(rows):
            if s.params.seed == NAN_SEED:
                logits[i] = float("nan")
        return select(self, *args, **kwargs)
    monkeypatch.setattr(runner, "_select", poisoned)


def _grpc(live: LiveServer, model: str, prompt: str, seed: int, bad: Optional[tuple] = None) -> tuple:
    so = None
    if bad is not None:
        text = bad[1] if bad[0] == "json_text" else json.dumps(bad[1])  # json_text: a schema's JSON as sent
        so = pb.StructuredOutput(regex=bad[1]) if bad[0] == "regex" else pb.StructuredOutput(json_schema=text)
    req = pb.GenerateRequest(prompt=prompt, gen_length=32, steps=32, block_length=16, seed=seed, temperature=1.0,
                             structured_output=so)
    with grpc.insecure_channel(live.grpc_target) as ch:
        try:
            last = list(pb_grpc.GenerationServiceStub(ch).Generate(req, timeout=600))[-1]
        except grpc.RpcError as e:
            return "error", e.code().name, e.details() or ""
    return "ok", last.text, [t.id for t in last.tokens]


def _http(live: LiveServer, model: str, prompt: str, seed: int, bad: Optional[tuple] = None) -> tuple:
    body: dict = {"model": model, "prompt": prompt, "max_tokens": 32, "steps": 32, "block_length": 16, "seed": seed,
                  "temperature": 1.0}
    if bad is not None:
        body["structured_outputs"] = {"json" if bad[0] == "json_text" else bad[0]: bad[1]}
    conn = http.client.HTTPConnection("127.0.0.1", int(live.http_url.rsplit(":", 1)[1]), timeout=600)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        status, text = resp.status, resp.read().decode()
    finally:
        conn.close()
    if status != 200:
        err = json.loads(text)["error"]
        return "error", status, err["message"], err.get("param")
    return "ok", json.loads(text)["choices"][0]["text"]


def _round(door: Callable, live: LiveServer, model: str, bad: list) -> tuple[list, list]:
    """The 12 good requests (each its own client: its own call and connection) and the bad ones,
    sent together; (good outcomes in order, bad outcomes in order)."""
    with concurrent.futures.ThreadPoolExecutor(GOOD + len(bad) + 1) as pool:
        good = [pool.submit(door, live, model, f"{SECRET}{k}: once upon a time", k) for k in range(GOOD)]
        worse = [pool.submit(door, live, model, "x", NAN_SEED if b == "nan" else 7, None if b == "nan" else b) for b in bad]
        return [f.result() for f in good], [f.result() for f in worse]


def _field(door: str, kind: str) -> str:
    root = "structured_output" if door == "grpc" else "structured_outputs"
    if kind == "regex":
        return f"{root}.regex"
    return f"{root}.json_schema.properties.a" if door == "grpc" else f"{root}.json.properties.a"


def _check_bad(door: str, outcomes: list) -> None:
    for b, out in zip(BAD + ["nan"], outcomes):
        assert out[0] == "error", (b, out)
        assert SECRET not in json.dumps(out)  # nothing of another request's input
        if b == "nan":
            assert out[1] in ("INTERNAL", 500) and "not finite" in out[2], out
            continue
        assert out[1] in ("INVALID_ARGUMENT", 400), (b, out)
        assert _field(door, b[0]) in out[2], (b, out)
        if door == "http":
            assert out[3] == _field(door, b[0])


@pytest.mark.parametrize("door", ["grpc", "http"])
def test_bad_shapes_and_a_nan_row_beside_twelve_running_requests(served, nan_row, door, monkeypatch):
    name, llm, live = served
    call = _grpc if door == "grpc" else _http
    alone, _ = _round(call, live, name, [])
    assert all(o[0] == "ok" for o in alone), alone
    # As served: empty languages refused at compile; the NaN row fails in the step, alone.
    good, bad = _round(call, live, name, BAD + ["nan"])
    assert good == alone, name
    _check_bad(door, bad)
    # The compile-time check off: the same shapes reach the batched step and fail there, alone.
    check = constraint.Compiler._check

    def unchecked(self, regex, within):
        grammar, problem = check(self, regex, within)
        return grammar, "" if problem.startswith("its language is empty") else problem
    monkeypatch.setattr(constraint.Compiler, "_check", unchecked)
    monkeypatch.setattr(llm.requests, "_compiler", None)  # rebuilt with the unchecked verdicts
    good, bad = _round(call, live, name, BAD + ["nan"])
    assert good == alone, name
    _check_bad(door, bad)


@pytest.mark.parametrize("door", ["grpc", "http"])
def test_a_schema_nested_thousands_deep_is_refused_naming_the_limit(served, door):
    """Issue 40 item 3: a JSON-string schema nested thousands deep was a RecursionError (HTTP 500,
    gRPC UNKNOWN); now 400 / INVALID_ARGUMENT naming the nesting limit, and the server serves on."""
    name, _, live = served
    deep = "[" * 16000 + "]" * 16000
    call = _grpc if door == "grpc" else _http
    out = call(live, name, "x", 1, ("json_text", deep))
    assert out[1] in ("INVALID_ARGUMENT", 400) and f"{constraint.MAX_SCHEMA_NESTING} deep" in out[2], out
    assert call(live, name, "It was", 1)[0] == "ok"
