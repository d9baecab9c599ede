"""`celeris train`, `celeris eval` and `celeris serve`."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Optional

from celeris.engine.errors import EngineError
from celeris.server.cli.args import add_model_args, engine_config_from_args
from celeris.server.cli.model import model_from_args
from celeris.server.cli.vllm_flags import (add_vllm_args, apply_model_len, apply_to_model, check_engine_flags, log_level,
                                     origins, tls_files)


def cmd_train(a: argparse.Namespace) -> int:
    from celeris.engine.serving import train

    train(a)
    return 0


def cmd_eval(a: argparse.Namespace) -> int:
    import dataclasses

    from celeris.engine.serving import LLM, configure_threads, evaluate, format_report

    configure_threads(a.threads)  # default: the CPUs this process may use (affinity, cgroup quota)
    llm = LLM.load(model_from_args(a).path, engine_config_from_args(a, max_batch=64, max_queue=4096))
    report = evaluate(llm, a.cache_dir, limit=a.limit)
    if a.json:
        report["scores"] = [dataclasses.asdict(s) for s in report["scores"]]
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    return serve_from_args(a)


def register(sub: argparse._SubParsersAction) -> None:
    cache = Path.home() / ".cache" / "celeris"

    from celeris.engine.serving import add_train_args

    tr = sub.add_parser("train", help="train celeris-tiny from scratch (45.9 + 8.0 min on 2 idle AMD EPYC cores, "
                                      "2026-12-04: its model card)")
    add_train_args(tr)
    tr.set_defaults(func=cmd_train)

    ev = sub.add_parser("eval", help="held-out loss and skill accuracy under several decoders")
    add_model_args(ev)
    ev.add_argument("--limit", type=int, default=None, help="evaluate only the first N held-out problems")
    ev.add_argument("--cache-dir", type=Path, default=cache)
    ev.add_argument("--json", action="store_true")
    ev.set_defaults(func=cmd_eval)

    sv = sub.add_parser("serve", help="serve gRPC (port 50051) and the OpenAI-compatible HTTP API and web page (8000)")
    sv.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                    help="the model, as `vllm serve MODEL` takes it: the same as --model")
    add_model_args(sv)
    add_serve_args(sv)
    add_vllm_args(sv)  # after add_serve_args: --max-num-seqs shares --max-batch's dest and default
    sv.set_defaults(func=cmd_serve)


def add_serve_args(ap: argparse.ArgumentParser) -> None:
    from celeris.server.settings import ServerSettings

    d = ServerSettings()
    # The images set CELERIS_HOST (and the ports) in their environment, so `docker run IMAGE --model
    # /models` still binds every interface though its arguments replace the image's CMD.
    ap.add_argument("--host", default=os.environ.get("CELERIS_HOST", d.host),
                    help="bind address (default $CELERIS_HOST, else %(default)s: this machine only; "
                    "[::] or 0.0.0.0 for every interface, as the container images do)")
    # --port is vLLM's: the OpenAI API's port. It used to name the gRPC port, now --grpc-port's.
    ap.add_argument("--port", "--http-port", dest="http_port", type=int,
                    default=_env_port("CELERIS_HTTP_PORT", HTTP_PORT),
                    help="the OpenAI-compatible HTTP API, the web page and /metrics, as vLLM's --port (default "
                         f"$CELERIS_HTTP_PORT, else {HTTP_PORT}; 0 = off; --http-port is the same flag)")
    ap.add_argument("--grpc-port", type=int, default=_env_port("CELERIS_GRPC_PORT", d.port),
                    help="the gRPC API (default $CELERIS_GRPC_PORT, else %(default)s; earlier releases called it "
                         "--port, which is the HTTP port now, as in vLLM)")
    ap.add_argument("--no-http", action="store_true", help="serve gRPC only (the same as --port 0)")
    ap.add_argument("--served-model-name", dest="served_model_names", nargs="+", metavar="NAME", default=None,
                    help="the model name HTTP clients send and /v1/models lists, then aliases; other names get "
                         "404 model_not_found (default: the model's own name)")
    ap.add_argument("--allowed-origins", nargs="+", metavar="ORIGIN", default=None,
                    help="let web pages from these origins (https://app.example.com, or *) call the HTTP gateway "
                         "(CORS); default: off, browsers on other origins are refused")
    ap.add_argument("--allowed-hosts", nargs="+", metavar="NAME", default=None,
                    help="HTTP Host names the gateway serves besides localhost and loopback addresses (a port is "
                         "ignored; * = any). Bound to loopback, other Hosts get 421 (DNS rebinding); bound elsewhere, "
                         "Host is checked only when names are given")
    ap.add_argument("--metrics-port", type=int, default=_env_port("CELERIS_METRICS_PORT", None),
                    help="serve Prometheus /metrics on this port too (no token asked: bind it where only the "
                         "scraper reaches, see --metrics-host)")
    ap.add_argument("--metrics-host", default=None, help="bind address of /metrics (default: --host)")
    ap.add_argument("--metrics-on-http-port", action=argparse.BooleanOptionalAction, default=True,
                    help="serve Prometheus /metrics on --port too, as vLLM does on its API port (no token; default "
                         "on: --no-metrics-on-http-port keeps it to --metrics-port)")
    ap.add_argument("--api-key", "--api-token", dest="api_token", default=os.environ.get("CELERIS_API_TOKEN"),
                    help="require 'authorization: Bearer KEY' (vLLM's name; --api-token is the same flag; "
                         "default: $CELERIS_API_TOKEN; unset = no auth)")
    ap.add_argument("--rate-limit", type=float, default=0.0,
                    help="requests/s per client (its bearer token, else its address), burst 20; a call with n "
                         "samples counts n; 0 = off")
    ap.add_argument("--trust-forwarded-for", action="store_true",
                    help="key the rate limit on X-Forwarded-For (only behind a proxy that sets it)")
    ap.add_argument("--max-streams", type=int, default=None,
                    help="open streams in all, unread ones included (default: max-batch + max-queue)")
    ap.add_argument("--max-streams-per-client", type=int, default=None,
                    help="places (open streams, a call with n samples takes n) one client may hold: its API key, "
                         "else its address (default: half of --max-streams, at least --max-batch; 0 = no share)")
    ap.add_argument("--max-streams-per-connection", type=int, default=d.max_streams_per_connection,
                    help="open gRPC calls per connection; more get RESOURCE_EXHAUSTED (default %(default)s)")
    ap.add_argument("--max-health-watches", type=int, default=d.max_health_watches, metavar="N",
                    help="open gRPC health Watch streams in all; more get RESOURCE_EXHAUSTED (default %(default)s; "
                         "Check is never limited)")
    ap.add_argument("--max-health-watches-per-client", type=int, default=d.max_health_watches_per_client,
                    metavar="N", help="open health Watch streams from one client address (default %(default)s)")
    ap.add_argument("--unread-timeout", type=float, default=d.unread_timeout_s, metavar="SECONDS",
                    help="cancel a stream whose client has read nothing for this long while output waits, and "
                         "free its place (default %(default)s; 0 = never)")
    ap.add_argument("--header-timeout", type=float, default=d.header_timeout_s, metavar="SECONDS",
                    help="HTTP: close a connection whose request line and headers have not all arrived this long "
                         "after it opened or after its last response (idle keep-alive too) (default %(default)s)")
    ap.add_argument("--body-timeout", type=float, default=d.body_timeout_s, metavar="SECONDS",
                    help="HTTP: answer 408 and close when a request body has not all arrived within this "
                         "(default %(default)s)")
    ap.add_argument("--max-batch", type=int, default=16, help="requests decoded together (default %(default)s)")
    ap.add_argument("--max-queue", type=int, default=64, help="waiting requests before RESOURCE_EXHAUSTED")
    ap.add_argument("--max-prompt-tokens", type=int, default=None,
                    help="longest prompt in tokens (default: the model's own position range less --max-gen-length, "
                         "at most 4096; celeris-tiny: 4096)")
    ap.add_argument("--max-gen-length", type=int, default=512)
    ap.add_argument("--drain-seconds", type=float, default=d.drain_seconds)
    ap.add_argument("--grace-seconds", type=float, default=d.grace_seconds)
    ap.add_argument("--trace-exporter", default="auto", choices=("auto", "otlp", "console", "none"),
                    help="auto = OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set, else none")
    ap.add_argument("--log-prompts", "--enable-log-requests", dest="log_prompts", action="store_true",
                    help="include prompt text in logs (off by default; --enable-log-requests is vLLM's name)")
    ap.add_argument("--log-format", choices=("auto", "json", "console"), default="auto")
    ap.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default=None,
                    help="debug adds health probes (gRPC Check/Watch, HTTP /health) to the access log (default info)")
    # Hidden, for scripts/bench_serving.py: each step sleeps this long instead of running the model.
    ap.add_argument("--simulate-step-ms", type=float, default=None, help=argparse.SUPPRESS)


HTTP_PORT = 8000  # vLLM's: an OpenAI client pointed at http://127.0.0.1:8000/v1 finds a bare `celeris serve`


def _env_port(name: str, default: Optional[int]):
    """A port from the environment (the images set them), else `default`. A string default goes
    through the flag's type=int, so a bad value is argparse's one-line error naming the flag."""
    return os.environ.get(name, "").strip() or default


def http_port(a: argparse.Namespace) -> Optional[int]:
    """The HTTP gateway's port, or None when it is off (--no-http, --port 0)."""
    return None if a.no_http or not a.http_port else a.http_port


