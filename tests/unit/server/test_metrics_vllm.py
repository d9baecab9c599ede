"""vLLM's metric names are Celeris' series renamed at scrape time (server/metrics_vllm.py): the
same values, vLLM's types and suffixes, the served name as model_name; nothing counted twice."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from celeris.server.metrics_vllm import RENAMED, VllmNames
from celeris.server.telemetry import Metrics


def _scrape(metrics: Metrics) -> dict[str, dict[str, float]]:
    """family name -> {sample name with its labels: value}."""
    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        out[fam.name] = {f"{s.name}{sorted(s.labels.items())}": s.value for s in fam.samples}
    return out


def test_every_vllm_series_reads_its_celeris_series_and_the_prefix_cache():
    m = Metrics()
    stats = SimpleNamespace(queried_tokens=40, hit_tokens=32)
    m.registry.register(VllmNames(m, "org/model", lambda: stats))
    m.prompt_tokens.inc(7)
    m.generated_tokens.inc(5)
    m.ttfs.observe(0.2)
    m.latency.observe(1.5)
    m.running.set(3)
    m.queue_depth.set(2)
    got = _scrape(m)
    assert {name for name, _, _ in RENAMED} | {"vllm:prefix_cache_queries", "vllm:prefix_cache_hits"} == {
        n for n in got if n.startswith("vllm:") and not n.endswith("_created")}
    label = "[('model_name', 'org/model')]"
    assert got["vllm:prompt_tokens"]["vllm:prompt_tokens_total" + label] == 7
    assert got["vllm:generation_tokens"]["vllm:generation_tokens_total" + label] == 5
    assert got["vllm:num_requests_running"]["vllm:num_requests_running" + label] == 3
    assert got["vllm:num_requests_waiting"]["vllm:num_requests_waiting" + label] == 2
    assert got["vllm:prefix_cache_queries"]["vllm:prefix_cache_queries_total" + label] == 40
    assert got["vllm:prefix_cache_hits"]["vllm:prefix_cache_hits_total" + label] == 32
    ttft = got["vllm:time_to_first_token_seconds"]
    assert ttft["vllm:time_to_first_token_seconds_count" + label] == 1
    assert ttft["vllm:time_to_first_token_seconds_bucket[('le', '0.25'), ('model_name', 'org/model')]"] == 1
    assert ttft["vllm:time_to_first_token_seconds_bucket[('le', '0.1'), ('model_name', 'org/model')]"] == 0
    m.generated_tokens.inc(1)  # read at scrape time: the next scrape sees the new value
    assert _scrape(m)["vllm:generation_tokens"]["vllm:generation_tokens_total" + label] == 6


def test_without_a_prefix_cache_there_are_no_prefix_series():
    m = Metrics()
    m.registry.register(VllmNames(m, "tiny"))
    assert not [n for n in _scrape(m) if "prefix_cache" in n]
