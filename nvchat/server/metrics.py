"""/metrics: the server's requests and the engine's cache in Prometheus's text format, through
prometheus_client, on a registry of the app's own (so two apps in one process count apart).

Requests are counted when they end, with their tokens and latencies; the engine's figures (KV-cache
use, prefix-cache hits, running and waiting requests) are read from its latest snapshot at each
scrape, never waiting on a step.
"""
import time
from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine import RequestStream
from engine.backend import EngineSnapshot

CONTENT_TYPE = CONTENT_TYPE_LATEST
ENDPOINTS = ("chat", "completions")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
_DURATION_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class _EngineCollector:
    """The engine's snapshot as metrics, read at scrape time; nothing while no engine is up or the
    backend shows no cache (a remote server)."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot | None]):
        self.snapshot = snapshot

    def collect(self):
        snap = self.snapshot()
        if snap is None:
            return
        usage = GaugeMetricFamily("nvchat_kv_cache_usage_ratio", "Share of the KV cache's blocks held by requests")
        usage.add_metric([], snap.num_used_blocks / snap.num_blocks if snap.num_blocks else 0.0)
        blocks = GaugeMetricFamily("nvchat_kv_cache_blocks", "The KV cache's blocks")
        blocks.add_metric([], snap.num_blocks)
        hit_rate = GaugeMetricFamily("nvchat_prefix_cache_hit_rate",
                                     "Share of prompt tokens found in the prefix cache since the engine started")
        hit_rate.add_metric([], snap.prefix_hit_rate)
        hits = CounterMetricFamily("nvchat_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache")
        hits.add_metric([], snap.prefix_hit_tokens)
        queried = CounterMetricFamily("nvchat_prefix_cache_queried_tokens",
                                      "Prompt tokens looked up in the prefix cache")
        queried.add_metric([], snap.prompt_tokens)
        running = GaugeMetricFamily("nvchat_requests_running", "Requests the engine is running")
        running.add_metric([], snap.num_running)
        waiting = GaugeMetricFamily("nvchat_requests_waiting", "Requests waiting for room in the engine")
        waiting.add_metric([], snap.num_waiting)
        preemptions = CounterMetricFamily("nvchat_preemptions", "Requests preempted to free KV-cache blocks")
        preemptions.add_metric([], snap.num_preemptions)
        yield from (usage, blocks, hit_rate, hits, queried, running, waiting, preemptions)


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], EngineSnapshot | None]):
        self.registry = registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter("nvchat_requests", "Generation requests that ended, by endpoint and finish reason "
                                "(abort: the client left or the server stopped)", ["endpoint", "finish_reason"],
                                registry=registry)
        self.refused = Counter("nvchat_requests_refused", "Requests answered with an error before generating, "
                               "by endpoint and HTTP status", ["endpoint", "status"], registry=registry)
        self.prompt_tokens = Counter("nvchat_prompt_tokens", "Prompt tokens of the ended requests", ["endpoint"],
                                     registry=registry)
        self.cached_prompt_tokens = Counter("nvchat_prompt_tokens_cached", "Prompt tokens of the ended requests "
                                            "found in the prefix cache", ["endpoint"], registry=registry)
        self.generation_tokens = Counter("nvchat_generation_tokens", "Tokens the ended requests generated",
                                         ["endpoint"], registry=registry)
        self.time_to_first_token = Histogram("nvchat_time_to_first_token_seconds", "From a request's submission "
                                             "to its first token", ["endpoint"], buckets=_LATENCY_BUCKETS,
                                             registry=registry)
        self.inter_token_latency = Histogram("nvchat_inter_token_latency_seconds", "Each request's mean time "
                                             "between its output tokens after the first (its first choice's)", ["endpoint"],
                                             buckets=_TOKEN_GAP_BUCKETS, registry=registry)
        self.request_duration = Histogram("nvchat_request_duration_seconds", "From a request's submission to its "
                                          "end", ["endpoint"], buckets=_DURATION_BUCKETS, registry=registry)
        registry.register(_EngineCollector(snapshot))

    def request_ended(self, endpoint: str, streams: list[RequestStream]) -> None:
        """Counts a request, a stream per choice, that ended or was given up (a stream aborted by
        its client ends on the engine thread a step later: it counts as "abort" now). Its latencies
        are its first choice's."""
        first = streams[0]
        self.requests.labels(endpoint, first.finish_reason or "abort").inc()
        self.prompt_tokens.labels(endpoint).inc(first.num_prompt_tokens)
        self.cached_prompt_tokens.labels(endpoint).inc(first.num_cached_tokens)
        self.generation_tokens.labels(endpoint).inc(sum(s.num_completion_tokens for s in streams))
        end = first.finished_at or time.perf_counter()
        self.request_duration.labels(endpoint).observe(end - first.submitted_at)
        if first.first_token_at is not None:
            self.time_to_first_token.labels(endpoint).observe(first.first_token_at - first.submitted_at)
            if first.num_completion_tokens >= 2:
                gap = (end - first.first_token_at) / (first.num_completion_tokens - 1)
                self.inter_token_latency.labels(endpoint).observe(gap)

    def request_refused(self, endpoint: str, status: int) -> None:
        self.refused.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
