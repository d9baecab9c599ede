"""`celeris serve` names its addresses at start-up (gRPC target, HTTP base URL, page, metrics) and
what it runs, in one log record; with more torch threads than CPUs it warns, naming --threads."""

from __future__ import annotations

import json
import os
import urllib.request

import pytest

from tests.integration.server_process import free_port


def records(path) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_serve_logs_a_summary_and_warns_of_too_many_threads(spawn):
    http_port, too_many = free_port(), len(os.sched_getaffinity(0)) + 1
    proc = spawn("--http-port", str(http_port), "--metrics-on-http-port", "--threads", str(too_many))
    logged = records(proc.log_path)
    (s,) = [r for r in logged if r.get("event") == "celeris.serving"]
    assert s["grpc_target"] == proc.target
    assert s["http_base_url"] == f"http://127.0.0.1:{http_port}/v1"
    assert s["page_url"] == f"http://127.0.0.1:{http_port}/"
    assert s["metrics_url"] == f"http://127.0.0.1:{proc.metrics_port}/metrics, http://127.0.0.1:{http_port}/metrics"
    assert (s["device"], s["dtype"], s["threads"]) == ("cpu", "float32", too_many) and s["model"]
    for url in s["metrics_url"].split(", ") + [s["page_url"], s["http_base_url"] + "/models"]:
        assert urllib.request.urlopen(url, timeout=30).status == 200  # every address it names answers
    (w,) = [r for r in logged if r.get("event") == "celeris.threads"]
    assert w["level"] == "warning" and "--threads" in w["message"] and w["threads"] == too_many


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_serve_without_http_names_only_the_grpc_target(spawn):
    proc = spawn()
    (s,) = [r for r in records(proc.log_path) if r.get("event") == "celeris.serving"]
    assert s["grpc_target"] == proc.target and s["http_base_url"] is None and s["page_url"] is None
    assert s["metrics_url"] == f"http://127.0.0.1:{proc.metrics_port}/metrics" and s["threads"] == 1
    assert s["gc_frozen_objects"] > 100_000  # the start-up heap, out of the full collections' walk