def served_names(given: Optional[list[str]], repo_id: Optional[str]) -> tuple[str, ...]:
    """--served-model-name's names, blanks and repeats dropped; by default a Hub id (what vLLM
    serves it as), else () for the model's own name."""
    names = tuple(dict.fromkeys(n for n in given or () if n.strip()))
    return names or ((repo_id,) if repo_id else ())


def check_api_key(key: Optional[str]) -> None:
    """An empty key (`CELERIS_API_TOKEN=` from a missing Secret value, `--api-key ""`) is an error,
    never "no auth": the operator meant to require one. Whitespace alone counts as empty (no
    client could send it: the bearer credential is read stripped)."""
    if key is not None and not key.strip():
        raise EngineError("the API key is empty (--api-key or $CELERIS_API_TOKEN set to ''); give a key, or "
                          "leave both unset to serve without one")


def settings_from_args(a: argparse.Namespace, repo_id: Optional[str], allowed_origins: tuple[str, ...]):
    """The server's settings from the flags; two doors asking for one port fail here, before the
    model loads."""
    from celeris.server.settings import ServerSettings, check_distinct_ports

    settings = ServerSettings(host=a.host, port=a.grpc_port, api_token=a.api_token, rate_limit=a.rate_limit,
                              drain_seconds=a.drain_seconds, grace_seconds=a.grace_seconds,
                              metrics_port=a.metrics_port, metrics_host=a.metrics_host, http_port=http_port(a),
                              metrics_on_http=a.metrics_on_http_port,
                              trust_forwarded_for=a.trust_forwarded_for, max_streams=a.max_streams,
                              max_streams_per_connection=a.max_streams_per_connection,
                              max_health_watches=a.max_health_watches,
                              max_health_watches_per_client=a.max_health_watches_per_client,
                              max_streams_per_client=a.max_streams_per_client, unread_timeout_s=a.unread_timeout,
                              header_timeout_s=a.header_timeout, body_timeout_s=a.body_timeout,
                              allowed_origins=allowed_origins, allowed_hosts=tuple(a.allowed_hosts or ()),
                              served_model_names=served_names(a.served_model_names, repo_id),
                              ssl_keyfile=a.ssl_keyfile, ssl_certfile=a.ssl_certfile,
                              tool_call_parser=a.tool_call_parser, reasoning_parser=a.reasoning_parser)
    check_distinct_ports(settings)
    return settings


