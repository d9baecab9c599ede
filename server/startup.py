"""The start-up summary of `celeris serve`: where to reach the server (gRPC target, HTTP base URL,
web page, metrics), what it runs (model, device, dtype, torch threads), and warnings when the
process has more torch threads than it can use, or when its CPU matmuls would make a request's
tokens depend on its batch (engine/__init__.py).

A thread pool wider than the CPUs that are really free makes every step wait for its slowest
thread: on a busy 2-CPU host a request took 24.5 s with the default threads and 0.84 s with
`--threads 1`. What the process may use is the affinity mask and the cgroup CPU quota
(engine/threads.py); what is free besides is read from the 1-minute load average.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from celeris.engine.serving import affinity_cpus, cgroup_cpu_quota, gemm_rows_invariant
from celeris.server.settings import ServerSettings

WILDCARDS = ("", "0.0.0.0", "::", "[::]")


@dataclass(frozen=True)
class CpuBudget:
    """What this process may run on: the affinity mask, the cgroup quota in CPUs, the host's load."""

    affinity: int
    quota: Optional[float]
    load: Optional[float]

    @classmethod
    def read(cls) -> CpuBudget:
        try:
            load: Optional[float] = os.getloadavg()[0]
        except OSError:  # no load average on this platform
            load = None
        return cls(affinity_cpus(), cgroup_cpu_quota(), load)


def thread_warning(threads: int, cpus: CpuBudget) -> Optional[str]:
    """Why `threads` torch threads are more than this process can use, naming --threads; or None."""
    usable = cpus.affinity if cpus.quota is None else min(cpus.affinity, max(1, int(cpus.quota)))
    if threads > usable:
        why = f"{cpus.affinity} CPUs in the affinity mask" + (
            f", a cgroup CPU quota of {cpus.quota:g}" if cpus.quota is not None else "")
        return (f"{threads} torch threads but this process may use {usable} CPU(s) ({why}); "
                f"every step waits for the slowest thread: set --threads {usable}")
    if cpus.load is not None and threads > 1:
        free = max(1, int(cpus.affinity - cpus.load))
        if threads > free:
            return (f"{threads} torch threads but the host's load average is {cpus.load:.1f} on "
                    f"{cpus.affinity} CPUs (about {free} free); a busy host makes every step wait for "
                    f"the slowest thread: try --threads {free}")
    return None


def _host(host: str) -> str:
    if host in WILDCARDS:
        return "127.0.0.1"  # reachable from this machine; other machines use its address
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def summary(server: Any, settings: ServerSettings, llm: Any, threads: int) -> dict[str, Any]:
    """One record: every address a person or a client needs, and what the server runs."""
    host = _host(settings.host)
    scheme = "https" if settings.ssl_certfile else "http"
    http = f"{scheme}://{host}:{server.http.port}" if server.http is not None else None
    metrics_port = server.metrics_port
    metrics = [f"http://{_host(settings.metrics_host or settings.host)}:{metrics_port}/metrics"] if metrics_port else []
    if http and settings.metrics_on_http:
        metrics.append(f"{http}/metrics")
    return {"grpc_target": f"{host}:{server.port}", "http_base_url": f"{http}/v1" if http else None,
            "page_url": f"{http}/" if http else None, "metrics_url": ", ".join(metrics) or None,
            "model": settings.model_names(llm.name)[0], "device": llm.config.device, "dtype": llm.config.dtype,
            "threads": threads, "bind": settings.host, "tls": scheme == "https"}


def log_startup(log: Any, server: Any, settings: ServerSettings, llm: Any, threads: int,
                cpus: Optional[CpuBudget] = None, frozen: Optional[int] = None) -> None:
    """The summary as one log record (with `frozen`, the objects engine.threads.freeze_startup_heap
    took out of the collector's reach), then the thread warning if there is one."""
    extra = {} if frozen is None else {"gc_frozen_objects": frozen}
    log.info("celeris.serving", **summary(server, settings, llm, threads), **extra)
    if llm.config.device == "cpu" and (warning := thread_warning(threads, cpus or CpuBudget.read())):
        log.warning("celeris.threads", message=warning, threads=threads)
    if llm.config.device == "cpu" and not gemm_rows_invariant():
        log.warning("celeris.batch_invariance", mkl_cbwr=os.environ.get("MKL_CBWR", ""), message=(
            "float32 matmuls on this CPU round a row differently at different row counts, so a request's "
            "tokens may depend on what it is batched with: unset MKL_CBWR (Celeris then asks MKL for "
            "AUTO,STRICT) or set MKL_CBWR=AUTO,STRICT, and start no matmul before celeris is imported"))
