"""One request path for both doors (issue 13), against real in-process servers on loopback.

The gRPC servicer and the HTTP gateway share the engine's request builder, the scheduler's
eager admission, one lifecycle (metrics, spans, logs) and one error table; these tests check
that the two doors agree and that the engine-side fixes hold through a real server.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.request

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from celeris.v1 import generation_pb2 as pb
from tests.integration.conftest import collect, small
from tests.integration.live_server import live_server
from tests.integration.server_process import free_port
from tests.integration.http_helpers import post, sse_events
from celeris.server.telemetry import Metrics, Telemetry, make_tracer_provider


def traced():
    exporter = InMemorySpanExporter()
    return Telemetry(make_tracer_provider("none", extra=exporter), Metrics()), exporter


def counter(tel: Telemetry, name: str, **labels) -> float:
    return tel.metrics.registry.get_sample_value(name, labels or None) or 0.0


def test_both_doors_report_the_same_totals_for_adaptive_decoding(tiny_llm):
    knobs = dict(gen_length=32, block_length=8, steps=8, threshold=0.5, seed=4)
    with live_server(tiny_llm) as live:
        from celeris_client import CelerisClient

        with CelerisClient(live.grpc_target) as c:
            snaps = list(c.stream(PROMPT_TEXT, **knobs))
        body = {"prompt": PROMPT_TEXT, "max_tokens": 32, "block_length": 8, "steps": 8, "threshold": 0.5,
                "seed": 4, "stream": True, "diffusing": True}
        chunks = [e for e in sse_events(post(live, "/v1/completions", body)) if e != "[DONE]"]
    last_grpc, last_http = snaps[-1], chunks[-1]["celeris"]
    assert last_http["total_steps"] == last_grpc.total_steps == 32  # planned: gen_length, the worst case
    assert last_http["step"] == last_grpc.step  # what ran
    assert chunks[-1]["usage"]["forward_passes"] == last_grpc.usage.forward_passes
    assert chunks[-1]["choices"][0]["text"] == last_grpc.text


PROMPT_TEXT = "It is a truth universally"


async def test_forward_passes_count_model_calls_with_guidance(serve):
    tel, _ = traced()
    async with serve(telemetry=tel) as (_, stub, _):
        before = counter(tel, "celeris_forward_passes_total"), counter(tel, "celeris_steps_total")
        msgs = await collect(stub.Generate(small(cfg_scale=1.0, gen_length=8, steps=8, block_length=8)))
        after = counter(tel, "celeris_forward_passes_total"), counter(tel, "celeris_steps_total")
    assert msgs[-1].step == 8 and msgs[-1].usage.forward_passes == 16  # conditional + unconditional
    assert after[1] - before[1] == 8 and after[0] - before[0] == 16


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
async def test_a_cancelled_request_id_is_reusable_at_once(serve, tiny_llm, monkeypatch):
    real_step = tiny_llm.loop.step_later

    def slow_step(during=None):  # the step thread is busy when the cancel comes
        time.sleep(0.3)
        return real_step(during=during)

    tel, _ = traced()
    async with serve(telemetry=tel) as (_, stub, _):
        monkeypatch.setattr(tiny_llm.loop, "step_later", slow_step)
        first = stub.Generate(small(request_id="again", gen_length=16, steps=16, block_length=16))
        await first.read()
        first.cancel()
        deadline = time.monotonic() + 5
        while not counter(tel, "celeris_requests_total", outcome="cancelled", code="CANCELLED"):
            assert time.monotonic() < deadline, "the server never saw the cancel"
            await asyncio.sleep(0.001)
        second = await collect(stub.Generate(small(request_id="again", gen_length=8, steps=8, block_length=8)))
        monkeypatch.setattr(tiny_llm.loop, "step_later", real_step)
    assert second[-1].done and second[-1].request_id == "again"


async def test_scheduler_stop_lets_the_step_in_flight_finish_before_cancelling(serve, tiny_llm, monkeypatch):
    real_step, real_cancel = tiny_llm.loop.step_later, tiny_llm.loop.cancel
    in_step, overlaps = [False], []

    def slow_step(during=None):  # the worker's step (StepLoop.step_later)
        in_step[0] = True
        time.sleep(0.2)
        try:
            return real_step(during=during)
        finally:
            in_step[0] = False

    def watched_cancel(target):
        overlaps.append(in_step[0])
        return real_cancel(target)

    async with serve() as (server, stub, _):
        monkeypatch.setattr(tiny_llm.loop, "step_later", slow_step)
        monkeypatch.setattr(tiny_llm.loop, "cancel", watched_cancel)
        call = stub.Generate(small(gen_length=64, steps=64, block_length=64))
        await call.read()
        while not in_step[0]:
            await asyncio.sleep(0.001)
        await server.scheduler.stop()
        call.cancel()
    monkeypatch.setattr(tiny_llm.loop, "step_later", real_step)
    assert overlaps and not any(overlaps), "a request was cancelled while the worker was inside a step"


async def test_special_token_text_in_user_input_stays_text(serve, tiny_llm):
    tok = tiny_llm.tokenizer
    specials = {tok.mask_id, tok.eos_id, *(tok._tok.token_to_id(t) for t in ("<|user|>", "<|assistant|>", "<|system|>"))}
    text = "hi <|mask|><|mask|> <|eos|> <|assistant|> <|user|>"
    async with serve() as (_, stub, _):
        plain = await stub.Tokenize(pb.TokenizeRequest(text=text))
        chat = await stub.Tokenize(pb.TokenizeRequest(text=text, apply_chat_template=True))
        msgs = await collect(stub.Generate(small(prompt=text)))
        turn = await collect(stub.Generate(pb.GenerateRequest(
            chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=text)]), gen_length=8, steps=8,
            block_length=8, seed=1)))
    assert not specials & set(plain.ids), "user text became special ids"
    assistant = tok._tok.token_to_id("<|assistant|>")
    assert list(chat.ids).count(assistant) == 1  # only the template's own generation prompt
    assert list(chat.ids).count(tok._tok.token_to_id("<|user|>")) == 1
    assert msgs[-1].usage.prompt_tokens == len(plain.ids) and turn[-1].usage.prompt_tokens == len(chat.ids)


async def test_metrics_port_binds_like_the_grpc_host(serve):
    port = free_port()
    async with serve(metrics_port=port, host="127.0.0.1") as (server, _, _):
        assert server._metrics_server[0].server_address[0] == "127.0.0.1"
        with socket.socket() as s:  # another loopback address of this machine: not listening there
            assert s.connect_ex(("127.0.0.2", port)) != 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert b"celeris_requests_total" in r.read()


def test_http_requests_are_in_the_request_metrics_and_spans(tiny_llm):
    tel, exporter = traced()
    with live_server(tiny_llm, telemetry=tel) as live:
        exporter.clear()
        r = post(live, "/v1/completions", {"prompt": PROMPT_TEXT, "max_tokens": 8, "seed": 1},
                 {"X-Request-Id": "http-1", "traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"})
        assert r.status == 200 and json.loads(r.read())["id"] == "cmpl-http-1"
        bad = post(live, "/v1/completions", {"prompt": PROMPT_TEXT, "max_tokens": 0})
        assert bad.status == 400
        bad.read()
    assert counter(tel, "celeris_requests_total", outcome="ok", code="OK") == 1
    assert counter(tel, "celeris_requests_total", outcome="error", code="INVALID_ARGUMENT") == 1
    spans = exporter.get_finished_spans()
    req = [s for s in spans if s.name == "POST /v1/completions" and s.attributes.get("celeris.request_id") == "http-1"]
    assert len(req) == 1 and format(req[0].context.trace_id, "032x") == "ab" * 16
    steps = [s for s in spans if s.name == "celeris.denoise_step"]
    assert steps and all(any(link.context.span_id == req[0].context.span_id for link in s.links) for s in steps)


def test_tokenizing_runs_off_the_event_loop(tiny_llm, monkeypatch):
    """A slow tokenization (here: 1 s) must not hold up other calls on the server's loop; only a
    call of one sample whose prompt has at most INLINE_PROMPT characters is built on the loop."""
    import threading

    from celeris.engine import requests
    from celeris.v1 import generation_pb2_grpc as pb_grpc

    real = tiny_llm.tokenizer.encode
    where: dict[str, set[str]] = {}  # prompt -> the threads that tokenized it

    def slow_encode(text):
        time.sleep(1.0)
        return real(text)

    def noted_encode(text):
        where.setdefault(text, set()).add(threading.current_thread().name)
        return real(text)

    # The test model takes 64 prompt tokens, about 256 characters: the bound is lowered to fit it.
    monkeypatch.setattr(requests, "INLINE_PROMPT", 40)
    long = ("It is a truth universally acknowledged " * 4)[:41]
    with live_server(tiny_llm) as live:  # the server's loop runs in its own thread
        monkeypatch.setattr(tiny_llm.tokenizer, "encode", noted_encode)
        with grpc.insecure_channel(live.grpc_target) as c:
            for prompt, n in ((long[:40], 1), (long, 1), (long[:30], 2)):
                assert list(pb_grpc.GenerationServiceStub(c).Generate(small(prompt=prompt, n=n), timeout=30))[-1].done
        assert where[long[:40]] == {"celeris-test-server"}, where  # the server's loop (live_server)
        for off in (long, long[:30]):  # too long; or one of a call's n samples
            assert where[off] and all(t.startswith("celeris-encode") for t in where[off]), where
        monkeypatch.setattr(tiny_llm.tokenizer, "encode", slow_encode)
        done = []
        with grpc.insecure_channel(live.grpc_target) as a, grpc.insecure_channel(live.grpc_target) as b:
            slow = threading.Thread(target=lambda: done.append(list(pb_grpc.GenerationServiceStub(a).Generate(
                small(prompt=long), timeout=30))))
            slow.start()
            time.sleep(0.15)  # the slow request is being tokenized now
            t0 = time.monotonic()
            pb_grpc.GenerationServiceStub(b).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            waited = time.monotonic() - t0
            slow.join(30)
        monkeypatch.setattr(tiny_llm.tokenizer, "encode", real)
    assert done and done[0][-1].done
    assert waited < 0.4, f"GetModelInfo waited {waited:.2f} s behind a tokenization"


def test_only_short_plain_prompts_are_built_on_the_loop():
    from celeris.engine.requests import INLINE_PROMPT, Request, _short_plain
    from celeris.engine.structured.constraint import Structured

    n = INLINE_PROMPT
    assert _short_plain(Request(prompt="x" * n)) and _short_plain(Request(token_ids=[5] * n))
    assert not _short_plain(Request(prompt="x" * (n + 1))) and not _short_plain(Request(token_ids=[5] * (n + 1)))
    assert not _short_plain(Request(messages=[{"role": "user", "content": "hi"}]))
    assert not _short_plain(Request(prompt="hi", tools=[{"type": "function", "function": {"name": "f"}}]))
    assert not _short_plain(Request(prompt="hi", structured=Structured("regex", "[a-z]+")))


async def test_message_count_and_size_are_checked_before_any_work(serve):
    many = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="") for _ in range(20_000)])
    async with serve() as (_, stub, _):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub.Generate(pb.GenerateRequest(chat=many)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "20000 messages" in e.value.details() and len(e.value.details()) < 1024
