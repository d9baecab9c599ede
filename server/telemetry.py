"""The only place that configures structlog, OpenTelemetry and Prometheus.

- Traces: one SERVER span per RPC (continuing the caller's W3C traceparent), one span per
  batched denoising step linked to every request span it served. Exporter from configuration:
  OTLP when OTEL_EXPORTER_OTLP_ENDPOINT (or ..._TRACES_ENDPOINT) is set, console, or none.
- Logs: structlog JSON lines (console renderer on a terminal), each carrying request_id,
  trace_id and span_id; prompt text only when log_prompts is on.
- Metrics: Prometheus, `celeris_*`, served on their own port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from typing import Iterator, Optional

import structlog
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter, SimpleSpanProcessor
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from engine.errors import EngineError
from engine.scheduler import Scheduler, StepRecord
from engine.sequence import StepEvent

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def configure_logging(json_logs: Optional[bool] = None, level: str = "INFO", stream=None) -> None:
    """JSON to stdout (or `stream`), or a console renderer when stdout is a terminal."""
    json_logs = (not sys.stdout.isatty()) if json_logs is None else json_logs
    renderer = structlog.processors.JSONRenderer() if json_logs else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True), renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(stream), cache_logger_on_first_use=False)


def make_tracer_provider(exporter: str = "auto", extra: Optional[SpanExporter] = None) -> TracerProvider:
    """exporter: auto (OTLP if its env vars are set, else none), otlp, console or none."""
    provider = TracerProvider(resource=Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "celeris")}))
    if exporter == "auto":
        env = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        exporter = "otlp" if any(os.environ.get(k) for k in env) else "none"
    if exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))  # reads OTEL_EXPORTER_OTLP_*
    elif exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
    elif exporter != "none":
        raise ValueError(f"unknown trace exporter {exporter!r}")
    if extra is not None:  # tests: an in-memory exporter
        provider.add_span_processor(SimpleSpanProcessor(extra))
    return provider


class Metrics:
    def __init__(self, registry: Optional[CollectorRegistry] = None):
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter("celeris_requests_total", "Generate requests by outcome and gRPC code",
                                ["outcome", "code"], registry=r)
        self.queue_depth = Gauge("celeris_queue_depth", "Requests waiting for a batch slot", registry=r)
        self.running = Gauge("celeris_running_requests", "Requests in the running batch", registry=r)
        self.batch_size = Histogram("celeris_batch_size", "Requests per batched step",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.step_latency = Histogram("celeris_step_latency_seconds", "Batched denoising step latency",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.ttfs = Histogram("celeris_time_to_first_snapshot_seconds", "Request start to first snapshot",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("celeris_request_latency_seconds", "Generate end-to-end latency",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.generated_tokens = Counter("celeris_generated_tokens_total", "Generated non-EOS tokens", registry=r)
        self.forward_passes = Counter("celeris_forward_passes_total", "Batched forward passes", registry=r)
        self.tokens_per_forward = Histogram("celeris_tokens_per_forward", "Tokens committed per batched forward",
                                            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)

    def serve(self, port: int, host: str = "0.0.0.0"):
        return start_http_server(port, addr=host, registry=self.registry)


class RequestObserver:
    """Telemetry of one Generate call: its span, its log context, its metrics."""

    def __init__(self, tel: Telemetry, span: trace.Span):
        self.tel, self.span = tel, span
        self.t0 = time.perf_counter()
        self.first = True
        self.request_id = ""
        self.outcome, self.code = "ok", "OK"

    def bind(self, request_id: str) -> None:
        self.request_id = request_id
        self.span.set_attribute("celeris.request_id", request_id)
        self.tel.spans[request_id] = self.span
        structlog.contextvars.bind_contextvars(request_id=request_id)

    def step(self, ev: StepEvent) -> None:
        if self.first:
            self.first = False
            self.tel.metrics.ttfs.observe(time.perf_counter() - self.t0)

    def finish(self, ev: StepEvent, generated: int) -> None:
        self.tel.metrics.generated_tokens.inc(generated)
        reason = ev.finish_reason.value if ev.finish_reason else "length"
        self.span.set_attributes({"celeris.finish_reason": reason, "celeris.generated_tokens": generated,
                                  "celeris.forward_passes": ev.forward_passes})
        if reason == "cancelled":
            self.outcome, self.code = "cancelled", "CANCELLED"
        self.tel.log.info("request.finished", finish_reason=reason, generated_tokens=generated,
                          forward_passes=ev.forward_passes)

    def fail(self, exc: EngineError) -> None:
        from server.errors import to_status

        self.outcome, self.code = "error", to_status(exc).code.name
        self.span.set_status(Status(StatusCode.ERROR, str(exc)))
        self.tel.log.warning("request.rejected", code=self.code, error=str(exc))


class Telemetry:
    def __init__(self, provider: Optional[TracerProvider] = None, metrics: Optional[Metrics] = None,
                 log_prompts: bool = False):
        self.provider = provider or make_tracer_provider("none")
        self.tracer = self.provider.get_tracer("celeris.server")
        self.metrics = metrics or Metrics()
        self.log = structlog.get_logger("celeris")
        self.log_prompts = log_prompts
        self.spans: dict[str, trace.Span] = {}  # request id -> its live server span

    @contextlib.contextmanager
    def request(self, context, request) -> Iterator[RequestObserver]:
        carrier = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        parent = propagate.extract(carrier)
        with self.tracer.start_as_current_span("celeris.v1.GenerationService/Generate", context=parent,
                                               kind=SpanKind.SERVER, record_exception=False,
                                               set_status_on_exception=False) as span:
            ctx = span.get_span_context()
            structlog.contextvars.bind_contextvars(trace_id=format(ctx.trace_id, "032x"),
                                                   span_id=format(ctx.span_id, "016x"))
            obs = RequestObserver(self, span)
            self.log.info("request.started", peer=context.peer(),
                          **({"prompt": request.prompt} if self.log_prompts and request.prompt else {}))
            try:
                yield obs
            except (asyncio.CancelledError, GeneratorExit):  # client cancel or deadline
                if obs.outcome == "ok":
                    obs.outcome, obs.code = "cancelled", "CANCELLED"
                raise
            except BaseException:  # an abort already classified by obs.fail, or a bug
                if obs.outcome == "ok":
                    obs.outcome, obs.code = "error", "INTERNAL"
                raise
            finally:
                self.spans.pop(obs.request_id, None)
                self.metrics.requests.labels(obs.outcome, obs.code).inc()
                self.metrics.latency.observe(time.perf_counter() - obs.t0)
                span.set_attribute("rpc.grpc.status_code", obs.code)
                structlog.contextvars.unbind_contextvars("request_id", "trace_id", "span_id")

    def bind_scheduler(self, scheduler: Scheduler) -> None:
        """Gauges read the scheduler at scrape time, so they never go stale between steps."""
        self.metrics.queue_depth.set_function(lambda: scheduler.queued)
        self.metrics.running.set_function(lambda: scheduler.running)

    def on_step(self, record: StepRecord) -> None:
        s = record.stats
        m = self.metrics
        m.batch_size.observe(s.batch)
        m.step_latency.observe(s.seconds)
        m.forward_passes.inc()
        m.tokens_per_forward.observe(s.committed)
        links = [Link(self.spans[r].get_span_context()) for r in record.request_ids if r in self.spans]
        span = self.tracer.start_span("celeris.denoise_step", links=links, start_time=int(record.started * 1e9),
                                      context=trace.set_span_in_context(trace.INVALID_SPAN))
        span.set_attributes({"celeris.batch_size": s.batch, "celeris.bucket.batch": s.bucket_batch,
                             "celeris.bucket.length": s.bucket_length, "celeris.tokens_committed": s.committed,
                             "celeris.step_latency_s": s.seconds, "celeris.cuda_graph": s.cuda_graph,
                             "celeris.request_ids": list(record.request_ids)})
        span.end(end_time=int(record.ended * 1e9))

    def shutdown(self) -> None:
        self.provider.shutdown()