def serve_from_args(a: argparse.Namespace) -> int:
    from celeris.engine.serving import (LLM, TensorThread, configure_switch_interval, configure_threads,
                                        default_prompt_tokens)
    from celeris.server.telemetry import Metrics, Telemetry, configure_logging, make_tracer_provider
    from celeris.server.tools_api import check_names

    check_api_key(a.api_token)  # before the model loads: a bad setting fails at once
    source = model_from_args(a)  # --device cuda without CUDA: one line; a Hub id: its cached snapshot
    tls_files(a)  # unreadable or half-given TLS files fail before the model loads
    check_names(a.tool_call_parser, a.reasoning_parser)  # unknown parser names, before the model loads
    apply_model_len(a)  # --max-model-len as the prompt and canvas limits
    if a.max_prompt_tokens is None:  # the model folder's own range (engine/llm.py default_prompt_tokens)
        a.max_prompt_tokens = default_prompt_tokens(source.path, a.max_gen_length)
    check_engine_flags(a)  # vLLM's engine flags; --gpu-memory-utilization's cap before anything is allocated
    settings = settings_from_args(a, source.repo_id, origins(a.allowed_origins))
    configure_logging(None if a.log_format == "auto" else a.log_format == "json", level=log_level(a).upper())
    # Default: the CPUs this process may use (affinity, cgroup quota), less one for the event
    # loop from 4 CPUs on (engine/threads.py says why).
    threads = configure_threads(a.threads, serving=True)
    configure_switch_interval()  # the step worker gets the GIL back soon after each step
    cfg = engine_config_from_args(a, max_batch=a.max_batch, max_queue=a.max_queue,
                                  max_prompt_tokens=a.max_prompt_tokens, max_gen_length=a.max_gen_length)
    # The model is loaded on the thread that will run every step (engine/threads.py: one OpenMP
    # team; a second thread's forwards ran 2x slower on 2 CPUs).
    thread = TensorThread()
    llm = thread.call(LLM.load, source.path, cfg)
    apply_to_model(llm, a)  # --chat-template, --generation-config
    if a.simulate_step_ms is not None:  # benchmarks only: a GPU's pace, no forward
        from celeris.engine.serving import simulate

        simulate(llm, a.simulate_step_ms / 1000)
    telemetry = Telemetry(make_tracer_provider(a.trace_exporter), Metrics(), log_prompts=a.log_prompts)
    try:
        lost = asyncio.run(_serve(llm, settings, telemetry, thread, threads))
    finally:
        llm.close()  # tensor-parallel workers, if any
    return 1 if lost else 0


