"""The only place that configures structlog, OpenTelemetry and Prometheus.

- Traces: one SERVER span per RPC (continuing the caller's W3C traceparent), one span per
  batched denoising step linked to every request span it served. Exporter from configuration:
  OTLP when OTEL_EXPORTER_OTLP_ENDPOINT (or ..._TRACES_ENDPOINT) is set, console, or none.
- Logs: structlog JSON lines (console renderer on a terminal), each carrying request_id,
  trace_id and span_id; prompt text only when log_prompts is on, and cut to MAX_LOGGED_PROMPT.
  The standard library's loggers (the engine's, aiohttp's, grpc's) go through the same renderer,
  and an exception is a structured `exception` field, never a bare traceback, and never with its
  frames' local variables (they hold bearer tokens and prompt text). Logs go through a
  `SafeSink`: a closed stdout pipe (`celeris serve | tee`, then Ctrl-C) silences them, it never
  breaks a request or a signal handler.
- Request spans are started and ended explicitly, never attached to the context: a stream's
  handler may be closed from another context (a client cancel), and detaching there is what made
  OpenTelemetry log "Failed to detach context".
- Metrics: Prometheus, `celeris_*`, and the same series under vLLM's `vllm:` names
  (server/metrics_vllm.py), on the HTTP port and on their own port.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Optional

import structlog
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter, SimpleSpanProcessor
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from structlog.processors import ExceptionRenderer
from structlog.tracebacks import ExceptionDictTransformer

from celeris.engine.errors import clip
from celeris.engine.events import StepEvent
from celeris.engine.serving import Engine, StepRecord

MAX_LOGGED_ERROR = 512  # characters of an error message in a log line
MAX_LOGGED_PROMPT = 256  # characters of a prompt in a log line (with --log-prompts)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class SafeSink:
    """A log stream that never raises: once writing fails (a closed pipe, a full disk), log lines
    are dropped, and a closed stdout is pointed at /dev/null so the interpreter's own last flush
    is quiet too. Serving and signal handling must not depend on anyone reading the logs.

    Whole lines only: each thread's text is held until its newline and each line goes out in one
    write, under one lock. `print` writes a record and its newline separately, and with an unbuffered stdout
    (PYTHONUNBUFFERED, as the images set) each is its own system call: two threads, or the
    server and a tensor-parallel worker sharing the stream, could otherwise merge two JSON
    records into one line."""

    def __init__(self, stream) -> None:
        self.stream, self.broken = stream, False
        self._lock = threading.Lock()
        self._local = threading.local()  # per thread: its text after its last newline

    def write(self, text: str) -> int:
        whole = getattr(self._local, "partial", "") + text
        cut = whole.rfind("\n") + 1
        self._local.partial = whole[cut:]
        with self._lock:
            if cut and not self.broken:
                try:
                    self.stream.write(whole[:cut])
                except (OSError, ValueError):  # BrokenPipeError, EIO, ENOSPC; ValueError: closed file
                    self._break()
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self.stream.flush()
            except (OSError, ValueError):
                self._break()

    def _break(self) -> None:
        self.broken = True
        try:
            fd = self.stream.fileno()
            os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
        except (OSError, ValueError, AttributeError):
            pass


def configure_logging(json_logs: Optional[bool] = None, level: str = "INFO", stream=None) -> None:
    """JSON to stdout (or `stream`), or a console renderer when stdout is a terminal."""
    json_logs = (not sys.stdout.isatty()) if json_logs is None else json_logs
    sink = SafeSink(stream or sys.stdout)
    renderer = structlog.processors.JSONRenderer() if json_logs else structlog.dev.ConsoleRenderer()
    shared = [structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
              structlog.processors.TimeStamper(fmt="iso", utc=True)]
    exc = [ExceptionRenderer(ExceptionDictTransformer(show_locals=False))] if json_logs else []
    structlog.configure(
        processors=[*shared, *exc, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(sink), cache_logger_on_first_use=False)
    # Standard-library records (engine, aiohttp, grpc, opentelemetry) as the same lines.
    handler = logging.StreamHandler(sink)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name, structlog.stdlib.ExtraAdder()],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *exc, renderer]))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(logging.getLevelName(level))


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


def exports_spans(provider: TracerProvider) -> bool:
    """Whether spans of `provider` reach any processor (an exporter, a test's in-memory one);
    True where that cannot be told."""
    processors = getattr(getattr(provider, "_active_span_processor", None), "_span_processors", None)
    return processors is None or len(processors) > 0


def thread_cpu_clock(ident: int) -> Callable[[], float]:
    """A reader of one thread's CPU seconds that any thread may call (a scrape runs in its own);
    NaN where the platform has no per-thread CPU clocks or the thread has ended."""
    try:
        clock = time.pthread_getcpuclockid(ident)
    except (AttributeError, OSError):
        return lambda: float("nan")

    def read() -> float:
        try:
            return time.clock_gettime(clock)
        except OSError:
            return float("nan")

    return read


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
        self.prompt_tokens = Counter("celeris_prompt_tokens_total", "Prompt tokens of finished requests (cached "
                                     "ones included)", registry=r)
        self.forward_passes = Counter("celeris_forward_passes_total", "Model calls (a batched step makes one per "
                                      "group: cache refresh, cached, CFG rows twice)", registry=r)
        self.steps = Counter("celeris_steps_total", "Batched denoising steps", registry=r)
        self.forwards_per_step = Histogram("celeris_forwards_per_step", "Model forwards a batched step ran "
                                           "(DiffusionGemma: denoiser forwards, 1 when every row shares one)",
                                           buckets=(1, 2, 4, 8, 16, 32), registry=r)
        self.open_streams = Gauge("celeris_open_streams", "Streams admitted and not yet closed (parked ones too)",
                                  registry=r)
        # The loop's own CPU (handlers, message building, serialization): what competes with
        # the step worker for cores; celeris_step_latency_seconds_sum is the forwards' wall time.
        self.event_loop_cpu = Gauge("celeris_event_loop_cpu_seconds", "CPU time of the thread running the "
                                    "asyncio event loop since it started", registry=r)
        self.tokens_per_forward = Histogram("celeris_tokens_per_forward", "Tokens committed per batched step",
                                            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.structured = Counter("celeris_structured_requests_total", "Structured-output requests admitted, by "
                                  "how they decode: skeleton, document (one grammar) or regex", ["path"], registry=r)
        # Self-speculation (Nemotron-Labs-Diffusion's linear_spec): their ratio is accepted tokens per
        # verify pass; the histogram has each finished request's own.
        self.verify_passes = Counter("celeris_verify_passes_total", "Self-speculation verify passes", registry=r)
        self.accepted_tokens = Counter("celeris_accepted_tokens_total", "Tokens self-speculation verify passes "
                                       "accepted", registry=r)
        self.accepted_per_verify = Histogram("celeris_accepted_tokens_per_verify", "A self-speculating request's "
                                             "accepted tokens per verify pass", registry=r,
                                             buckets=(1, 1.5, 2, 3, 4, 6, 8, 12, 16, 32))

    def serve(self, port: int, host: str = "127.0.0.1"):
        return start_http_server(port, addr=host.strip("[]") or "::", registry=self.registry)


class PrefixCacheCollector:
    """The prefix cache's own counters, read at scrape time (engine/models/prefix_cache.py keeps them, so
    the step thread pays nothing): hit tokens / queried prompt tokens (vLLM's pair), the bytes it
    holds against its budget, evictions."""

    def __init__(self, stats: Callable[[], Any]):
        self.stats = stats

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.stats()
        yield CounterMetricFamily("celeris_prefix_cache_queries", "Prompt tokens of requests that asked the "
                                  "prefix cache", value=s.queried_tokens)
        yield CounterMetricFamily("celeris_prefix_cache_hits", "Prompt tokens served from the prefix cache",
                                  value=s.hit_tokens)
        yield CounterMetricFamily("celeris_prefix_cache_evictions", "Prefix cache blocks evicted (LRU)",
                                  value=s.evictions)
        yield GaugeMetricFamily("celeris_prefix_cache_bytes", "Bytes the prefix cache holds", value=s.bytes_used)
        yield GaugeMetricFamily("celeris_prefix_cache_budget_bytes", "The prefix cache's budget",
                                value=s.budget_bytes)


class RequestObserver:
    """Telemetry of one request through either door: its span, its log context, its metrics.

    The span is never made current (see the module notes); `end` closes everything exactly once.
    """

    def __init__(self, tel: Telemetry, span: trace.Span):
        self.tel, self.span = tel, span
        self.t0 = time.perf_counter()
        self.first = True
        self.ticket = 0
        self.outcome, self.code = "", ""
        ctx = span.get_span_context()
        self.log_context = {"trace_id": format(ctx.trace_id, "032x"), "span_id": format(ctx.span_id, "016x")}
        self.ended = False

    def bind(self, request_id: str, ticket: int = 0) -> None:
        self.span.set_attribute("celeris.request_id", request_id)
        self.log_context["request_id"] = request_id
        structlog.contextvars.bind_contextvars(**self.log_context)
        if ticket:
            self.ticket = ticket
            self.tel.spans[ticket] = self.span

    def step(self, ev: StepEvent) -> None:
        if self.first:
            self.first = False
            self.tel.metrics.ttfs.observe(time.perf_counter() - self.t0)
        if ev.finished:
            self.finish(ev)

    def finish(self, ev: StepEvent) -> None:
        generated = len(ev.generated)
        self.tel.metrics.generated_tokens.inc(generated)
        self.tel.metrics.prompt_tokens.inc(ev.prompt_tokens)
        if ev.verify_passes:
            m = self.tel.metrics
            m.verify_passes.inc(ev.verify_passes)
            m.accepted_tokens.inc(ev.accepted_tokens)
            m.accepted_per_verify.observe(ev.accepted_tokens / ev.verify_passes)
        reason = ev.finish_reason.value if ev.finish_reason else "length"
        self.span.set_attributes({"celeris.finish_reason": reason, "celeris.generated_tokens": generated,
                                  "celeris.forward_passes": ev.forward_passes, "celeris.steps": ev.steps,
                                  "celeris.kv_cache": ev.kv_cache, "celeris.prompt_tokens": ev.prompt_tokens,
                                  "celeris.cached_prompt_tokens": ev.cached_tokens})
        self.outcome, self.code = ("cancelled", "CANCELLED") if reason == "cancelled" else ("ok", "OK")
        self.tel.log.info("request.finished", finish_reason=reason, generated_tokens=generated,
                          forward_passes=ev.forward_passes, steps=ev.steps, kv_cache=ev.kv_cache, **self.log_context)

    def fail(self, exc: BaseException) -> None:
        from celeris.server.errors import code_name

        self.outcome, self.code = "error", code_name(exc)
        error = str(exc)[:MAX_LOGGED_ERROR]
        self.span.set_status(Status(StatusCode.ERROR, error[:256]))
        if self.code == "INTERNAL":
            self.tel.log.error("request.failed", code=self.code, error=error, exc_info=exc, **self.log_context)
        else:
            self.tel.log.warning("request.rejected", code=self.code, error=error, **self.log_context)

    def end(self) -> None:
        """Record the outcome; a request that neither finished nor failed was cut short by its client."""
        if self.ended:
            return
        self.ended = True
        if not self.outcome:
            self.outcome, self.code = "cancelled", "CANCELLED"
        self.tel.spans.pop(self.ticket, None)
        self.tel.metrics.requests.labels(self.outcome, self.code).inc()
        self.tel.metrics.latency.observe(time.perf_counter() - self.t0)
        self.span.set_attribute("rpc.grpc.status_code", self.code)
        self.span.end()
        structlog.contextvars.unbind_contextvars("request_id", "trace_id", "span_id")


class Telemetry:
    def __init__(self, provider: Optional[TracerProvider] = None, metrics: Optional[Metrics] = None,
                 log_prompts: bool = False):
        self.provider = provider or make_tracer_provider("none")
        self.tracer = self.provider.get_tracer("celeris.server")
        self.metrics = metrics or Metrics()
        self.log = structlog.get_logger("celeris")
        self.log_prompts = log_prompts
        self.spans: dict[int, trace.Span] = {}  # Sequence.ticket -> its request's live span

    def request(self, name: str, carrier: dict[str, str], peer: str, attributes: dict[str, Any],
                prompt: Optional[str] = None) -> RequestObserver:
        """Start observing one request: a SERVER span continuing the caller's W3C traceparent."""
        span = self.tracer.start_span(name, context=propagate.extract(carrier), kind=SpanKind.SERVER,
                                      attributes=attributes)
        obs = RequestObserver(self, span)
        structlog.contextvars.bind_contextvars(**obs.log_context)
        extra = {"prompt": clip(prompt, MAX_LOGGED_PROMPT)} if self.log_prompts and prompt else {}
        self.log.info("request.started", peer=peer, door=attributes.get("celeris.door"), **extra)
        return obs

    def bind_engine(self, engine: Engine, model_name: str = "") -> None:
        """Gauges read the engine at scrape time, so they never go stale between steps; the
        vLLM-named series (labelled with `model_name`, the served name) read the same ones."""
        from celeris.server.metrics_vllm import VllmNames

        self.metrics.queue_depth.set_function(lambda: engine.queued)
        self.metrics.running.set_function(lambda: engine.running)
        self.metrics.open_streams.set_function(lambda: engine.open)
        self.metrics.event_loop_cpu.set_function(thread_cpu_clock(threading.get_ident()))
        stats = engine.prefix_cache_stats  # block models' prefix cache, when on
        if stats is not None:
            self.metrics.registry.register(PrefixCacheCollector(stats))
        self.metrics.registry.register(VllmNames(self.metrics, model_name, stats))

    def on_step(self, record: StepRecord) -> None:
        s = record.stats
        m = self.metrics
        m.batch_size.observe(s.batch)
        m.step_latency.observe(s.seconds)
        m.forward_passes.inc(s.forwards)
        m.forwards_per_step.observe(s.forwards)
        m.steps.inc()
        m.tokens_per_forward.observe(s.committed)
        if not exports_spans(self.provider):  # a step's span links every request it served:
            return  # O(batch) on the event loop each step, built only where someone receives it
        links = [Link(self.spans[t].get_span_context()) for t in record.tickets if t in self.spans]
        span = self.tracer.start_span("celeris.denoise_step", links=links, start_time=int(record.started * 1e9),
                                      context=trace.set_span_in_context(trace.INVALID_SPAN))
        span.set_attributes({"celeris.batch_size": s.batch, "celeris.bucket.batch": s.bucket_batch,
                             "celeris.bucket.length": s.bucket_length, "celeris.tokens_committed": s.committed,
                             "celeris.step_latency_s": s.seconds, "celeris.cuda_graph": s.cuda_graph,
                             "celeris.forward_passes": s.forwards,
                             "celeris.request_ids": list(record.request_ids)})
        span.end(end_time=int(record.ended * 1e9))

    def shutdown(self) -> None:
        self.provider.shutdown()
