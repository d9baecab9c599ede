"""vLLM's metric names beside Celeris' own, so a dashboard built for vLLM works unchanged.

`VllmNames` is a Prometheus collector that, at scrape time, reads the `celeris_*` series of
server/telemetry.py (and the prefix cache's counters) and writes them again under the `vllm:`
name that means the same, with vLLM's `model_name` label. Nothing is counted twice: one event
feeds one Celeris series, and the vLLM series is that series renamed. Only metrics whose meaning
is the same are mapped (docs/operations.md lists them):

| vLLM                                     | Celeris                                   |
|------------------------------------------|-------------------------------------------|
| `vllm:num_requests_running` (gauge)      | `celeris_running_requests`                |
| `vllm:num_requests_waiting` (gauge)      | `celeris_queue_depth`                     |
| `vllm:time_to_first_token_seconds`       | `celeris_time_to_first_snapshot_seconds`  |
| `vllm:e2e_request_latency_seconds`       | `celeris_request_latency_seconds`         |
| `vllm:prompt_tokens_total`               | `celeris_prompt_tokens_total`             |
| `vllm:generation_tokens_total`           | `celeris_generated_tokens_total`          |
| `vllm:prefix_cache_queries_total`        | `celeris_prefix_cache_queries_total`      |
| `vllm:prefix_cache_hits_total`           | `celeris_prefix_cache_hits_total`         |

A diffusion model's first snapshot is its first committed tokens: the time a streaming client
waits for its first text, what vLLM's time to first token measures.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase

# vLLM's name (without a counter's _total) -> the attribute of telemetry.Metrics it renames.
RENAMED: tuple[tuple[str, str, str], ...] = (
    ("vllm:num_requests_running", "running", "Number of requests in the running batch."),
    ("vllm:num_requests_waiting", "queue_depth", "Number of requests waiting for a batch slot."),
    ("vllm:time_to_first_token_seconds", "ttfs", "Histogram of time to first token (first snapshot) in seconds."),
    ("vllm:e2e_request_latency_seconds", "latency", "Histogram of end-to-end request latency in seconds."),
    ("vllm:prompt_tokens", "prompt_tokens", "Number of prefill tokens processed."),
    ("vllm:generation_tokens", "generated_tokens", "Number of generation tokens processed."),
)


class VllmNames:
    """A collector of the `vllm:` series, read from `metrics` (telemetry.Metrics) at each scrape;
    `prefix_stats` is the prefix cache's stats reader when the model has one."""

    def __init__(self, metrics: Any, model_name: str, prefix_stats: Optional[Callable[[], Any]] = None):
        self.metrics, self.model_name, self.prefix_stats = metrics, model_name, prefix_stats

    def collect(self) -> Iterator[Metric]:
        for name, attr, doc in RENAMED:
            source: MetricWrapperBase = getattr(self.metrics, attr)
            for family in source.collect():
                yield self._renamed(family, name, doc)
        if self.prefix_stats is not None:
            s = self.prefix_stats()
            for name, value, doc in (("vllm:prefix_cache_queries", s.queried_tokens,
                                      "Prefix cache queries, in terms of number of queried tokens."),
                                     ("vllm:prefix_cache_hits", s.hit_tokens,
                                      "Prefix cache hits, in terms of number of cached tokens.")):
                family = CounterMetricFamily(name, doc, labels=["model_name"])
                family.add_metric([self.model_name], value)
                yield family

    def _renamed(self, family: Metric, name: str, doc: str) -> Metric:
        """`family` under `name`, each sample's suffix (_bucket, _total, ...) kept, model_name added."""
        out = Metric(name, doc, family.type)
        for sample in family.samples:
            out.add_sample(name + sample.name[len(family.name):], {**sample.labels, "model_name": self.model_name},
                           sample.value, sample.timestamp, sample.exemplar)
        return out