async def _serve(llm, settings, telemetry, thread=None, threads: int = 0) -> bool:
    """Serve until a signal, or until a tensor-parallel worker is lost (then True)."""
    import structlog

    from celeris.engine.serving import freeze_startup_heap
    from celeris.server.app import create_server
    from celeris.server.startup import log_startup

    log = structlog.get_logger("celeris")
    server, _ = await create_server(llm, settings, telemetry, thread)
    frozen = freeze_startup_heap()  # started: what lives now lives as long as the process
    log_startup(log, server, settings, llm, threads, frozen=frozen)
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task] = []

    def on_signal(sig: signal.Signals) -> None:
        # SIGTERM (Kubernetes) always drains, so balancers move traffic away first. SIGINT is a
        # person at a terminal: with nothing running there is nothing to drain, so stop at once.
        idle = sig == signal.SIGINT and server.idle
        log.info("server.signal", signal=sig.name, idle=idle)
        if not stopping:
            stopping.append(loop.create_task(server.stop(drain_seconds=0) if idle else server.stop()))

    lost: list[Exception] = []

    def on_lost(err: Exception) -> None:  # the model cannot run: NOT_SERVING, streams end, exit 1
        lost.append(err)
        log.error("server.worker_lost", error=str(err))
        if not stopping:
            stopping.append(loop.create_task(server.stop(drain_seconds=0)))

    llm.on_worker_lost(lambda err: loop.call_soon_threadsafe(on_lost, err))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    await server.wait()
    telemetry.shutdown()
    return bool(lost)
