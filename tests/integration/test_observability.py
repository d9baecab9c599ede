"""Traces, logs and metrics after real streamed requests."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

from grpc_health.v1 import health_pb2, health_pb2_grpc
import grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from celeris.server.telemetry import Metrics, Telemetry, configure_logging, make_tracer_provider
from tests.integration.conftest import collect, small
from tests.integration.server_process import free_port

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def traced():
    exporter = InMemorySpanExporter()
    return Telemetry(make_tracer_provider("none", extra=exporter), Metrics()), exporter


async def test_span_tree_continues_traceparent_and_links_step_spans(serve):
    tel, exporter = traced()
    md = (("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01"),)
    async with serve(telemetry=tel) as (_, stub, _):
        exporter.clear()  # drop the warm-up's step span
        msgs = await collect(stub.Generate(small(request_id="traced"), metadata=md))
    spans = exporter.get_finished_spans()
    (rpc,) = [s for s in spans if s.name == "celeris.v1.GenerationService/Generate"]
    assert rpc.kind == SpanKind.SERVER
    assert format(rpc.context.trace_id, "032x") == TRACE_ID and format(rpc.parent.span_id, "016x") == PARENT_ID
    assert rpc.attributes["celeris.request_id"] == "traced"
    assert rpc.attributes["celeris.forward_passes"] == msgs[-1].usage.forward_passes
    steps = [s for s in spans if s.name == "celeris.denoise_step"]
    assert len(steps) == 8
    for s in steps:
        assert [link.context.span_id for link in s.links] == [rpc.context.span_id]
        assert s.attributes["celeris.batch_size"] == 1 and s.attributes["celeris.tokens_committed"] == 2
        assert s.attributes["celeris.bucket.length"] >= 16 and s.attributes["celeris.cuda_graph"] is False
        assert rpc.start_time <= s.start_time and s.end_time <= rpc.end_time


async def test_one_step_span_serves_every_request_in_the_batch(serve):
    tel, exporter = traced()
    async with serve(telemetry=tel) as (_, stub, _):
        exporter.clear()
        await asyncio.gather(*(collect(stub.Generate(small(request_id=f"r{i}", seed=i))) for i in range(4)))
    spans = exporter.get_finished_spans()
    rpc_ids = {s.context.span_id for s in spans if s.kind == SpanKind.SERVER}
    steps = [s for s in spans if s.name == "celeris.denoise_step"]
    assert len(rpc_ids) == 4
    assert max(len(s.links) for s in steps) >= 2  # requests shared forward passes
    assert {link.context.span_id for s in steps for link in s.links} == rpc_ids


async def test_health_watch_works_with_tracing_on(serve):
    tel, _ = traced()
    async with serve(telemetry=tel) as (_, _, port):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await asyncio.wait_for(watch.read(), 5)).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()


async def test_log_lines_carry_request_and_trace_ids_but_no_prompt(serve, capsys):
    configure_logging(json_logs=True)
    tel, _ = traced()
    async with serve(telemetry=tel) as (_, stub, _):
        await collect(stub.Generate(small(request_id="logged", prompt="a secret prompt"),
                                    metadata=(("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01"),)))
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    mine = [line for line in lines if line.get("request_id") == "logged"]
    assert {"request.finished"} <= {line["event"] for line in mine}
    for line in mine:
        assert line["trace_id"] == TRACE_ID and len(line["span_id"]) == 16 and int(line["span_id"], 16)
    assert not any("a secret prompt" in json.dumps(line) for line in lines)
    access = [line for line in lines if line.get("event") == "rpc" and line["method"].endswith("/Generate")]
    assert access and access[-1]["code"] == "OK" and access[-1]["messages"] == 8


async def test_prometheus_metrics_after_real_requests(serve):
    tel, _ = traced()
    port = free_port()
    async with serve(telemetry=tel, metrics_port=port) as (_, stub, _):
        results = await asyncio.gather(*(collect(stub.Generate(small(seed=i))) for i in range(3)))
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode())
    values = {}
    for line in body.splitlines():
        if line.startswith("celeris_") and " " in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    generated = sum(r[-1].usage.generated_tokens for r in results)
    assert values['celeris_requests_total{code="OK",outcome="ok"}'] == 3
    assert values["celeris_generated_tokens_total"] == generated
    assert values["celeris_forward_passes_total"] >= 8  # 3 x 8 request-steps share forwards (+ warm-up)
    assert values["celeris_forward_passes_total"] < 3 * 8 + 1
    assert values["celeris_queue_depth"] == 0
    assert values["celeris_time_to_first_snapshot_seconds_count"] == 3
    assert values["celeris_request_latency_seconds_count"] == 3
    assert values["celeris_step_latency_seconds_count"] == values["celeris_steps_total"]
    assert values["celeris_forward_passes_total"] >= values["celeris_steps_total"]  # model calls, >= 1 per step
    assert values["celeris_forwards_per_step_count"] == values["celeris_steps_total"]
    assert values["celeris_forwards_per_step_sum"] == values["celeris_forward_passes_total"]
    assert values["celeris_tokens_per_forward_sum"] == 3 * 16 + 1  # every token committed once (+ warm-up)
    assert "celeris_batch_size_bucket" in body and "celeris_running_requests" in body
    # The event loop's CPU: positive, and no more than this process has used.
    assert 0 < values["celeris_event_loop_cpu_seconds"] <= time.process_time()
