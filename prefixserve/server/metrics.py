"""Prometheus metrics of the server, exported on ``GET /metrics``.

Engine figures are read from ``AsyncLLM.stats()`` at each scrape (``EngineCollector``): they are
the engine's own cumulative counters and current gauges, so the export never drifts from them.
Latencies and finish reasons are observed per request by the serving code (``RequestTracker``).
Every name starts with ``prefixserve:``; counters get Prometheus' ``_total`` suffix.

=================================================  =========  =====================================
name                                               type       meaning
=================================================  =========  =====================================
``prefixserve:num_requests_running``               gauge      sequences being generated
``prefixserve:num_requests_waiting``               gauge      sequences queued
``prefixserve:kv_cache_usage_perc``                gauge      share of KV blocks in use (0..1)
``prefixserve:kv_cache_num_blocks``                gauge      KV blocks in the pool
``prefixserve:kv_cache_num_free_blocks``           gauge      KV blocks free (cached ones count)
``prefixserve:prefix_cache_hit_rate``              gauge      rolling hit rate, ~1000 requests
``prefixserve:prefix_cache_queries_total``         counter    full prompt blocks looked up
``prefixserve:prefix_cache_hits_total``            counter    ... of them found in the cache
``prefixserve:prefix_cache_query_tokens_total``    counter    the same in tokens
``prefixserve:prefix_cache_hit_tokens_total``      counter    the same in tokens
``prefixserve:num_preemptions_total``              counter    sequences preempted for KV blocks
``prefixserve:prompt_tokens_total``                counter    prompt tokens prefilled
``prefixserve:generation_tokens_total``            counter    tokens generated
``prefixserve:request_success_total``              counter    finished sequences, by
                                                              ``finished_reason`` (stop, length,
                                                              abort)
``prefixserve:time_to_first_token_seconds``        histogram  arrival to first token
``prefixserve:inter_token_latency_seconds``        histogram  between consecutive tokens
``prefixserve:e2e_request_latency_seconds``        histogram  arrival to last token
=================================================  =========  =====================================
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixserve.engine.async_llm import AsyncLLM
from prefixserve.engine.outputs import RequestOutput

PREFIX = "prefixserve:"

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0)


class EngineCollector(Collector):
    """Turns the engine's latest ``EngineStats`` into gauges and counters at each scrape."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        gauges = (
            ("num_requests_running", "Sequences being generated.", stats.num_running),
            ("num_requests_waiting", "Sequences waiting to be scheduled.", stats.num_waiting),
            ("kv_cache_usage_perc", "Share of KV cache blocks in use, from 0 to 1.",
             stats.kv_cache_usage),
            ("kv_cache_num_blocks", "KV cache blocks in the pool.", stats.num_blocks),
            ("kv_cache_num_free_blocks", "KV cache blocks not held by a request (cached blocks "
             "that no request holds count as free).", stats.num_free_blocks),
            ("prefix_cache_hit_rate", "Prefix cache hit rate (in blocks) over the most recent "
             "~1000 requests, from 0 to 1.", stats.prefix_cache_hit_rate),
        )
        for name, documentation, value in gauges:
            yield GaugeMetricFamily(PREFIX + name, documentation, value=value)
        counters = (
            ("prefix_cache_queries", "Full prompt blocks looked up in the prefix cache.",
             stats.prefix_cache_queries),
            ("prefix_cache_hits", "Full prompt blocks found in the prefix cache.",
             stats.prefix_cache_hits),
            ("prefix_cache_query_tokens", "Prompt tokens in the blocks looked up in the prefix "
             "cache.", stats.prefix_cache_query_tokens),
            ("prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache.",
             stats.prefix_cache_hit_tokens),
            ("num_preemptions", "Sequences preempted to free KV cache blocks.",
             stats.num_preemptions),
            ("prompt_tokens", "Prompt tokens of the sequences that produced a token.",
             stats.prompt_tokens),
            ("generation_tokens", "Tokens generated.", stats.generation_tokens),
        )
        for name, documentation, value in counters:
            yield CounterMetricFamily(PREFIX + name, documentation, value=value)


class ServerMetrics:
    """The registry behind ``/metrics``: the engine's figures plus per-request latencies."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        self.request_success = Counter(
            PREFIX + "request_success", "Finished sequences by finish reason (stop, length, "
            "abort: the client left or the server shut down).", ["finished_reason"],
            registry=self.registry)
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time from a request's arrival to its "
            "first generated token.", buckets=_TTFT_BUCKETS, registry=self.registry)
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds", "Time between consecutive outputs of a "
            "request that carry new tokens, as the server received them.",
            buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Time from a request's arrival to its "
            "end.", buckets=_E2E_BUCKETS, registry=self.registry)

    def track(self, n: int) -> RequestTracker:
        """A tracker for one engine request of ``n`` sequences."""
        return RequestTracker(self, n)


class RequestTracker:
    """Observes one engine request's outputs. Call ``observe`` on each output (a delta) and
    ``close`` once at the end; sequences that never finished then count as aborted."""

    def __init__(self, metrics: ServerMetrics, n: int) -> None:
        self._metrics = metrics
        self._unfinished = set(range(n))
        self._arrival: float | None = None
        self._first_token_seen = False
        self._last_token_at: float | None = None

    def observe(self, output: RequestOutput) -> None:
        metrics = self._metrics
        now = time.monotonic()
        self._arrival = output.metrics.arrival_time
        if any(c.token_ids for c in output.outputs):
            if not self._first_token_seen and output.metrics.first_token_time is not None:
                self._first_token_seen = True
                metrics.time_to_first_token.observe(
                    max(0.0, output.metrics.first_token_time - output.metrics.arrival_time))
            elif self._last_token_at is not None:
                metrics.inter_token_latency.observe(now - self._last_token_at)
            self._last_token_at = now
        for completion in output.outputs:
            if completion.finish_reason is not None and completion.index in self._unfinished:
                self._unfinished.discard(completion.index)
                metrics.request_success.labels(completion.finish_reason).inc()
        if output.finished:
            self._end()

    def close(self) -> None:
        """Counts the sequences that did not finish as aborted (if the request ever started)."""
        if self._arrival is None or not self._unfinished:
            return
        for _ in self._unfinished:
            self._metrics.request_success.labels("abort").inc()
        self._unfinished.clear()
        self._end()

    def _end(self) -> None:
        if self._arrival is not None:
            self._metrics.e2e_request_latency.observe(max(0.0, time.time() - self._arrival))
            self._arrival = None
